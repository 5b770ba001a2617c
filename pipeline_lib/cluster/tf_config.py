"""The TF_CONFIG rules: every way a TF_CONFIG cannot work for a strategy, each with its own message and fix."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from pipeline_lib.cluster.address import cluster_address_problems
from pipeline_lib.cluster.report import (
    ClusterConfigError,
    Finding,
    clip,
    error,
    warning,
)
from pipeline_lib.config import Strategy, strategy_for_cluster

KNOWN_JOBS = ("chief", "worker", "ps", "evaluator")
LOCAL_STRATEGIES = (Strategy.DEFAULT, Strategy.ONE_DEVICE, Strategy.MIRRORED)


@dataclasses.dataclass(frozen=True)
class _TfConfig:
    """What the rules look at: the raw text plus whatever parts of it parsed."""

    text: str
    source: str
    strategy: Strategy
    data: Any = None  # the decoded JSON (any type), None when it is not JSON
    parse_error: str | None = None

    @property
    def cluster(self) -> dict[str, Any] | None:
        value = self.data.get("cluster") if isinstance(self.data, dict) else None
        return value if isinstance(value, dict) else None

    @property
    def task(self) -> dict[str, Any] | None:
        value = self.data.get("task") if isinstance(self.data, dict) else None
        return value if isinstance(value, dict) else None

    @property
    def jobs(self) -> dict[str, list[Any]]:
        """The cluster's jobs whose value is a list."""
        return {k: v for k, v in (self.cluster or {}).items() if isinstance(v, list)}

    @property
    def who(self) -> str:
        """'TF_CONFIG of worker 1' when the task parses, else just the source."""
        task = self.task or {}
        kind, index = task.get("type"), task.get("index")
        if isinstance(kind, str) and isinstance(index, int) and not isinstance(index, bool):
            return f"{self.source} of {kind} {index}"
        return self.source

    def count(self, *jobs: str) -> int:
        return sum(len(self.jobs.get(job, [])) for job in jobs)


def _addresses(tf: _TfConfig) -> list[tuple[str, int, Any]]:
    return [(job, i, a) for job, addresses in tf.jobs.items() for i, a in enumerate(addresses)]


def rule_not_json(tf: _TfConfig) -> list[Finding]:
    if tf.parse_error is not None:
        return [error("not_json", f"{tf.source} is not valid JSON ({tf.parse_error}): {clip(tf.text)!r}; write it "
                                  'as {"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", '
                                  '"index": 0}}')]
    if not isinstance(tf.data, dict):
        return [error("not_json", f"{tf.source} holds a JSON {type(tf.data).__name__}, not an object: "
                                  f"{clip(tf.text)!r}; write it as an object with 'cluster' and 'task' keys")]
    return []


def rule_missing_cluster(tf: _TfConfig) -> list[Finding]:
    if "cluster" not in tf.data:
        return [error("missing_cluster", f"{tf.who} has no 'cluster' key (keys: {sorted(tf.data)}); add "
                                         '"cluster": {"worker": ["host:port", ...]} listing every task')]
    if tf.cluster is None:
        return [error("missing_cluster", f"{tf.who}: 'cluster' is {_show(tf.data['cluster'])}, not an object; "
                                         'write it as {"worker": ["host:port", ...]}')]
    return []


def rule_missing_task(tf: _TfConfig) -> list[Finding]:
    if "task" not in tf.data:
        return [error("missing_task", f"{tf.source} has no 'task' key (keys: {sorted(tf.data)}); add "
                                      '"task": {"type": "worker", "index": N} naming this process')]
    task = tf.task
    if task is None:
        return [error("missing_task", f"{tf.source}: 'task' is {_show(tf.data['task'])}, not an object; write it "
                                      'as {"type": "worker", "index": N}')]
    missing = [key for key in ("type", "index") if key not in task]
    if missing:
        return [error("missing_task", f"{tf.source}: task {task} lacks {' and '.join(map(repr, missing))}; every "
                                      'process needs its own {"type": ..., "index": ...}')]
    return []


def rule_unknown_job(tf: _TfConfig) -> list[Finding]:
    return [
        error("unknown_job", f"{tf.who} lists an unknown job {job!r} in cluster; allowed jobs are "
                             f"{', '.join(KNOWN_JOBS)}; rename it (a coordinator is 'chief', a server 'ps')")
        for job in (tf.cluster or {}) if job not in KNOWN_JOBS
    ]


def rule_empty_job(tf: _TfConfig) -> list[Finding]:
    found = []
    for job, value in (tf.cluster or {}).items():
        if not isinstance(value, list):
            found.append(error("empty_job", f"{tf.who}: cluster.{job} is {_show(value)}, not a list of "
                                            f"addresses; write it as [\"host:port\", ...]"))
        elif not value:
            found.append(error("empty_job", f"{tf.who}: cluster.{job} is an empty list; list its tasks' "
                                            f"host:port addresses or remove the job"))
    return found


def _address_findings(tf: _TfConfig, rule: str) -> list[Finding]:
    """The findings of one address rule; `address_problem` (cluster/address.py) is the rule, written once."""
    return [error(found, message) for found, message in cluster_address_problems(tf.jobs, tf.who) if found == rule]


def rule_address_without_port(tf: _TfConfig) -> list[Finding]:
    return _address_findings(tf, "address_without_port")


def rule_address_not_host_port(tf: _TfConfig) -> list[Finding]:
    return _address_findings(tf, "address_not_host_port")


def rule_port_not_numeric(tf: _TfConfig) -> list[Finding]:
    return _address_findings(tf, "port_not_numeric")


def rule_port_out_of_range(tf: _TfConfig) -> list[Finding]:
    return _address_findings(tf, "port_out_of_range")


def rule_address_bad_host(tf: _TfConfig) -> list[Finding]:
    return _address_findings(tf, "address_bad_host")


def rule_duplicate_address(tf: _TfConfig) -> list[Finding]:
    seen: dict[str, str] = {}
    found = []
    for job, index, address in _addresses(tf):
        if not isinstance(address, str):
            continue
        slot = f"{job}[{index}]"
        if address in seen:
            found.append(error("duplicate_address", f"{tf.who}: cluster.{slot} and cluster.{seen[address]} both "
                                                    f"use {address!r}; give every task its own host:port"))
        else:
            seen[address] = slot
    return found


def rule_task_type_not_in_cluster(tf: _TfConfig) -> list[Finding]:
    task, cluster = tf.task, tf.cluster
    if task is None or cluster is None or "type" not in task:
        return []
    kind = task["type"]
    if kind not in cluster:
        return [error("task_type_not_in_cluster", f"{tf.source}: task.type {kind!r} is not a job of the cluster "
                                                  f"(jobs: {sorted(cluster)}); set task.type to one of them or "
                                                  f"add cluster.{kind}")]
    return []


def _index(tf: _TfConfig) -> Any:
    return (tf.task or {}).get("index")


def rule_task_index_not_integer(tf: _TfConfig) -> list[Finding]:
    task = tf.task
    if task is None or "index" not in task:
        return []
    index = task["index"]
    if isinstance(index, bool) or not isinstance(index, int):
        return [error("task_index_not_integer", f"{tf.source}: task.index of {task.get('type')!r} is {index!r} "
                                                f"({type(index).__name__}), not an integer; write a JSON number, "
                                                f"e.g. \"index\": 0")]
    return []


def rule_task_index_negative(tf: _TfConfig) -> list[Finding]:
    index = _index(tf)
    if isinstance(index, int) and not isinstance(index, bool) and index < 0:
        return [error("task_index_negative", f"{tf.source}: task.index of {tf.task.get('type')!r} is {index}; "
                                             "indices count from 0")]
    return []


def rule_task_index_out_of_range(tf: _TfConfig) -> list[Finding]:
    task, index = tf.task, _index(tf)
    if task is None or not isinstance(index, int) or isinstance(index, bool) or index < 0:
        return []
    addresses = tf.jobs.get(task.get("type"))
    if addresses and index >= len(addresses):
        return [error("task_index_out_of_range", f"{tf.who}: task.index {index} is out of range: "
                                                 f"cluster.{task['type']} has {len(addresses)} task(s) "
                                                 f"(indices 0..{len(addresses) - 1}); fix the index or add the "
                                                 "missing address")]
    return []


def rule_multiple_chiefs(tf: _TfConfig) -> list[Finding]:
    chiefs = tf.jobs.get("chief", [])
    if len(chiefs) > 1:
        return [error("multiple_chiefs", f"{tf.who}: cluster.chief lists {len(chiefs)} tasks {chiefs}; a cluster "
                                         "has at most one chief: keep one and move the others to cluster.worker")]
    return []


def rule_multiple_evaluators(tf: _TfConfig) -> list[Finding]:
    evaluators = tf.jobs.get("evaluator", [])
    if len(evaluators) > 1:
        return [error("multiple_evaluators", f"{tf.who}: cluster.evaluator lists {len(evaluators)} tasks "
                                             f"{evaluators}; TensorFlow supports one evaluator: keep one")]
    return []


def _effective(tf: _TfConfig) -> Strategy:
    """`auto` resolved as the strategy module does from the cluster alone."""
    return strategy_for_cluster(tf.strategy, has_ps=bool(tf.jobs.get("ps")), num_workers=tf.count("chief", "worker"))


def rule_ps_without_ps_job(tf: _TfConfig) -> list[Finding]:
    if tf.cluster is not None and _effective(tf) == Strategy.PARAMETER_SERVER and not tf.jobs.get("ps"):
        return [error("ps_without_ps_job", f"{tf.who}: strategy 'parameter_server' but the cluster has no 'ps' "
                                           f"job (jobs: {sorted(tf.cluster)}); add cluster.ps with at least one "
                                           "host:port or choose multi_worker_mirrored")]
    return []


def rule_ps_without_coordinator(tf: _TfConfig) -> list[Finding]:
    if tf.cluster is not None and _effective(tf) == Strategy.PARAMETER_SERVER and not tf.jobs.get("chief"):
        return [error("ps_without_coordinator", f"{tf.who}: strategy 'parameter_server' needs a coordinator, but "
                                                f"the cluster has no 'chief' job (jobs: {sorted(tf.cluster)}); add "
                                                "cluster.chief with the coordinator's host:port")]
    return []


def rule_ps_without_workers(tf: _TfConfig) -> list[Finding]:
    if tf.cluster is not None and _effective(tf) == Strategy.PARAMETER_SERVER and not tf.jobs.get("worker"):
        return [error("ps_without_workers", f"{tf.who}: strategy 'parameter_server' needs at least one 'worker' "
                                            f"task to run steps, but the cluster has none (jobs: "
                                            f"{sorted(tf.cluster)}); add cluster.worker")]
    return []


def rule_ps_under_multi_worker_mirrored(tf: _TfConfig) -> list[Finding]:
    if tf.strategy == Strategy.MULTI_WORKER_MIRRORED and tf.jobs.get("ps"):
        return [error("ps_under_multi_worker_mirrored", f"{tf.who}: cluster.ps lists {len(tf.jobs['ps'])} "
                                                        "parameter server(s) but strategy "
                                                        "'multi_worker_mirrored' does not use any; remove "
                                                        "cluster.ps or choose strategy 'parameter_server'")]
    return []


def rule_single_task_multi_worker(tf: _TfConfig) -> list[Finding]:
    if tf.cluster is not None and tf.strategy == Strategy.MULTI_WORKER_MIRRORED and tf.count("chief", "worker") == 1:
        return [error("single_task_multi_worker", f"{tf.who}: strategy 'multi_worker_mirrored' but the cluster has "
                                                  "a single training task; list every worker in cluster.worker, "
                                                  "or use strategy 'mirrored' (or 'auto') on one machine")]
    return []


def rule_tf_config_with_local_strategy(tf: _TfConfig) -> list[Finding]:
    if tf.strategy in LOCAL_STRATEGIES:
        return [warning("tf_config_with_local_strategy", f"{tf.who} is set but strategy {tf.strategy.value!r} "
                                                         "trains on this machine only and ignores it; unset "
                                                         "TF_CONFIG or choose multi_worker_mirrored / "
                                                         "parameter_server")]
    return []


# The rules run in this order; those after `not_json` see a JSON object.
TF_CONFIG_RULES: tuple[Callable[[_TfConfig], list[Finding]], ...] = (
    rule_missing_cluster,
    rule_missing_task,
    rule_unknown_job,
    rule_empty_job,
    rule_address_without_port,
    rule_address_not_host_port,
    rule_port_not_numeric,
    rule_port_out_of_range,
    rule_address_bad_host,
    rule_duplicate_address,
    rule_task_type_not_in_cluster,
    rule_task_index_not_integer,
    rule_task_index_negative,
    rule_task_index_out_of_range,
    rule_multiple_chiefs,
    rule_multiple_evaluators,
    rule_ps_without_ps_job,
    rule_ps_without_coordinator,
    rule_ps_without_workers,
    rule_ps_under_multi_worker_mirrored,
    rule_single_task_multi_worker,
    rule_tf_config_with_local_strategy,
)


def _show(value: Any) -> str:
    """A decoded JSON value as JSON text (strings in double quotes), clipped."""
    return clip(json.dumps(value))


def parse_strategy(strategy: Strategy | str, source: str = "--strategy") -> Strategy:
    """A Strategy from its enum or its value.

    Raises:
        ClusterConfigError: for an unknown name, listing the allowed ones.
    """
    if isinstance(strategy, Strategy):
        return strategy
    try:
        return Strategy(str(strategy))
    except ValueError:
        allowed = ", ".join(s.value for s in Strategy)
        raise ClusterConfigError(f"{source} ({strategy!r}) is not a strategy; use one of {allowed}") from None


def check_tf_config(text: str, strategy: Strategy | str, source: str = "TF_CONFIG") -> list[Finding]:
    """Run every TF_CONFIG rule and return the findings (errors and warnings), without raising.

    Args:
        text: the TF_CONFIG JSON text.
        strategy: the strategy the cluster is for (`train.strategy`).
        source: how messages name the text: "TF_CONFIG", a file name, "--tf-config".

    Returns:
        The findings in rule order; an empty list for a valid TF_CONFIG.
    """
    kind = parse_strategy(strategy)
    try:
        parsed = _TfConfig(text=text, source=source, strategy=kind, data=json.loads(text))
    except (json.JSONDecodeError, TypeError) as problem:
        parsed = _TfConfig(text=str(text), source=source, strategy=kind, parse_error=str(problem))
    findings = rule_not_json(parsed)
    if findings:
        return findings
    for rule in TF_CONFIG_RULES:
        findings.extend(rule(parsed))
    return findings
