"""Evaluation of a trained model on the eval split: loss, accuracy, AUC, MAE, RMSE, R² and a confusion matrix,
beside the same metrics of the trivial predictor (`evaluation.trivial`)."""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from scipy import special
from sklearn.metrics import (
    accuracy_score,
    confusion_matrix,
    mean_absolute_error,
    mean_squared_error,
    r2_score,
    roc_auc_score,
)

from pipeline_lib.config import PipelineConfig, SliceSpec, Task
from pipeline_lib.core import storage
from pipeline_lib.data.manifest import DType, Manifest
from pipeline_lib.data.statistics import load_statistics
from pipeline_lib.evaluation import plots, slicing
from pipeline_lib.evaluation.report import EvalReport, EvaluationError
from pipeline_lib.evaluation.trivial import TrivialPredictor, trivial_predictor
from pipeline_lib.training import (
    column_names,
    input_pipeline,
    preprocessing,  # noqa: F401  (registers the layers load_model needs)
    staging,
)

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 256


def binary_auc(is_positive: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC of scores for a binary target (`sklearn.metrics.roc_auc_score`, ties count one half); NaN when one
    class is absent (a slice of one class)."""
    is_positive = np.asarray(is_positive, dtype=bool)
    if is_positive.all() or not is_positive.any():
        return float("nan")
    return float(roc_auc_score(is_positive, scores))


def classification_metrics(labels: np.ndarray, logits: np.ndarray) -> tuple[dict[str, float], list[list[int]]]:
    """Loss, accuracy, AUC and the confusion matrix from integer labels and logits.

    AUC is the ROC AUC of class 1's probability for two classes and the unweighted mean of the
    one-vs-rest AUCs of every class present (with negatives) for more: scikit-learn's
    `roc_auc_score(multi_class="ovr", average="macro")` when every class is present, and still
    defined on a slice that lacks some.

    Args:
        labels: int class indices, shape [n].
        logits: float scores, shape [n, num_classes].

    Returns:
        (metrics {"loss", "accuracy", "auc"}, confusion matrix [num_classes][num_classes]).

    Raises:
        EvaluationError: when a label is outside 0..num_classes-1.
    """
    labels = np.asarray(labels, dtype=np.int64)
    logits = np.asarray(logits, dtype=np.float64)
    num_classes = logits.shape[1]
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise EvaluationError(
            f"eval labels span {int(labels.min())}..{int(labels.max())} but the model outputs {num_classes} "
            f"classes; set model.num_classes to the number of label values and retrain"
        )
    log_probs = special.log_softmax(logits, axis=1)
    loss = float(-log_probs[np.arange(len(labels)), labels].mean())
    predicted = logits.argmax(axis=1)
    probs = np.exp(log_probs)
    if num_classes == 2:
        auc = binary_auc(labels == 1, probs[:, 1])
    else:
        per_class = [binary_auc(labels == c, probs[:, c]) for c in range(num_classes)]
        present = [a for a in per_class if not math.isnan(a)]
        auc = float(np.mean(present)) if present else float("nan")
    matrix = confusion_matrix(labels, predicted, labels=np.arange(num_classes))
    return {"loss": loss, "accuracy": float(accuracy_score(labels, predicted)), "auc": auc}, matrix.tolist()


def regression_metrics(targets: np.ndarray, predictions: np.ndarray) -> dict[str, float]:
    """Loss (mean squared error, the training loss), MAE, RMSE and R², all in the label's units.

    R² is `sklearn.metrics.r2_score`, but NaN when the targets are constant (scikit-learn reports 0 or 1 there,
    which would pass or fail a gate on a split that cannot measure it).
    """
    targets = np.asarray(targets, dtype=np.float64)
    predictions = np.asarray(predictions, dtype=np.float64).reshape(-1)
    mse = float(mean_squared_error(targets, predictions))
    r2 = float(r2_score(targets, predictions)) if len(targets) and np.ptp(targets) > 0 else float("nan")
    return {"loss": mse, "mae": float(mean_absolute_error(targets, predictions)), "rmse": math.sqrt(mse), "r2": r2}


def predict_split(model: keras.Model, manifest: Manifest, task: Task, *, split: str = "eval",
                  batch_size: int = DEFAULT_BATCH_SIZE,
                  keep: Sequence[str] = ()) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Labels, model outputs and the input columns named in `keep` over a whole split, read in batches.

    Returns:
        (labels [n], outputs [n, units], {feature: values [n, ...]}) as numpy arrays.

    Raises:
        EvaluationError: when the split has no records.
    """
    if manifest.num_records(split) == 0:
        raise EvaluationError(
            f"the {split!r} split of {manifest.dataset_uri} has no records; raise data.split.eval_fraction "
            "or add data so the split is not empty"
        )
    is_classification = task == Task.CLASSIFICATION
    dataset = input_pipeline.create_dataset(manifest, split, batch_size, is_classification=is_classification)

    @tf.function
    def forward(inputs):
        return tf.cast(model(inputs, training=False), tf.float32)

    numeric_columns = input_pipeline.numeric_columns(manifest.feature_schema)
    input_names = column_names.input_names(manifest.feature_schema)
    labels, outputs, kept = [], [], {name: [] for name in keep}
    for inputs, batch_labels in dataset:
        outputs.append(forward(inputs).numpy())
        labels.append(batch_labels.numpy())
        for name in keep:
            # A numeric feature is its columns of the "numeric" input; a string feature is its own input.
            value = (inputs["numeric"][:, numeric_columns[name]] if name in numeric_columns
                     else inputs[input_names[name]])
            kept[name].append(value.numpy())
    return (np.concatenate(labels), np.concatenate(outputs),
            {name: np.concatenate(parts) for name, parts in kept.items()})


def evaluate_model(model: keras.Model, manifest: Manifest, task: Task | str, *, split: str = "eval",
                   batch_size: int = DEFAULT_BATCH_SIZE, model_path: str | None = None,
                   slices: Sequence[SliceSpec] = (), plots_dir: str | None = None,
                   storage_options: Mapping[str, Any] | None = None,
                   trivial: TrivialPredictor | None = None, metrics: Sequence[str] | None = None,
                   plots_later: bool = False) -> EvalReport:
    """Score an in-memory model on a split of the manifest (the retrain flow scores its champion so).

    Args:
        model: a keras.Model taking `create_dataset`'s inputs dict and returning logits (or 1 unit for regression).
        manifest: the dataset manifest.
        task: classification or regression.
        split: the split to read.
        batch_size: records per batch.
        model_path: where the model came from, for the report.
        slices: `evaluation.slices`: metrics per slice of the split, in `EvalReport.slices`.
        plots_dir: where to write the evaluation plots (PNG, any fsspec URI), listed in `EvalReport.plots`.
        storage_options: fsspec options for `plots_dir`.
        trivial: the trivial predictor (`evaluation.trivial`), scored on the same split into `EvalReport.baseline`.
        metrics: the metrics to report (`evaluation.metrics`), in that order; default every metric of the task.
        plots_later: return once the metrics are computed, while the plots are still drawn in the background
            (`plots.draw`): `plots.wait_for(plots_dir)` writes them. By default they are written before it returns.

    Returns:
        The EvalReport, without a gate verdict.

    Raises:
        EvaluationError: when the split is empty or the labels do not fit the model's outputs.
        SliceError: when a slice names a feature the data does not have.
    """
    task = Task(task)
    features = manifest.feature_schema.features
    slicing.check_slices(slices, [f.name for f in features if f.dtype != DType.STRING],
                         [f.name for f in features if f.dtype == DType.STRING])
    keep = sorted({f for spec in slices for f in slicing.spec_features(spec)})
    labels, outputs, columns = predict_split(model, manifest, task, split=split, batch_size=batch_size, keep=keep)
    class_names = None
    if task == Task.CLASSIFICATION:
        if outputs.shape[1] < 2:
            raise EvaluationError(
                f"model.task is classification but the model has {outputs.shape[1]} output unit; a "
                "classifier needs one logit per class (model.num_classes ≥ 2)"
            )
        scores, matrix = classification_metrics(labels, outputs)
        vocabulary = manifest.feature_schema.label_vocabulary
        if vocabulary and len(vocabulary) == outputs.shape[1]:
            class_names = list(vocabulary)
    else:
        scores, matrix = regression_metrics(labels, outputs), None
    # Drawn beside the rest of the evaluation (and, with plots_later, beside what the caller does next).
    drawing = plots.draw(task, labels, outputs, class_names, plots_dir, storage_options) if plots_dir else None

    def score(part_labels: np.ndarray, part_outputs: np.ndarray) -> dict[str, float]:
        if task == Task.CLASSIFICATION:
            return classification_metrics(part_labels, part_outputs)[0]
        return regression_metrics(part_labels, part_outputs)

    baseline = score(labels, trivial.outputs(len(labels))) if trivial is not None else {}
    if metrics is not None:  # the confusion matrix stays either way: the report and the plots show it
        scores, baseline = ({m: values[m] for m in metrics if m in values} for values in (scores, baseline))
    logger.info("evaluation on %d %s examples: %s%s", len(labels), split,
                ", ".join(f"{k}={v:.4f}" for k, v in scores.items()),
                f" | trivial model ({trivial.description}): " + ", ".join(f"{k}={v:.4f}" for k, v in baseline.items())
                if trivial is not None else "")

    sliced = slicing.compute_slices(slices, columns, labels, outputs, score)
    written = {}
    if drawing is not None:
        written = plots.pending(drawing) if plots_later else drawing.wait()
    return EvalReport(task=task.value, split=split, metrics=scores, confusion_matrix=matrix,
                      class_names=class_names, num_examples=len(labels), model_path=model_path, slices=sliced,
                      plots=written, baseline=baseline,
                      baseline_model=trivial.description if trivial is not None else None)


def load_model(model_path: str, storage_options: dict[str, Any] | None = None) -> keras.Model:
    """Load a `.keras` file from a local path or any fsspec URI (copied to a temporary file first).

    Raises:
        EvaluationError: when the file does not exist.
    """
    fs, path = storage.get_fs(model_path, storage_options)
    if not fs.exists(path):
        raise EvaluationError(
            f"model file {model_path!r} does not exist; pass the keras_path of a consolidation export "
            "(<run_dir>/export/model.keras)"
        )
    if storage.is_local(model_path):
        return keras.saving.load_model(storage.local_path(model_path), compile=False)
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "model.keras")
        fs.get_file(path, local)
        return keras.saving.load_model(local, compile=False)


def evaluate(config: PipelineConfig, manifest: Manifest, model_path: str, *,
             batch_size: int = DEFAULT_BATCH_SIZE, plots_dir: str | None = None,
             plots_later: bool = False) -> EvalReport:
    """Evaluate an exported `.keras` model on the eval split (the gate is `evaluation.gate.apply_gate`, after).

    The metrics of `evaluation.metrics` (by default the task's: classification loss, accuracy, auc, with the
    confusion matrix always; regression loss, mae, rmse, r2) are reported for the model and for the trivial
    predictor of the train split (`evaluation.trivial`: its majority class or mean), on the same split.

    Args:
        config: the pipeline config (model.task, evaluation.slices).
        manifest: the dataset manifest.
        model_path: the `.keras` file (local path or fsspec URI).
        batch_size: records per batch.
        plots_dir: where to write the evaluation plots (see `evaluate_model`).
        plots_later: return while the plots are still drawn (see `evaluate_model`).

    Returns:
        The EvalReport, its `baseline` the trivial predictor's metrics, without a gate decision.

    Raises:
        EvaluationError: when the model is missing, or the eval split is empty.
    """
    task = config.model.task
    model = load_model(model_path, config.storage_options)
    statistics = load_statistics(manifest, config.storage_options)  # before staging: it stays beside the manifest
    trivial = trivial_predictor(task, manifest.feature_schema, statistics, int(model.outputs[0].shape[-1]))
    manifest = staging.stage_split(manifest, "eval", storage_options=config.storage_options)
    return evaluate_model(model, manifest, task, batch_size=batch_size, model_path=model_path,
                          slices=config.evaluation.slices, plots_dir=plots_dir,
                          storage_options=config.storage_options, trivial=trivial,
                          metrics=config.evaluation.metrics, plots_later=plots_later)
