"""Tests for pipeline_lib.checkpoints.selection: the selection metric, the best checkpoint, retention."""

from __future__ import annotations

import pytest

from pipeline_lib.checkpoints import selection
from pipeline_lib.checkpoints.records import CheckpointRecord
from pipeline_lib.config import Direction, parse_config


def _config(task="classification", **gate):
    return parse_config({"data": {"source": "x.csv", "label": "label"}, "model": {"task": task},
                         "evaluation": {"gate": gate}})


def _records(values: dict[int, float], metric: str = "eval_accuracy") -> list[CheckpointRecord]:
    return [CheckpointRecord(step=s, path=f"/x/ckpt-{s}", metrics={metric: v}) for s, v in values.items()]


@pytest.mark.parametrize("task,gate,expected", [
    ("classification", {"metric": "accuracy"}, ("eval_accuracy", Direction.MAX)),
    ("classification", {"metric": "accuracy", "direction": "min"}, ("eval_accuracy", Direction.MIN)),
    ("classification", {"metric": "loss", "direction": "max"}, ("eval_loss", Direction.MIN)),
    ("regression", {"metric": "rmse"}, ("eval_rmse", Direction.MIN)),
    ("classification", {"metric": "auc"}, ("eval_loss", Direction.MIN)),
    ("classification", {}, ("eval_accuracy", Direction.MAX)),  # the task's default gate metric
    ("regression", {}, ("eval_rmse", Direction.MIN)),
    ("regression", {"metric": "mae"}, ("eval_mae", Direction.MIN)),
    ("regression", {"metric": "r2"}, ("eval_r2", Direction.MAX)),
])
def test_selection_metric_maps_the_gate_metric_and_takes_its_direction_from_metric_direction(task, gate, expected):
    assert selection.selection_metric(_config(task, **gate)) == expected


def test_best_checkpoint_follows_the_direction_and_prefers_the_newest_among_ties():
    records = _records({1: 0.9, 2: 0.5, 3: 0.9})
    assert selection.best_checkpoint(records, "eval_accuracy", Direction.MAX).step == 3
    assert selection.best_checkpoint(records, "eval_accuracy", Direction.MIN).step == 2
    assert selection.best_checkpoint(records, "eval_loss", Direction.MAX) is None
    assert selection.best_checkpoint(records, None) is None


def test_a_lower_is_better_metric_is_minimised_whatever_is_declared():
    records = _records({1: 0.2, 2: 0.4}, metric="eval_loss")
    assert [r.step for r in selection.rank_by_metric(records, "eval_loss", Direction.MAX)] == [1, 2]


def test_steps_to_keep_are_the_newest_plus_the_best():
    records = _records({1: 0.9, 2: 0.5, 3: 0.6, 4: 0.7, 5: 0.8})
    assert selection.steps_to_keep(records, 2, "eval_accuracy", Direction.MAX) == {1, 4, 5}
    assert selection.steps_to_keep(records, 2, None) == {4, 5}
    assert selection.steps_to_keep(list(reversed(records)), 1, "eval_accuracy", Direction.MIN) == {2, 5}
