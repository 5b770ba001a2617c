"""The `batch-predict` flow: `tfdag predict` as a Prefect flow (the deployment scores with `@champion`)."""

from __future__ import annotations

from pipeline_lib.core.quiet import import_tensorflow

# A flow-run process (a Prefect worker's) loads TensorFlow here, before anything else does: its start-up lines
# held back unless TFDAG_VERBOSE=1.
import_tensorflow()

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from pipeline_lib.config import PredictConfig
from pipeline_lib.prediction.scoring import PredictResult
from tasks.predict import predict_table
from tasks.progress import artifact_key


@flow(name="batch-predict", log_prints=True)
def batch_predict(params: PredictConfig) -> PredictResult:
    """Score `params.input` with `params.model` into `params.output`, chunk by chunk.

    Storage credentials travel as `${VARIABLE}` or `${prefect-secret:NAME}` references in `storage_options`, resolved
    where the storage is opened: Prefect records the parameters, and a literal secret is recorded masked (and then
    refused when the storage is opened).

    Args:
        params: the model (`models:/NAME@champion`), the input and output URLs, the kept columns, the chunk size and
            what a bad row does.

    Returns:
        The PredictResult: the model version that scored, the rows scored and skipped, the time taken.
    """
    result = predict_table(params)
    model = result.model
    lines = [f"# Batch predictions: {result.num_rows} rows", "",
             f"- **model:** `{model.describe()}`" + (f", run `{model.run_id}`" if model.run_id else ""),
             f"- **input:** `{result.input}`", f"- **output:** `{result.output}` ({result.output_format.value})",
             f"- **skipped bad rows:** {result.num_skipped}",
             *([f"- **engine:** ray, parts per node: {result.nodes}"] if result.engine == "ray" else []),
             f"- **time:** {result.seconds:.1f} s ({result.rows_per_second:,.0f} rows/s)"]
    lines += [f"  - {sample}" for sample in result.bad_samples]
    create_markdown_artifact("\n".join(lines) + "\n", key=artifact_key("batch-predict"),
                             description="Batch predictions")
    return result
