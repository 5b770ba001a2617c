"""TF_CONFIG text for the cluster tests."""

from __future__ import annotations

import json

from pipeline_lib.config import Strategy

MWMS = Strategy.MULTI_WORKER_MIRRORED
PS = Strategy.PARAMETER_SERVER
TWO_WORKERS = {"worker": ["host-a:2222", "host-b:2222"]}


def tf_config(cluster, task_type="worker", index=0) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
