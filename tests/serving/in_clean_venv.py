"""Run by the clean virtualenv's python (tests/serving/conftest.py::run_in_venv), never by pytest: the model's users'
side, where only the recorded requirements are installed. `python in_clean_venv.py REQUEST.pkl RESPONSE.pkl` runs each
command the request names (one process: TensorFlow and MLflow load once) and answers under the same names.

- `pyfunc`: `mlflow.pyfunc.load_model(uri).predict(rows)` for each `(uri, rows)` of `calls` (MLFLOW_TRACKING_URI
  names the store); then the first call without `missing_column`, whose error message comes back.
- `saved_model`: `tf.saved_model.load(saved_model_dir)`, its `serving_default` on `columns` (one array per input)
  and its `serve_examples` on `examples` (serialized tf.train.Example).
Both report whether anything of tfdag was imported.
"""

import importlib.util
import pickle
import sys


def pyfunc(request: dict) -> dict:
    import mlflow

    predictions, model_modules, models = {}, {}, {}
    for uri, rows in request["calls"]:
        models[uri] = mlflow.pyfunc.load_model(uri)
        predictions[uri] = models[uri].predict(rows)
        model_modules[uri] = type(models[uri].unwrap_python_model()).__module__
    uri, rows = request["calls"][0]
    try:
        models[uri].predict(rows.drop(columns=[request["missing_column"]]))
        missing_error = None
    except Exception as error:  # noqa: BLE001  (what a user sees: MLflow's schema check or the model's own error)
        missing_error = f"{type(error).__name__}: {error}"
    return {"predictions": predictions, "missing_error": missing_error, "model_modules": model_modules}


def saved_model(request: dict) -> dict:
    import tensorflow as tf

    loaded = tf.saved_model.load(request["saved_model_dir"])
    serving = loaded.signatures["serving_default"]
    examples = loaded.signatures["serve_examples"]
    columns = {name: tf.constant(value) for name, value in request["columns"].items()}
    return {
        "serving_default_inputs": sorted(serving.structured_input_signature[1]),
        "serve_examples_inputs": sorted(examples.structured_input_signature[1]),
        "serving_default": {k: v.numpy() for k, v in serving(**columns).items()},
        "serve_examples": {k: v.numpy() for k, v in examples(examples=tf.constant(request["examples"])).items()},
    }


def main() -> None:
    request_path, response_path = sys.argv[1:3]
    with open(request_path, "rb") as handle:
        request = pickle.load(handle)
    commands = {"pyfunc": pyfunc, "saved_model": saved_model}
    response = {name: commands[name](payload) for name, payload in request.items()}
    response["tfdag_importable"] = importlib.util.find_spec("pipeline_lib") is not None
    response["tfdag_modules"] = sorted(name for name in sys.modules if name.split(".")[0] in ("pipeline_lib", "tfdag"))
    with open(response_path, "wb") as handle:
        pickle.dump(response, handle)


if __name__ == "__main__":
    main()
