"""The plots a reviewer reads instead of numbers: a confusion-matrix heatmap with class names, ROC and
precision-recall curves (one-vs-rest for more than two classes), a calibration curve; for regression, predictions
against targets and the residuals. The curves are scikit-learn's: tied scores form one step, so a curve does not
depend on the order of the rows.

Figures are drawn on matplotlib's object API (no pyplot state, safe in any thread) and written as PNG files, which
MLflow shows as images in the run's artifacts (what `mlflow.log_figure` writes).

`draw` renders them in a forked child process while its caller goes on (the flow logs and checks the model
meanwhile), and `Drawing.wait` writes what the child rendered: drawing is CPU-bound Python, which a thread would
run under its caller's lock (the GIL). The child only renders: it touches neither TensorFlow nor storage, and returns
the PNG bytes through a temporary file.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from scipy import special
from sklearn.calibration import calibration_curve
from sklearn.metrics import (
    confusion_matrix,
    precision_recall_curve,
    roc_auc_score,
    roc_curve,
)

from pipeline_lib.config import Task
from pipeline_lib.core import storage
from pipeline_lib.core.errors import TfdagError

logger = logging.getLogger(__name__)

CALIBRATION_BINS = 10
# What each task draws, by name (`evaluation_figures`): a drawing in the background names its files ahead.
FIGURE_NAMES = {Task.CLASSIFICATION: ("confusion_matrix", "roc", "precision_recall", "calibration"),
                Task.REGRESSION: ("predictions_vs_targets", "residuals")}
# How long `Drawing.wait` waits for its child before it kills it: far longer than drawing a few figures takes.
DRAW_TIMEOUT_S = 300.0
# One-vs-rest curves past this many classes would be unreadable: the most frequent classes are drawn.
MAX_CURVES = 10


def _calibration(correct: np.ndarray, confidence: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean confidence, observed frequency, count) per non-empty bin of `CALIBRATION_BINS` uniform bins."""
    frequency, mean_conf = calibration_curve(correct.astype(np.int64), confidence, pos_label=1,
                                             n_bins=CALIBRATION_BINS, strategy="uniform")
    # The counts the points are annotated with, binned as calibration_curve bins (right-closed interior edges).
    edges = np.linspace(0.0, 1.0, CALIBRATION_BINS + 1)
    counts = np.bincount(np.searchsorted(edges[1:-1], confidence), minlength=CALIBRATION_BINS)
    return mean_conf, frequency, counts[counts > 0]


def _confusion_figure(matrix: np.ndarray, names: Sequence[str]) -> Figure:
    size = max(4.0, 0.5 * len(names) + 2.5)
    fig = Figure(figsize=(size, size))
    ax = fig.subplots()
    image = ax.imshow(matrix, cmap="Blues")
    fig.colorbar(image, ax=ax, fraction=0.046)
    ax.set_xticks(range(len(names)), labels=names, rotation=45, ha="right")
    ax.set_yticks(range(len(names)), labels=names)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title("Confusion matrix (eval split)")
    high = matrix.max() / 2 if matrix.size else 0
    for (row, col), count in np.ndenumerate(matrix):
        ax.text(col, row, str(int(count)), ha="center", va="center", fontsize=8,
                color="white" if count > high else "black")
    fig.tight_layout()
    return fig


def _curves(labels: np.ndarray, probs: np.ndarray, names: Sequence[str]) -> tuple[Figure, Figure]:
    roc, pr = Figure(figsize=(5.5, 5)), Figure(figsize=(5.5, 5))
    roc_ax, pr_ax = roc.subplots(), pr.subplots()
    if probs.shape[1] == 2:
        classes = [1]
    else:
        present = np.bincount(labels, minlength=probs.shape[1])
        classes = [int(c) for c in np.argsort(-present, kind="mergesort")[:MAX_CURVES] if present[c]]
    for cls in sorted(classes):
        positive = labels == cls
        if positive.all() or not positive.any():
            continue
        fpr, tpr, _ = roc_curve(positive, probs[:, cls])
        auc = float(roc_auc_score(positive, probs[:, cls]))
        precision, recall, _ = precision_recall_curve(positive, probs[:, cls])
        label = names[cls] if probs.shape[1] > 2 else f"{names[cls]} vs rest"
        roc_ax.plot(fpr, tpr, label=f"{label} (AUC {auc:.3f})", linewidth=1.2)
        pr_ax.plot(recall, precision, label=label, linewidth=1.2)
    roc_ax.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=0.8)
    roc_ax.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC (one vs rest)")
    pr_ax.set(xlabel="recall", ylabel="precision", title="Precision-recall (one vs rest)", ylim=(0, 1.02))
    for fig, ax in ((roc, roc_ax), (pr, pr_ax)):
        ax.legend(fontsize=7, loc="lower right" if fig is roc else "lower left")
        fig.tight_layout()
    return roc, pr


def _calibration_figure(labels: np.ndarray, probs: np.ndarray) -> Figure:
    fig = Figure(figsize=(5.5, 5))
    ax = fig.subplots()
    if probs.shape[1] == 2:
        confidence, correct, what = probs[:, 1], labels == 1, "P(class 1)"
    else:
        confidence, correct, what = probs.max(axis=1), probs.argmax(axis=1) == labels, "top-class confidence"
    mean_conf, frequency, counts = _calibration(correct, confidence)
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=0.8, label="perfectly calibrated")
    ax.plot(mean_conf, frequency, marker="o", label="model")
    for x, y, n in zip(mean_conf, frequency, counts):
        ax.annotate(str(int(n)), (x, y), textcoords="offset points", xytext=(3, -10), fontsize=7)
    ax.set(xlabel=f"mean predicted {what}", ylabel="observed frequency", title="Calibration (eval split)",
           xlim=(0, 1), ylim=(0, 1.02))
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def _regression_figures(targets: np.ndarray, predictions: np.ndarray) -> dict[str, Figure]:
    scatter = Figure(figsize=(5.5, 5))
    ax = scatter.subplots()
    ax.scatter(targets, predictions, s=6, alpha=0.5)
    low, high = float(min(targets.min(), predictions.min())), float(max(targets.max(), predictions.max()))
    ax.plot([low, high], [low, high], linestyle="--", color="grey", linewidth=0.8)
    ax.set(xlabel="target", ylabel="prediction", title="Predictions vs targets (eval split)")
    scatter.tight_layout()
    residual = Figure(figsize=(5.5, 5))
    ax = residual.subplots()
    ax.scatter(predictions, predictions - targets, s=6, alpha=0.5)
    ax.axhline(0.0, linestyle="--", color="grey", linewidth=0.8)
    ax.set(xlabel="prediction", ylabel="residual (prediction − target)", title="Residuals (eval split)")
    residual.tight_layout()
    return {"predictions_vs_targets": scatter, "residuals": residual}


def evaluation_figures(task: Task, labels: np.ndarray, outputs: np.ndarray,
                       class_names: Sequence[str] | None = None) -> dict[str, Figure]:
    """The plots of one evaluation, by name: classification → confusion_matrix, roc, precision_recall,
    calibration; regression → predictions_vs_targets, residuals."""
    if task != Task.CLASSIFICATION:
        return _regression_figures(np.asarray(labels, dtype=np.float64).reshape(-1),
                                   np.asarray(outputs, dtype=np.float64).reshape(-1))
    labels = np.asarray(labels, dtype=np.int64)
    probs = special.softmax(np.asarray(outputs, dtype=np.float64), axis=1)
    num_classes = probs.shape[1]
    names = list(class_names) if class_names and len(class_names) == num_classes else [str(i) for i in
                                                                                       range(num_classes)]
    matrix = confusion_matrix(labels, probs.argmax(axis=1), labels=np.arange(num_classes))
    roc, pr = _curves(labels, probs, names)
    return {"confusion_matrix": _confusion_figure(matrix, names), "roc": roc, "precision_recall": pr,
            "calibration": _calibration_figure(labels, probs)}


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def _write_pngs(pngs: Mapping[str, bytes], directory: str,
                storage_options: Mapping[str, Any] | None) -> dict[str, str]:
    written = {}
    for name, png in pngs.items():
        uri = storage.join(directory, f"{name}.png")
        fs, path = storage.get_fs(uri, dict(storage_options or {}))
        storage.write_bytes_atomic(fs, path, png)
        written[name] = uri
    return written


def write_plots(figures: Mapping[str, Figure], directory: str,
                storage_options: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Each figure as `<directory>/<name>.png` (any fsspec URI); returns name → URI."""
    return _write_pngs({name: _png(figure) for name, figure in figures.items()}, directory, storage_options)


class PlotError(TfdagError, RuntimeError):
    """Drawing the evaluation plots failed; the message holds the drawing's own error."""


class Drawing:
    """The plots of one evaluation, rendered by a forked child while the caller goes on (inline where the platform
    cannot fork). `uris` are known at once; `wait` writes the files there and returns them."""

    def __init__(self, render: Callable[[], Mapping[str, Figure]], names: Sequence[str], directory: str,
                 storage_options: Mapping[str, Any] | None = None):
        self.directory = directory
        self.storage_options = storage_options
        self.uris = {name: storage.join(directory, f"{name}.png") for name in names}
        self._written: dict[str, str] | None = None
        self._pid: int | None = None
        # ("ok", name → PNG bytes) or ("error", why): set once, by the inline drawing or by `wait` from the child's.
        self._outcome: tuple[str, Any] | None = None
        self._result = tempfile.TemporaryFile()  # noqa: SIM115 - closed once the outcome is read
        try:
            pid = os.fork()
        except (AttributeError, OSError) as error:  # no fork here, or no process to be had (EAGAIN, ENOMEM)
            logger.debug("evaluation plots drawn in this process: cannot fork (%s)", error)
            self._result.close()
            self._outcome = self._render(render)
            return
        if pid == 0:  # the child: render, leave the outcome in the file, end without the parent's exit handlers
            code = 1
            try:
                pickle.dump(self._render(render), self._result)
                self._result.flush()
                code = 0
            finally:
                os._exit(code)
        self._pid = pid

    @staticmethod
    def _render(render: Callable[[], Mapping[str, Figure]]) -> tuple[str, Any]:
        try:
            return "ok", {name: _png(figure) for name, figure in render().items()}
        except Exception as error:  # noqa: BLE001 - reported by wait(), in the caller
            return "error", "".join(traceback.format_exception(error))[-3000:]

    def _child_outcome(self, timeout_s: float) -> tuple[str, Any]:
        """The child's outcome, once it ended (killed past `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        try:
            while not (ended := os.waitpid(self._pid, os.WNOHANG))[0]:
                if time.monotonic() > deadline:
                    os.kill(self._pid, signal.SIGKILL)
                    os.waitpid(self._pid, 0)
                    return "error", f"the drawing process ran past {timeout_s:g} s and was killed"
                time.sleep(0.01)
            self._result.seek(0)
            try:
                return pickle.load(self._result)
            except EOFError:
                return "error", f"the drawing process ended without a result ({os.waitstatus_to_exitcode(ended[1])})"
        finally:
            self._pid = None
            self._result.close()

    def wait(self, timeout_s: float = DRAW_TIMEOUT_S) -> dict[str, str]:
        """Write the rendered plots under the directory (once) and return name → URI.

        Raises:
            PlotError: naming the directory and the drawing's error (its traceback's tail), on every call.
        """
        if self._outcome is None:
            self._outcome = self._child_outcome(timeout_s)
        if self._written is None:
            kind, value = self._outcome
            if kind != "ok":
                raise PlotError(f"drawing the evaluation plots for {self.directory} failed: {value}")
            if set(value) != set(self.uris):
                raise PlotError(f"the evaluation plots drawn for {self.directory} were {sorted(value)}, "
                                f"not the {sorted(self.uris)} their files were named for")
            self._written = _write_pngs(value, self.directory, self.storage_options)
        return self._written


def draw(task: Task, labels: np.ndarray, outputs: np.ndarray, class_names: Sequence[str] | None, directory: str,
         storage_options: Mapping[str, Any] | None = None) -> Drawing:
    """Start drawing `evaluation_figures` under `directory` in the background (see `Drawing`)."""
    return Drawing(lambda: evaluation_figures(task, labels, outputs, class_names), FIGURE_NAMES[Task(task)],
                   directory, storage_options)


# The drawings `pending` handed over, by directory, until `wait_for` writes them.
_pending: dict[str, Drawing] = {}


def pending(drawing: Drawing) -> dict[str, str]:
    """Leave `drawing` to `wait_for(drawing.directory)`; its files' URIs, name → URI (not written yet)."""
    _pending[drawing.directory] = drawing
    return dict(drawing.uris)


def wait_for(directory: str) -> None:
    """Write the plots still drawn for `directory` (`pending`); nothing when none are.

    Raises:
        PlotError: see `Drawing.wait`.
    """
    drawing = _pending.pop(directory, None)
    if drawing is not None:
        drawing.wait()


@contextlib.contextmanager
def written_after(directory: str) -> Iterator[None]:
    """Run the block while the plots of `directory` are drawn, then write them (`wait_for`). When the block raises,
    its error is the one raised: a failed drawing is then only logged."""
    try:
        yield
    except BaseException:
        try:
            wait_for(directory)
        except PlotError as error:
            logger.warning("%s", error)
        raise
    wait_for(directory)


def all_written(uris: Mapping[str, str], storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether every plot file exists (a kept evaluation whose plots were never written is evaluated again)."""
    for uri in uris.values():
        fs, path = storage.get_fs(uri, dict(storage_options or {}))
        if not fs.exists(path):
            return False
    return True
