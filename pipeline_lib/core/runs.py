"""Run identity: where one pipeline run writes (checkpoints, TensorBoard, exports, reports)."""

from __future__ import annotations

import datetime as _dt
import re
import uuid

from pipeline_lib.core import storage


def new_run_name(pipeline_name: str) -> str:
    """A sortable, unique run name: <pipeline>-<UTC timestamp>-<6 hex>."""
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", pipeline_name).strip("-") or "pipeline"
    return f"{safe}-{stamp}-{uuid.uuid4().hex[:6]}"


def runs_dir(output_root: str) -> str:
    """<output_root>/runs, where every run directory is; absolute for a local root, so every process agrees on it."""
    root = storage.local_path(output_root) if storage.is_local(output_root) else output_root
    return storage.join(root, "runs")


def run_dir_for(output_root: str, run_name: str) -> str:
    """<output_root>/runs/<run_name>."""
    return storage.join(runs_dir(output_root), run_name)
