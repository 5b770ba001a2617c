"""Reading a run's TensorBoard scalars back the way TensorBoard does (its event accumulator), for assertions."""

from __future__ import annotations

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar `tf.summary.scalar` wrote to the event files in `logdir`: tag → [(step, value)] in order."""
    accumulator = event_accumulator.EventAccumulator(
        logdir, size_guidance={event_accumulator.TENSORS: 0})
    accumulator.Reload()
    # TF2 summaries are stored as tensors: a scalar is a 0-d one.
    return {tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in accumulator.Tensors(tag)]
            for tag in accumulator.Tags()["tensors"]}
