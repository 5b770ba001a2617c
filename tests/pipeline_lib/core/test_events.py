"""The event bus: listeners get what is emitted while they listen; a failing listener never reaches the emitter."""

from __future__ import annotations

from pipeline_lib.core import events
from pipeline_lib.core.events import ConversionProgress, StageStarted, TrainProgress


def test_listeners_get_events_only_while_listening():
    seen: list = []
    events.emit(StageStarted("before"))
    with events.listening(seen.append):
        events.emit(StageStarted("convert_to_tfrecords"))
    events.emit(StageStarted("after"))
    assert seen == [StageStarted("convert_to_tfrecords")]


def test_a_failing_listener_does_not_stop_the_run_or_the_others():
    seen: list = []

    def broken(event):
        raise RuntimeError("display gone")

    with events.listening(broken), events.listening(seen.append):
        events.emit(StageStarted("train"))
    assert seen == [StageStarted("train")]


def test_progress_values():
    conversion = ConversionProgress(rows=1000, bytes_read=512 * 1024, total_bytes=1024 * 1024, seconds=0.5)
    assert conversion.fraction == 0.5 and conversion.mb_per_second == 1.0 and conversion.rows_per_second == 2000
    assert ConversionProgress(rows=0, bytes_read=0, total_bytes=0, seconds=0.0).fraction is None
    training = TrainProgress(step=100, total_steps=300, loss=0.5, examples_per_second=640.0, steps_per_second=10.0,
                             eval_metrics={"eval_accuracy": 0.9})
    assert training.eta_seconds == 20.0
    assert training.describe() == "step 100 of 300 | loss 0.5000 | 640 examples/s | eval_accuracy 0.9000"
