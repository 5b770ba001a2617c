"""The evaluation plots drawn in a forked child (`plots.draw`): the same files as drawn in the caller, errors told
by the caller, and the flow's deferred writing (`pending`, `wait_for`, `written_after`)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from pipeline_lib.config import Task
from pipeline_lib.evaluation import plots


def _classification(rows: int = 120, classes: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return rng.integers(0, classes, rows), rng.normal(size=(rows, classes))


@pytest.mark.parametrize("task", [Task.CLASSIFICATION, Task.REGRESSION])
def test_a_drawing_writes_the_same_bytes_as_drawing_in_this_process(tmp_path, task):
    labels, logits = _classification()
    if task == Task.REGRESSION:
        labels, logits = logits[:, 0], logits[:, :1] * 0.5 + 0.1
    names = ["cat", "dog", "owl"] if task == Task.CLASSIFICATION else None
    here = plots.write_plots(plots.evaluation_figures(task, labels, logits, names), str(tmp_path / "here"))

    drawing = plots.draw(task, labels, logits, names, str(tmp_path / "child"))
    assert drawing._pid not in (None, os.getpid())  # drawn by a child process
    assert set(drawing.uris) == set(plots.FIGURE_NAMES[task]) == set(here)
    assert not (tmp_path / "child").exists()  # nothing written before wait()
    written = drawing.wait()

    assert written == drawing.uris
    for name in here:
        assert Path(written[name]).read_bytes() == Path(here[name]).read_bytes(), name
    assert drawing.wait() is written  # written once


def test_a_failed_drawing_is_raised_by_wait_with_its_own_error_and_nothing_is_written(tmp_path):
    labels, logits = _classification()
    logits[5, 1] = np.nan  # scikit-learn's curves refuse NaN scores

    drawing = plots.draw(Task.CLASSIFICATION, labels, logits, None, str(tmp_path / "plots"))
    with pytest.raises(plots.PlotError) as raised:
        drawing.wait()

    assert str(tmp_path / "plots") in str(raised.value)
    assert "NaN" in str(raised.value)
    assert not (tmp_path / "plots").exists()
    with pytest.raises(plots.PlotError, match="NaN"):  # asked again, the same error
        drawing.wait()


def test_a_drawing_past_its_timeout_is_killed_and_named(tmp_path):
    def slow():
        import time

        time.sleep(60)
        return {}

    drawing = plots.Drawing(slow, ["never"], str(tmp_path / "plots"))
    child = drawing._pid
    with pytest.raises(plots.PlotError, match="ran past 0.5 s and was killed"):
        drawing.wait(timeout_s=0.5)
    with pytest.raises(ChildProcessError):  # killed and reaped
        os.waitpid(child, os.WNOHANG)


def test_pending_plots_are_written_by_wait_for_and_all_written_tells_when(tmp_path):
    labels, logits = _classification()
    directory = str(tmp_path / "plots")
    uris = plots.pending(plots.draw(Task.CLASSIFICATION, labels, logits, None, directory))

    assert not plots.all_written(uris)
    with plots.written_after(directory):
        pass
    assert plots.all_written(uris)
    plots.wait_for(directory)  # nothing pending any more: nothing to do
    os.remove(uris["roc"])
    assert not plots.all_written(uris)


def test_written_after_raises_the_blocks_error_not_a_failed_drawing(tmp_path, caplog):
    labels, logits = _classification()
    logits[0, 0] = np.nan
    directory = str(tmp_path / "plots")
    plots.pending(plots.draw(Task.CLASSIFICATION, labels, logits, None, directory))

    with pytest.raises(KeyError, match="the block's"), plots.written_after(directory):
        raise KeyError("the block's")
    assert "drawing the evaluation plots" in caplog.text
    plots.wait_for(directory)  # the failed drawing was taken: nothing is left pending


def test_where_fork_fails_simulated_eagain_the_plots_are_drawn_in_this_process(tmp_path, monkeypatch):
    labels, logits = _classification()
    here = plots.write_plots(plots.evaluation_figures(Task.CLASSIFICATION, labels, logits), str(tmp_path / "here"))

    def no_fork():
        raise BlockingIOError(11, "Resource temporarily unavailable")  # what fork(2) gives at the process limit

    monkeypatch.setattr(os, "fork", no_fork)
    drawing = plots.draw(Task.CLASSIFICATION, labels, logits, None, str(tmp_path / "inline"))
    assert drawing._pid is None
    written = drawing.wait()
    assert {name: Path(uri).read_bytes() for name, uri in written.items()} == {
        name: Path(uri).read_bytes() for name, uri in here.items()}
