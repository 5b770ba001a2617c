"""The typed results of an evaluation: the report of one model on one split and the gate's decision."""

from __future__ import annotations

import json
import math

from pydantic import BaseModel, ConfigDict

from pipeline_lib.core.errors import TfdagError
from pipeline_lib.evaluation.slicing import SliceResult, slices_to_markdown


class EvaluationError(TfdagError, RuntimeError):
    """The model cannot be evaluated or gated; the message names the value, its source and the fix."""


class GateDecision(BaseModel):
    """Whether a model is blessed: `evaluation.gate.threshold`, the trivial predictor (`beat_baseline`), then
    `min_improvement` over the champion.

    The one verdict for the training pipeline and the retrain flow; `champion_value` is the champion's score on the
    same eval split (None when there is no champion).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    blessed: bool
    reason: str
    metric: str
    direction: str  # "max" or "min"
    value: float | None
    threshold: float | None
    champion_value: float | None = None
    champion_version: int | None = None
    min_improvement: float = 0.0
    baseline_value: float | None = None  # the trivial predictor's score on the same split; None when not gated on
    baseline_margin: float = 0.0
    failing_slices: tuple[str, ...] = ()  # slices below evaluation.gate.slice_threshold


class EvalReport(BaseModel):
    """Metrics of one model on one split."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task: str  # Task value
    split: str = "eval"
    metrics: dict[str, float]
    confusion_matrix: list[list[int]] | None = None  # rows: true class, columns: predicted class
    class_names: list[str] | None = None
    num_examples: int
    model_path: str | None = None
    gate: GateDecision | None = None
    slices: list[SliceResult] = []  # evaluation.slices, one entry per slice present in the split
    plots: dict[str, str] = {}  # plot name → PNG URI (confusion matrix, ROC, PR, calibration; regression plots)
    # The trivial predictor's metrics on the same split (`evaluation.trivial`) and what it predicts; empty / None
    # for a dataset without statistics.
    baseline: dict[str, float] = {}
    baseline_model: str | None = None

    def to_json(self) -> str:
        """The report as indented JSON (NaN metrics become null)."""
        payload = self.model_dump(mode="json")
        for key in ("metrics", "baseline"):
            payload[key] = {k: (None if math.isnan(v) else v) for k, v in getattr(self, key).items()}
        return json.dumps(payload, indent=2, sort_keys=True)

    def to_markdown(self) -> str:
        """A metrics table, the gate's verdict and the confusion matrix, as Markdown."""
        lines = [f"# Evaluation on the {self.split} split", "",
                 f"{self.num_examples} examples, task {self.task}"
                 + (f", model `{self.model_path}`" if self.model_path else ""), "",
                 *([f"Trivial model: {self.baseline_model}.", ""] if self.baseline_model else []),
                 "| metric | value |" + (" trivial model |" if self.baseline else ""),
                 "|---|---|" + ("---|" if self.baseline else "")]
        lines += [f"| {name} | {value:.4f} |" + (f" {self.baseline.get(name, float('nan')):.4f} |" if self.baseline
                                                  else "") for name, value in self.metrics.items()]
        if self.gate is not None:
            verdict = "blessed" if self.gate.blessed else "NOT blessed"
            lines += ["", f"**Gate: {verdict}.** {self.gate.reason}"]
        if self.confusion_matrix is not None:
            names = self.class_names or [str(i) for i in range(len(self.confusion_matrix))]
            lines += ["", "## Confusion matrix (rows: true, columns: predicted)", "",
                      "| true \\ predicted | " + " | ".join(names) + " |",
                      "|---|" + "---|" * len(names)]
            lines += [f"| **{names[i]}** | " + " | ".join(str(c) for c in row) + " |"
                      for i, row in enumerate(self.confusion_matrix)]
        if self.slices:
            failing = self.gate.failing_slices if self.gate is not None else ()
            lines += ["", slices_to_markdown(self.slices, failing).replace("# Metrics per slice", "## Metrics per slice",
                                                                          1).rstrip()]
        if self.plots:
            lines += ["", "## Plots", ""] + [f"- {name}: `{uri}`" for name, uri in self.plots.items()]
        return "\n".join(lines) + "\n"
