"""`tfdag validate-cluster`: the static TF_CONFIG rules, then optionally the cross-worker preflight."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TextIO

from pipeline_lib.cluster.info import cluster_from_env
from pipeline_lib.cluster.preflight import run_preflight
from pipeline_lib.cluster.preflight_report import PreflightError
from pipeline_lib.cluster.report import ClusterConfigError
from pipeline_lib.cluster.tf_config import check_tf_config, parse_strategy
from pipeline_lib.core import storage
from pipeline_lib.core.exit_codes import EXIT_FAILURE, EXIT_OK, run_to_exit_code
from pipeline_lib.core.quiet import is_verbose

VALIDATE_CLUSTER_SUBDIR = "validate-cluster"


def _read_tf_config(tf_config: str | None, environ: Mapping[str, str]) -> tuple[str, str]:
    """(text, source) from --tf-config (a file path, an fsspec URI or inline JSON) or $TF_CONFIG."""
    if tf_config is None:
        return environ.get("TF_CONFIG", "").strip(), "TF_CONFIG"
    stripped = tf_config.strip()
    if stripped.startswith(("{", "[")):
        return stripped, "--tf-config"
    if os.path.isfile(stripped) or "://" in stripped:
        fs, path = storage.get_fs(stripped)
        if fs.exists(path):
            return fs.cat_file(path).decode().strip(), stripped
    return stripped, "--tf-config (not an existing file, read as JSON)"


def run_validate_cluster(tf_config: str | None, strategy: str, peers: bool, run_dir: str | None, timeout_s: float,
                         out: TextIO, environ: Mapping[str, str] | None = None) -> int:
    """The body of `tfdag validate-cluster`: the static TF_CONFIG rules, then optionally the preflight.

    With `peers`, every task of the cluster runs this command (an init step in a pod, say); the preflight
    runs with empty config and data hashes, its files under `<run_dir>/validate-cluster/preflight/` so a
    later training preflight in the same run_dir starts from a fresh directory.

    Args:
        tf_config: a TF_CONFIG file path (local or fsspec) or inline JSON; None reads $TF_CONFIG.
        strategy: the strategy name the cluster is for.
        peers: also run the cross-worker preflight.
        run_dir: the shared fsspec URI for the preflight files (required with `peers`).
        timeout_s: bound on the preflight.
        out: where the findings and the report are printed.
        environ: the environment (default os.environ).

    Returns:
        0 when valid, 1 on an error finding or a failed preflight, 2 on a usage error (one line, the
        `core.exit_codes` rule).
    """
    environ = os.environ if environ is None else environ
    return run_to_exit_code(lambda: _validate(tf_config, strategy, peers, run_dir, timeout_s, out, environ),
                            lambda line: print(line, file=out), prefix="tfdag validate-cluster: ",
                            verbose=is_verbose())


def _validate(tf_config: str | None, strategy: str, peers: bool, run_dir: str | None, timeout_s: float,
              out: TextIO, environ: Mapping[str, str]) -> int:
    kind = parse_strategy(strategy)
    text, source = _read_tf_config(tf_config, environ)
    if not text:
        raise ClusterConfigError("TF_CONFIG is not set and --tf-config was not given; export TF_CONFIG or pass "
                                 "--tf-config FILE_OR_JSON")
    findings = check_tf_config(text, kind, source)
    for finding in findings:
        print(f"{finding.level} [{finding.rule}]: {finding.message}", file=out)
    errors = [f for f in findings if f.level == "error"]
    if errors:
        print(f"{source}: {len(errors)} error(s), {len(findings) - len(errors)} warning(s); the cluster would not "
              "start as configured", file=out)
        return EXIT_FAILURE
    print(f"{source}: valid for strategy {kind.value!r} ({len(findings)} warning(s))", file=out)
    if not peers:
        return EXIT_OK
    if not run_dir:
        raise ClusterConfigError("--peers needs --run-dir, an fsspec URI every task can reach (e.g. s3://bucket/runs/job-1)")
    cluster = cluster_from_env({"TF_CONFIG": text})
    try:
        report = run_preflight(storage.join(run_dir, VALIDATE_CLUSTER_SUBDIR), cluster, "", "", timeout_s)
    except PreflightError as error:
        print(f"preflight failed:\n{error}", file=out)
        return EXIT_FAILURE
    print(report.to_markdown(), file=out)
    print(f"preflight passed: {len(report.fingerprints)} task(s) match and every peer is reachable", file=out)
    return EXIT_OK
