"""Cross-worker preflight: every task's fingerprint on shared storage, a barrier, a comparison and a port check.

Every task of a cluster (chief, workers, parameter servers) calls `run_preflight` before it builds
its strategy. The protocol, all through fsspec under `<run_dir>/preflight/`:

1. The task opens a plain TCP listener on its own TF_CONFIG port (TensorFlow's gRPC server is not up
   yet), then writes `<type>-<index>.json`: its fingerprint (versions, TF build, GPUs, masked env,
   config and data hashes, TF_CONFIG) with a nonce, host and pid. Finding another live writer's file
   in its slot means two tasks claim the same type and index: it writes `conflict-<type>-<index>.json`
   and every task fails.
2. It waits (bounded by `timeout_s`) for every peer's fingerprint and compares them: any difference
   in versions, config hash, data hash or cluster spec fails every task with one table showing the
   values per task. GPU or TF build differences are warnings.
3. It connects to every peer's host:port. An unreachable peer is named; the task writes
   `failed-<type>-<index>.json` so that the others stop too.
4. It writes `reached-<type>-<index>.json` and keeps its listener open until every peer has written
   its own: no task closes its port before every peer has checked it. Then it closes the listener so
   the TF server can bind the port, and the chief writes `report.json` and `report.md`.

The preflight directory must be fresh for each attempt (the launcher removes it before a restart).

A caller may change this task's fingerprint before it is written (`fingerprint_fn`): how tests fake a skewed node
(`pipeline_lib.testing.preflight_override`, installed by the worker entry).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pipeline_lib.cluster.address import split_address
from pipeline_lib.cluster.board import Board, claim, read_fingerprint, wait_for
from pipeline_lib.cluster.comparison import describe_mismatch, soft_warnings
from pipeline_lib.cluster.fingerprint import Fingerprint, collect_fingerprint
from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.cluster.preflight_report import PreflightError, PreflightReport
from pipeline_lib.cluster.reachability import Listener, check_peers

logger = logging.getLogger(__name__)

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
# Tasks that run a server and take part in the preflight; an evaluator runs neither.
PEER_JOBS = ("chief", "worker", "ps")


def _participants(cluster: ClusterInfo) -> dict[str, str]:
    """'worker 1' -> 'host:port' for every task that takes part, in cluster order (chief, workers, ps)."""
    return {f"{job} {i}": address for job in PEER_JOBS for i, address in enumerate(cluster.cluster.get(job, ()))}


def run_preflight(run_dir: str, cluster: ClusterInfo, config_hash: str, data_hash: str, timeout_s: float,
                  storage_options: dict | None = None,
                  fingerprint_fn: Callable[[Fingerprint], Fingerprint] | None = None) -> PreflightReport:
    """Run this task's part of the cross-worker preflight (see the module docstring for the protocol).

    Call it in every task (chief, workers, ps) before building the strategy, with the same run_dir.

    Args:
        run_dir: fsspec URI every task can read and write (shared storage on a real cluster).
        cluster: this task's cluster value (from TF_CONFIG).
        config_hash: `PipelineConfig.config_hash()`; every task must have the same.
        data_hash: `Manifest.content_hash()`; every task must have the same.
        timeout_s: the bound on the whole preflight (`preflight.timeout_s`).
        storage_options: fsspec options for run_dir.
        fingerprint_fn: applied to this task's fingerprint before it is written (None: the fingerprint as found).

    Returns:
        The PreflightReport; the chief also writes it to `<run_dir>/preflight/report.{json,md}`.

    Raises:
        PreflightError: the tasks differ, a peer never arrived or is unreachable, two tasks claim one
            slot, or a peer failed its own preflight. Every task raises, with the same diff.
    """
    deadline = time.monotonic() + timeout_s
    board = Board(run_dir, storage_options)
    me = collect_fingerprint(cluster, config_hash, data_hash)
    if fingerprint_fn is not None:
        me = fingerprint_fn(me)
    participants = _participants(cluster)
    if me.task not in participants:
        # Single process (no TF_CONFIG) or an evaluator: nobody waits on it, it listens on nothing.
        participants = {me.task: ""} if not cluster.cluster else participants
    fingerprints: list[Fingerprint] = []
    warnings: list[str] = []
    reachable: dict[str, str] = {}
    listener = None
    try:
        own_address = participants.get(me.task, "")
        if own_address and len(participants) > 1:
            _host, port = split_address(own_address)
            listener = Listener(int(port), me.task, own_address)
        claim(board, me)
        expected = {f"{name.replace(' ', '-')}.json": name for name in participants}
        wait_for(board, expected, me, deadline, timeout_s, "its fingerprint")
        fingerprints = [me if name == me.task else read_fingerprint(board, file, name)
                        for file, name in expected.items()]
        if me.task not in participants:
            fingerprints.append(me)
        warnings = soft_warnings(fingerprints)
        mismatch = describe_mismatch(fingerprints, me.task)
        if mismatch:
            raise PreflightError(mismatch)
        if listener is not None:
            peers = {task: address for task, address in participants.items() if task != me.task}
            results = check_peers(peers, deadline)
            unreachable = {task: why for task, why in results.items() if why is not None}
            if unreachable:
                raise PreflightError(
                    f"preflight of {me.task}: " + "; ".join(
                        f"{task} at {peers[task]} is unreachable within {timeout_s:g} s: {why}"
                        for task, why in unreachable.items())
                    + "; check the address in TF_CONFIG, that the task runs on that host, and that firewalls or "
                      "network policies allow the port")
            reachable = {task: peers[task] for task in results}
            board.write(f"reached-{me.slot}.json", {"task": me.task, "peers": reachable})
            reached = {f"reached-{name.replace(' ', '-')}.json": name for name in participants}
            wait_for(board, reached, me, deadline, timeout_s, "its reachability checks")
    except PreflightError as error:
        if me.task in participants and len(participants) > 1:
            try:
                board.write(f"failed-{me.slot}.json", {"task": me.task, "message": str(error)})
            except OSError:  # pragma: no cover - the storage itself is failing; the error says enough
                logger.warning("preflight: could not record the failure of %s in %s", me.task, board.uri)
        report = PreflightReport(task=me.task, passed=False, fingerprints=tuple(fingerprints) or (me,),
                                 warnings=tuple(warnings), errors=(str(error),), reachable=reachable)
        _write_report_on_chief(board, cluster, report)
        error.report = report
        raise
    finally:
        if listener is not None:
            listener.close()
    report = PreflightReport(task=me.task, passed=True, fingerprints=tuple(fingerprints), warnings=tuple(warnings),
                             reachable=reachable)
    for warning in warnings:
        logger.warning("preflight: %s", warning)
    _write_report_on_chief(board, cluster, report)
    logger.info("preflight of %s passed: %d task(s) match, %d peer(s) reachable", me.task, len(fingerprints),
                len(reachable))
    return report


def _write_report_on_chief(board: Board, cluster: ClusterInfo, report: PreflightReport) -> None:
    if not cluster.is_chief:
        return
    try:
        board.write(REPORT_JSON, report.to_json())
        board.write(REPORT_MD, report.to_markdown())
    except OSError as error:  # pragma: no cover - the report is a by-product; the outcome stands
        logger.warning("preflight: could not write the report to %s: %s", board.uri, error)
