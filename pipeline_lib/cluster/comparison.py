"""The comparison of every task's fingerprint: the mismatches that stop the cluster and the soft warnings."""

from __future__ import annotations

import collections
import json

from pipeline_lib.cluster.fingerprint import Fingerprint
from pipeline_lib.cluster.preflight_report import (
    cell,
    compared_fields,
    field_value,
    gpu_words,
)


def describe_mismatch(fingerprints: list[Fingerprint], reporter: str) -> str | None:
    """The mismatch message (a table of the differing fields), or None when every task agrees."""
    rows = []
    fixes = []
    details = []
    for field, fix in compared_fields():
        values = [field_value(f, field) for f in fingerprints]
        if len(set(values)) < 2:
            continue
        reference = collections.Counter(values).most_common(1)[0][0]
        odd = [f.task for f, v in zip(fingerprints, values) if v != reference]
        same = [f.task for f, v in zip(fingerprints, values) if v == reference]
        rows.append((field, [cell(field, v) for v in values], odd))
        theirs = ", ".join(f"{f.task} has {cell(field, v)}" for f, v in zip(fingerprints, values) if v != reference)
        verb = "has" if len(same) == 1 else "have"
        fixes.append(f"  - {field}: {theirs} where {', '.join(same)} {verb} {cell(field, reference)}; {fix}")
        if field == "cluster":
            expected = json.loads(reference)
            for f, v in zip(fingerprints, values):
                if v == reference:
                    continue
                theirs = json.loads(v)
                for job in sorted(set(expected) | set(theirs)):
                    if expected.get(job) != theirs.get(job):
                        details.append(f"  TF_CONFIG of {f.task} lists cluster.{job} {theirs.get(job)} but the "
                                       f"others list {expected.get(job)}")
    if not rows:
        return None
    names = [f.task for f in fingerprints]
    header = ["field"] + names + ["differs on"]
    table = [header] + [[field, *cells, ", ".join(odd)] for field, cells, odd in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    text = "\n".join("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table)
    message = (f"preflight ({reporter}): the {len(fingerprints)} tasks of this cluster do not match; every task must "
               f"run the same versions, config, data and cluster:\n{text}\n")
    if details:
        message += "\n".join(details) + "\n"
    message += "fix:\n" + "\n".join(fixes)
    return message


def soft_warnings(fingerprints: list[Fingerprint]) -> list[str]:
    """Differences that do not stop the run: GPUs and the TF build."""
    warnings = []
    trainers = [f for f in fingerprints if f.task_type in ("chief", "worker")]
    gpu_sets = {f.task: gpu_words(f.gpus) for f in trainers}
    if len(set(gpu_sets.values())) > 1:
        warnings.append("GPUs differ between the training tasks: " +
                        "; ".join(f"{task} has {words}" for task, words in gpu_sets.items()) +
                        "; uneven GPUs make the replicas drift (the slowest sets the pace): use one node type")
    for key in ("cuda_version", "cudnn_version", "is_cuda_build"):
        values = {f.task: f.tf_build.get(key, "") for f in fingerprints}
        if len(set(values.values())) > 1:
            warnings.append(f"TensorFlow's {key} differs: " + ", ".join(f"{t} {v!r}" for t, v in values.items()) +
                            "; install the same TensorFlow wheel on every node")
    return warnings
