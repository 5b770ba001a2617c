"""Keras 3 model factories: the `ModelFactory` protocol, the built-in MLP and CNN, and `package.module:function`.

Every factory, built-in or the user's, is a `ModelFactory`: it receives one `FactoryInputs` (the schema, the
number of outputs, the task, `model.params`, the dataset statistics and the label's) and returns a keras.Model. The
built-ins start with the preprocessing of `training.preprocessing`, built from the statistics (imputation, z-scores,
vocabularies): `model.params.normalize: false` keeps only the imputation and hashes strings. For regression they end
with `create_head`: the head outputs the label's z-score, which a standard `Rescaling` layer maps to the label's
units with the train split's mean and standard deviation (`model.params.scale_label: false` leaves it out).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import keras

from pipeline_lib.config import ModelConfig, Task
from pipeline_lib.core.errors import UserError
from pipeline_lib.data.manifest import Schema
from pipeline_lib.data.statistics import DatasetStatistics, NumericStatistics
from pipeline_lib.training.input_pipeline import (
    feature_width,
    input_signature,
)
from pipeline_lib.training.preprocessing import (
    numeric_block,
    preprocess_inputs,
    string_blocks,
    time_blocks,
)

logger = logging.getLogger(__name__)


class ModelFactoryError(UserError, ValueError):
    """A model factory cannot be imported, called or returns something that is not a keras.Model."""


@dataclasses.dataclass(frozen=True)
class FactoryInputs:
    """What a model factory receives.

    Attributes:
        schema: the data schema (from the manifest): the features `create_inputs(schema)` makes Keras inputs of.
        num_outputs: output units: num_classes logits for classification, 1 for regression.
        task: classification or regression (`model.task`).
        params: `model.params`, as written in the config.
        statistics: the train split's statistics (`data.statistics`), for preprocessing layers built from them;
            None for a dataset without them.
        label_statistics: regression only: the label's train-split statistics (mean, variance), for an output
            layer in the label's units (`create_head`); None for classification or a dataset without statistics.
            A custom factory opts in by ending with `create_head(x, inputs)`, or out by ignoring it.
    """

    schema: Schema
    num_outputs: int
    task: Task
    params: Mapping[str, Any]
    statistics: DatasetStatistics | None = None
    label_statistics: NumericStatistics | None = None


class ModelFactory(Protocol):
    """A model factory: `model.factory` names one, `mlp`, `cnn` or `package.module:function`.

    Its model takes the inputs dict of `input_pipeline.create_dataset` (raw values; `create_inputs(schema)`) and
    returns logits, `num_outputs` wide. A factory rejects bad `params` with a TypeError or ModelFactoryError.
    """

    def __call__(self, inputs: FactoryInputs) -> keras.Model: ...


def num_outputs(model_config: ModelConfig, schema) -> int:
    """Output units: num_classes logits for classification, 1 for regression.

    Raises:
        ModelFactoryError: for classification when neither the config nor the schema gives num_classes.
    """
    if model_config.task == Task.REGRESSION:
        return 1
    classes = model_config.num_classes or schema.num_classes
    if classes is None and schema.label_vocabulary:
        classes = len(schema.label_vocabulary)
    if classes is None:
        raise ModelFactoryError(
            f"model.task is classification but neither model.num_classes nor the data schema gives the number "
            f"of classes of label {schema.label.name!r}; set model.num_classes"
        )
    return int(classes)


def create_inputs(schema) -> dict[str, keras.KerasTensor]:
    """Keras Input tensors matching `input_pipeline.create_dataset`'s inputs dict: `"numeric"` for the numbers, and
    each string, date or timestamp column by its safe name (`column_names.input_names`: a plain name is its own)."""
    return {
        key: keras.Input(shape=spec.shape[1:], dtype=spec.dtype.name, name=spec.name)
        for key, spec in input_signature(schema).items()
    }


def label_statistics(task: Task, schema: Schema, statistics: DatasetStatistics | None) -> NumericStatistics | None:
    """The label's train-split statistics for a regression with statistics; else None."""
    if task != Task.REGRESSION or statistics is None:
        return None
    label = statistics.feature(schema.label.name, "train")
    numeric = label.numeric if label is not None else None
    return numeric if numeric is not None and numeric.mean is not None else None


def create_head(x, inputs: FactoryInputs, *, scale_label: bool = True):
    """The output layer of a model: `inputs.num_outputs` float32 units (even under mixed_float16, for a stable loss).

    For a regression with `inputs.label_statistics` (and `scale_label`), the Dense head outputs the label's z-score
    (its bias starts at 0: at the train mean), and a standard `keras.layers.Rescaling(scale=std, offset=mean)` maps
    it to the label's units: the initial weights give predictions of the label's spread around its mean, each
    update moves them on the label's scale whatever its units, and the exported model outputs (and serves) the
    label's values, loadable without tfdag's classes.
    Otherwise the head is a plain Dense layer of logits (or raw outputs).
    """
    stats = inputs.label_statistics if scale_label and inputs.task == Task.REGRESSION else None
    if stats is None:
        return keras.layers.Dense(inputs.num_outputs, dtype="float32", name="logits")(x)
    z = keras.layers.Dense(inputs.num_outputs, dtype="float32", name="logits")(x)
    std = math.sqrt(stats.variance) if stats.variance else 1.0  # a constant label: only its mean to learn
    return keras.layers.Rescaling(scale=std, offset=float(stats.mean), dtype="float32", name="label_units")(z)


def _mlp(schema, num_outputs: int, hidden_units=(128, 64), dropout: float = 0.0,
               activation: str = "relu", statistics: DatasetStatistics | None = None, normalize: bool = True,
               head: Callable[[Any], Any] | None = None, **params: Any) -> keras.Model:
    """A multilayer perceptron over the preprocessed numbers and strings.

    Args:
        schema: the data schema.
        num_outputs: output units.
        hidden_units: widths of the hidden Dense layers.
        dropout: dropout rate after each hidden layer (0: none).
        activation: hidden activation.
        statistics: the dataset statistics the preprocessing is built from (None: raw inputs, hashed strings).
        normalize: z-score numbers and look strings up in their vocabulary (`model.params.normalize`).
        head: builds the output layer on the last hidden layer (`create_head`); default a plain Dense layer.
        **params: `hash_bins`, `embedding_dim`, `max_vocabulary`, `one_hot_max` for string features.

    Returns:
        A functional keras.Model from the inputs dict (raw values) to logits (regression: the label's values).
    """
    inputs = create_inputs(schema)
    parts = preprocess_inputs(inputs, schema, statistics, params, normalize=normalize)
    if not parts:
        raise ModelFactoryError("the schema has no features; the MLP needs at least one input")
    x = parts[0] if len(parts) == 1 else keras.layers.Concatenate(name="features")(parts)
    for i, units in enumerate(hidden_units):
        x = keras.layers.Dense(int(units), activation=activation, name=f"dense_{i}")(x)
        if dropout:
            x = keras.layers.Dropout(float(dropout), name=f"dropout_{i}")(x)
    return keras.Model(inputs, _output(x, num_outputs, head), name="mlp")


def _cnn(schema, num_outputs: int, image_shape=None, filters=(16, 32), kernel_size: int = 3,
               dense_units: int = 64, activation: str = "relu", dropout: float = 0.0,
               statistics: DatasetStatistics | None = None, normalize: bool = True,
               head: Callable[[Any], Any] | None = None, **params: Any) -> keras.Model:
    """A small CNN: the numeric vector reshaped to `image_shape`, Conv2D blocks, then Dense.

    Args:
        schema: the data schema.
        num_outputs: output units.
        image_shape: `[height, width, channels]` whose product is the numeric feature width.
        filters: channels of each Conv2D block.
        kernel_size: Conv2D kernel size.
        dense_units: width of the Dense layer after the convolutions.
        activation: activation of every hidden layer.
        dropout: dropout before the head (0: none).
        statistics: the dataset statistics the preprocessing is built from (None: raw inputs, hashed strings).
        normalize: z-score the pixels and look strings up in their vocabulary (`model.params.normalize`).
        head: builds the output layer on the last hidden layer (`create_head`); default a plain Dense layer.
        **params: `hash_bins`, `embedding_dim`, `max_vocabulary`, `one_hot_max` for string features.

    Raises:
        ModelFactoryError: when image_shape is missing or does not match the feature width.
    """
    width = feature_width(schema)
    if image_shape is None:
        side = round(width ** 0.5)
        if side * side != width:
            raise ModelFactoryError(
                f"model.params.image_shape is required for the cnn factory: the numeric width {width} is not a "
                "square; set e.g. image_shape: [h, w, 1] with h*w*1 == width"
            )
        image_shape = (side, side, 1)
    image_shape = tuple(int(d) for d in image_shape)
    size = 1
    for dim in image_shape:
        size *= dim
    if size != width:
        raise ModelFactoryError(
            f"model.params.image_shape {list(image_shape)} holds {size} values but the numeric features are "
            f"{width} wide; choose a shape whose product is {width}"
        )
    inputs = create_inputs(schema)
    # No missing-value indicators: they would change the width the image shape is made of.
    numeric = numeric_block(inputs, schema, statistics, normalize=normalize, indicators=False)
    x = keras.layers.Reshape(image_shape, name="image")(numeric)
    for i, channels in enumerate(filters):
        x = keras.layers.Conv2D(int(channels), int(kernel_size), padding="same", activation=activation,
                                name=f"conv_{i}")(x)
        if min(x.shape[1], x.shape[2]) >= 2:
            x = keras.layers.MaxPooling2D(2, name=f"pool_{i}")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    # Strings and the calendar parts of dates and timestamps join beside the image, not in it.
    strings = (string_blocks(inputs, schema, statistics, params, normalize=normalize)
               + time_blocks(inputs, schema, statistics, normalize=normalize))
    if strings:
        x = keras.layers.Concatenate(name="features")([x, *strings])
    x = keras.layers.Dense(int(dense_units), activation=activation, name="dense")(x)
    if dropout:
        x = keras.layers.Dropout(float(dropout), name="dropout")(x)
    return keras.Model(inputs, _output(x, num_outputs, head), name="cnn")


def _output(x, num_outputs: int, head: Callable[[Any], Any] | None):
    return head(x) if head is not None else keras.layers.Dense(num_outputs, dtype="float32", name="logits")(x)


def _builtin_params(inputs: FactoryInputs) -> dict[str, Any]:
    """A built-in's keyword arguments: `model.params`, the statistics and the head (`scale_label`, default on)."""
    params = dict(inputs.params)
    scale_label = bool(params.pop("scale_label", True))
    return {**params, "statistics": inputs.statistics,
            "head": lambda x: create_head(x, inputs, scale_label=scale_label)}


def create_mlp(inputs: FactoryInputs) -> keras.Model:
    """The `mlp` factory: `model.params` are `_mlp`'s keyword arguments, and `scale_label` (`create_head`)."""
    return _mlp(inputs.schema, inputs.num_outputs, **_builtin_params(inputs))


def create_cnn(inputs: FactoryInputs) -> keras.Model:
    """The `cnn` factory: `model.params` are `_cnn`'s keyword arguments, and `scale_label` (`create_head`)."""
    return _cnn(inputs.schema, inputs.num_outputs, **_builtin_params(inputs))


BUILTINS: dict[str, ModelFactory] = {"mlp": create_mlp, "cnn": create_cnn}
PROTOCOL = f"{__name__}.ModelFactory"  # how errors name it


def _parameters(fn: Callable[..., Any]) -> Mapping[str, inspect.Parameter] | None:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None  # a builtin or C callable: judged when it is called


def _is_keyword_factory(fn: Callable[..., Any]) -> bool:
    """A factory written before `ModelFactory`: `fn(schema, num_outputs, **params)`, still called that way."""
    parameters = _parameters(fn)
    return parameters is not None and "schema" in parameters and "num_outputs" in parameters


def import_factory(factory: str) -> ModelFactory | Callable[..., keras.Model]:
    """Import `package.module:function` and check that it can be called as a `ModelFactory`.

    Raises:
        ModelFactoryError: naming the factory when the module or function cannot be found, or the function
            cannot take one `FactoryInputs`.
    """
    module_name, _, function_name = factory.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ModelFactoryError(
            f"model.factory {factory!r}: cannot import module {module_name!r} ({error}); install the package "
            "or put it on PYTHONPATH, or use a built-in factory ('mlp', 'cnn')"
        ) from error
    fn = getattr(module, function_name, None)
    if fn is None or not callable(fn):
        raise ModelFactoryError(
            f"model.factory {factory!r}: module {module_name!r} has no function {function_name!r}; "
            f"define it as a {PROTOCOL}"
        )
    if not _is_keyword_factory(fn) and (parameters := _parameters(fn)) is not None:
        try:
            inspect.Signature(list(parameters.values())).bind(None)
        except TypeError as error:
            raise ModelFactoryError(
                f"model.factory {factory!r} cannot be called with one FactoryInputs ({error}); define it as a "
                f"{PROTOCOL}, whose one argument holds the schema, num_outputs, task, params and statistics"
            ) from None
    return fn


def _call(fn: ModelFactory | Callable[..., keras.Model], inputs: FactoryInputs) -> Any:
    if not _is_keyword_factory(fn):
        return fn(inputs)
    params = dict(inputs.params)
    for name in ("statistics", "label_statistics"):
        if name in (_parameters(fn) or {}):
            params[name] = getattr(inputs, name)
    return fn(schema=inputs.schema, num_outputs=inputs.num_outputs, **params)


def create_model(model_config: ModelConfig, schema, statistics: DatasetStatistics | None = None) -> keras.Model:
    """Build the Keras 3 model named by `model.factory` for this schema.

    The factory is called with one `FactoryInputs` (see `ModelFactory`). A custom factory written the older
    way, with `schema` and `num_outputs` parameters, is still called as `fn(schema=, num_outputs=, **params)`,
    with `statistics=` and `label_statistics=` too when it has those parameters.

    Args:
        model_config: the `model` config section.
        schema: the data schema (from the manifest).
        statistics: the dataset statistics (`data.statistics.load_statistics`); None for a dataset without them.

    Returns:
        A keras.Model taking the inputs dict of `create_dataset` and returning logits
        (num_classes wide for classification, 1 wide for regression: the label's values with the built-ins).

    Raises:
        ModelFactoryError: when the factory cannot be imported, rejects its params, or returns no keras.Model.
    """
    inputs = FactoryInputs(schema=schema, num_outputs=num_outputs(model_config, schema), task=model_config.task,
                           params=dict(model_config.params), statistics=statistics,
                           label_statistics=label_statistics(model_config.task, schema, statistics))
    fn = BUILTINS.get(model_config.factory) or import_factory(model_config.factory)
    try:
        model = _call(fn, inputs)
    except TypeError as error:
        raise ModelFactoryError(
            f"model.factory {model_config.factory!r} rejected model.params {sorted(inputs.params)}: {error}; "
            f"check the parameter names against the factory's (a {PROTOCOL})"
        ) from error
    if not isinstance(model, keras.Model):
        raise ModelFactoryError(
            f"model.factory {model_config.factory!r} returned {type(model).__name__}, not a keras.Model; "
            f"return a Keras 3 model (see {PROTOCOL})"
        )
    logger.info("model %s: %d parameters, %d outputs", model.name, model.count_params(), inputs.num_outputs)
    return model
