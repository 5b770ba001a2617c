"""The `tfdag run` console fed events directly: the live display in a (recorded) terminal, and the plain lines."""

from __future__ import annotations

import io

from rich.console import Console

from flows.console import LiveConsole, PlainConsole
from pipeline_lib.core.events import (
    ConversionProgress,
    Resize,
    Restart,
    RunSummary,
    StageFinished,
    StageStarted,
    TrainProgress,
)

SUMMARY = RunSummary(title="tfdag run digits-20261204-1200", rows=(("metrics", "accuracy: 0.9612"),
                                                                   ("blessed", "true: accuracy 0.9612 ≥ 0.9")),
                     lines=("", "tfdag | digits | accuracy: 0.9612", "tfdag | blessed: true | accuracy 0.9612 ≥ 0.9"))
MB = 1024 * 1024


def _run(show) -> None:
    show(StageStarted("check_storage"))
    show(StageFinished("check_storage", 0.4))
    show(StageStarted("convert_to_tfrecords"))
    show(ConversionProgress(rows=900, bytes_read=MB, total_bytes=2 * MB, seconds=0.5))
    show(ConversionProgress(rows=1797, bytes_read=2 * MB, total_bytes=2 * MB, seconds=1.0, done=True))
    show(StageFinished("convert_to_tfrecords", 1.2))
    show(StageStarted("train"))
    show(TrainProgress(step=60, total_steps=170, loss=0.4012, examples_per_second=1500.0, steps_per_second=40.0,
                       eval_metrics={"eval_loss": 0.41, "eval_accuracy": 0.9123}))
    show(Restart(1, 3, "worker 1 exited -9 (SIGKILL); resumed at step 40 of 170"))
    show(Resize("resize 1: 3 → 2 workers at step 40: worker 1 exited -9 (SIGKILL)"))
    show(TrainProgress(step=170, total_steps=170, loss=0.1834, examples_per_second=None))
    show(StageFinished("train", 12.5))
    show(StageStarted("evaluate"))
    show(StageFinished("evaluate", 2.0, failed=True))
    show(SUMMARY)


def test_the_live_display_shows_checklist_bars_restarts_and_the_summary_table():
    console = Console(file=io.StringIO(), force_terminal=True, record=True, width=140, color_system=None)
    display = LiveConsole(console, auto_refresh=False)
    _run(display)
    assert not display.live.is_started  # the summary ends the display
    text = console.export_text()
    # The checklist: every stage with its state and duration (the last frame of the display).
    assert "✔ check_storage        0.4 s" in text and "✔ convert_to_tfrecords 1.2 s" in text
    assert "✔ train                12.5 s" in text and "✘ evaluate             2.0 s" in text
    # The conversion bar (rows, MB/s) at 50 % then done; the training bar with steps/s, ETA, loss, eval metric.
    assert "50%" in text and "900 rows" in text and "2.0 MB/s" in text
    assert "100%" in text and "1,797 rows" in text
    assert "60/170 steps" in text and "40.0 steps/s" in text and "ETA 2.8 s" in text and "loss 0.4012" in text
    assert "eval_accuracy 0.9123" in text
    last_bar = [line for line in text.splitlines() if "170/170 steps" in line][-1]
    assert "━" in last_bar and "loss 0.1834" in last_bar and "eval_accuracy 0.9123" in last_bar  # kept from before
    assert "↻ restart 1 of 3: worker 1 exited -9 (SIGKILL); resumed at step 40 of 170" in text
    assert "⇅ resize 1: 3 → 2 workers at step 40: worker 1 exited -9 (SIGKILL)" in text
    # The summary table, after the display.
    tail = text[text.rindex("tfdag run digits-20261204-1200"):]
    assert "│ metrics │ accuracy: 0.9612" in tail and "│ blessed │ true: accuracy 0.9612 ≥ 0.9" in tail


def test_plain_lines_without_a_terminal():
    out, err = io.StringIO(), io.StringIO()
    plain = PlainConsole(out=out, err=err)
    _run(plain)
    plain.close()  # nothing more: the stages' line went out with the summary
    assert err.getvalue().splitlines() == [
        "tfdag | stages: check_storage 0.4 s, convert_to_tfrecords 1.2 s, train 12.5 s, evaluate FAILED after 2.0 s"]
    assert out.getvalue().splitlines() == list(SUMMARY.lines)


def test_after_a_failure_the_plain_console_still_gives_the_stages():
    err = io.StringIO()
    plain = PlainConsole(out=io.StringIO(), err=err)
    plain(StageFinished("check_storage", 0.4))
    plain(StageFinished("convert_to_tfrecords", 65.0, failed=True))
    plain.close()
    assert err.getvalue() == "tfdag | stages: check_storage 0.4 s, convert_to_tfrecords FAILED after 1:05\n"


def test_warnings_print_above_the_display_and_info_lines_are_held_back():
    import logging

    from flows.console import _AboveDisplay, _HeldBack

    console = Console(file=io.StringIO(), force_terminal=True, record=True, width=140, color_system=None)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(_HeldBack())
    logger = logging.getLogger("tests.console.above")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    above = _AboveDisplay(console)
    logger.addHandler(handler)
    logger.addHandler(above)
    try:
        logger.info("train | step: 50")
        logger.warning("restart 1 of 3: worker 1 exited -9")
    finally:
        logger.removeHandler(handler)
        logger.removeHandler(above)
    assert stream.getvalue() == ""  # the terminal's handler is held back
    text = console.export_text()
    assert "WARNING tests.console.above: restart 1 of 3: worker 1 exited -9" in text and "step: 50" not in text


def test_the_summary_says_where_and_why_training_stopped_early():
    from flows.console import summary_event
    from flows.pipeline import PipelineSummary
    from pipeline_lib.evaluation.report import GateDecision

    reason = ("eval_accuracy did not improve by more than 0 in 5 evaluation(s) (train.early_stopping.patience); "
              "best 0.9612 at step 400")
    gate = GateDecision(blessed=True, reason="accuracy 0.9612; no champion yet", metric="accuracy", direction="max",
                        value=0.9612, threshold=None)
    summary = PipelineSummary(
        pipeline="digits", run_name="digits-1", run_dir="/runs/digits-1", mlflow_run_id="abc", mlflow_uri="http://m",
        experiment="digits", metrics={"accuracy": 0.9612}, model_name=None, model_version=None,
        export_dir="/runs/digits-1/export", data_fingerprint="f", strategy="default", num_workers=1, num_replicas=1,
        global_batch_size=32, scaled_learning_rate=0.001, final_step=900, num_restarts=0, restarts=[], blessed=True,
        gate=gate, stopped_early=True, stopped_at_step=900, best_step=400, stop_reason=reason)
    rows = dict(summary_event(summary).rows)
    assert rows["final step"] == f"900 (stopped early: {reason})"
    assert '"stopped_at_step":900,"best_step":400' in summary.model_dump_json()  # what `tfdag run --json` prints
