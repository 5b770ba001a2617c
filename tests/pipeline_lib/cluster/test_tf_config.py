"""Tests for pipeline_lib.cluster.tf_config: every TF_CONFIG rule, with its own message, and the valid configs."""

from __future__ import annotations

import json

import pytest

from pipeline_lib.cluster.address import split_address
from pipeline_lib.cluster.report import ClusterConfigError, format_findings
from pipeline_lib.cluster.tf_config import (
    TF_CONFIG_RULES,
    check_tf_config,
)
from pipeline_lib.config import Strategy
from tests.pipeline_lib.cluster.tf_config_cases import MWMS, PS, TWO_WORKERS, tf_config

# (rule, TF_CONFIG text, strategy, substrings of the rule's message)
FAILING = [
    ("not_json", '{"cluster": ', MWMS, ["TF_CONFIG is not valid JSON", "'{\"cluster\": '", '"cluster": {"worker"']),
    ("not_json", "[1, 2]", MWMS, ["holds a JSON list, not an object", "'cluster' and 'task' keys"]),
    ("missing_cluster", json.dumps({"task": {"type": "worker", "index": 0}}), MWMS,
     ["has no 'cluster' key (keys: ['task'])", "listing every task"]),
    ("missing_cluster", json.dumps({"cluster": ["a:1"], "task": {"type": "worker", "index": 0}}), MWMS,
     ["'cluster' is [\"a:1\"], not an object"]),
    ("missing_task", json.dumps({"cluster": TWO_WORKERS}), MWMS, ["has no 'task' key", '"task": {"type": "worker"']),
    ("missing_task", json.dumps({"cluster": TWO_WORKERS, "task": {"type": "worker"}}), MWMS,
     ["lacks 'index'"]),
    ("unknown_job", tf_config({**TWO_WORKERS, "master": ["host-m:1"]}), MWMS,
     ["TF_CONFIG of worker 0 lists an unknown job 'master'", "allowed jobs are chief, worker, ps, evaluator"]),
    ("empty_job", tf_config({**TWO_WORKERS, "chief": []}), MWMS, ["cluster.chief is an empty list"]),
    ("empty_job", tf_config({**TWO_WORKERS, "chief": "host-c:1"}), MWMS,
     ["cluster.chief is \"host-c:1\", not a list of addresses"]),
    ("address_without_port", tf_config({"worker": ["host-a:2222", "host-b"]}), MWMS,
     ["TF_CONFIG of worker 0: cluster.worker[1] 'host-b' has no port", "'host-b:2222'"]),
    ("address_without_port", tf_config({"worker": ["host-a:2222", ":2223"]}), MWMS,
     ["cluster.worker[1] ':2223' has no host"]),
    ("address_without_port", tf_config({"worker": ["host-a:2222", 2223]}), MWMS,
     ["cluster.worker[1] is 2223, not a 'host:port' string"]),
    ("address_not_host_port", tf_config({"worker": ["grpc://host-a:2222", "host-b:2222"]}), MWMS,
     ["TF_CONFIG of worker 0: cluster.worker[0] 'grpc://host-a:2222' starts with the URL scheme 'grpc://'",
      "bare host:port, e.g. 'host-a:2222'"]),
    ("address_not_host_port", tf_config({"worker": ["host-a:2222", " host-b:2222"]}), MWMS,
     ["cluster.worker[1] ' host-b:2222' contains whitespace; remove it: 'host-b:2222'"]),
    ("address_not_host_port", tf_config({"worker": ["host-a:2222/train", "host-b:2222"]}), MWMS,
     ["cluster.worker[0] 'host-a:2222/train' has a path", "e.g. 'host-a:2222'"]),
    ("address_bad_host", tf_config({"worker": ["host_a:2222", "host-b:2222"]}), MWMS,
     ["cluster.worker[0] 'host_a:2222' has host 'host_a', which is not a valid hostname", "'[::1]:2222'"]),
    ("address_bad_host", tf_config({"worker": ["10.0.0.300:2222", "host-b:2222"]}), MWMS,
     ["has host '10.0.0.300', which is not an IPv4 address"]),
    ("address_bad_host", tf_config({"worker": ["[fe80::zz]:2222", "host-b:2222"]}), MWMS,
     ["has [fe80::zz] in brackets, which is not an IPv6 address"]),
    ("port_not_numeric", tf_config({"worker": ["host-a:2222", "host-b:grpc"]}), MWMS,
     ["cluster.worker[1] 'host-b:grpc' has port 'grpc', not a number", "'host-b:2222'"]),
    ("port_out_of_range", tf_config({"worker": ["host-a:0", "host-b:2222"]}), MWMS,
     ["cluster.worker[0] 'host-a:0' has port 0, outside 1..65535"]),
    ("port_out_of_range", tf_config({"worker": ["host-a:2222", "host-b:70000"]}), MWMS,
     ["'host-b:70000' has port 70000, outside 1..65535"]),
    ("duplicate_address", tf_config({"chief": ["host-a:2222"], "worker": ["host-a:2222", "host-b:2222"]}), MWMS,
     ["cluster.worker[0] and cluster.chief[0] both use 'host-a:2222'", "its own host:port"]),
    ("task_type_not_in_cluster", tf_config(TWO_WORKERS, task_type="chief"), MWMS,
     ["task.type 'chief' is not a job of the cluster (jobs: ['worker'])", "add cluster.chief"]),
    ("task_index_not_integer", tf_config(TWO_WORKERS, index="1"), MWMS,
     ["task.index of 'worker' is '1' (str), not an integer", '"index": 0']),
    ("task_index_not_integer", tf_config(TWO_WORKERS, index=1.0), MWMS, ["is 1.0 (float), not an integer"]),
    ("task_index_negative", tf_config(TWO_WORKERS, index=-1), MWMS,
     ["task.index of 'worker' is -1; indices count from 0"]),
    ("task_index_out_of_range", tf_config(TWO_WORKERS, index=2), MWMS,
     ["TF_CONFIG of worker 2: task.index 2 is out of range: cluster.worker has 2 task(s) (indices 0..1)"]),
    ("multiple_chiefs", tf_config({"chief": ["host-c:1", "host-d:1"], **TWO_WORKERS}), MWMS,
     ["cluster.chief lists 2 tasks ['host-c:1', 'host-d:1']", "at most one chief"]),
    ("multiple_evaluators", tf_config({**TWO_WORKERS, "evaluator": ["host-e:1", "host-f:1"]}), MWMS,
     ["cluster.evaluator lists 2 tasks", "one evaluator"]),
    ("ps_without_ps_job", tf_config({"chief": ["host-c:1"], **TWO_WORKERS}), PS,
     ["strategy 'parameter_server' but the cluster has no 'ps' job (jobs: ['chief', 'worker'])", "add cluster.ps"]),
    ("ps_without_coordinator", tf_config({**TWO_WORKERS, "ps": ["host-p:1"]}), PS,
     ["needs a coordinator, but the cluster has no 'chief' job", "add cluster.chief"]),
    ("ps_without_workers", tf_config({"chief": ["host-c:1"], "ps": ["host-p:1"]}, task_type="chief"), PS,
     ["needs at least one 'worker' task"]),
    ("ps_under_multi_worker_mirrored", tf_config({**TWO_WORKERS, "ps": ["host-p:1"]}), MWMS,
     ["cluster.ps lists 1 parameter server(s) but strategy 'multi_worker_mirrored'", "choose strategy 'parameter_server'"]),
    ("single_task_multi_worker", tf_config({"worker": ["host-a:2222"]}), MWMS,
     ["strategy 'multi_worker_mirrored' but the cluster has a single training task", "use strategy 'mirrored'"]),
    ("tf_config_with_local_strategy", tf_config(TWO_WORKERS), Strategy.DEFAULT,
     ["TF_CONFIG of worker 0 is set but strategy 'default' trains on this machine only", "unset TF_CONFIG"]),
    ("tf_config_with_local_strategy", tf_config(TWO_WORKERS), Strategy.MIRRORED, ["strategy 'mirrored'"]),
]


@pytest.mark.parametrize("rule, text, strategy, expected", FAILING,
                         ids=[f"{case[0]}-{i}" for i, case in enumerate(FAILING)])
def test_each_rule_rejects_its_input_with_its_own_message(rule, text, strategy, expected):
    findings = check_tf_config(text, strategy)
    matching = [f for f in findings if f.rule == rule]
    assert matching, f"rule {rule} did not fire; findings: {findings}"
    for part in expected:
        assert any(part in f.message for f in matching), (part, [f.message for f in matching])
    expected_level = "warning" if rule == "tf_config_with_local_strategy" else "error"
    assert {f.level for f in matching} == {expected_level}


def test_at_least_fifteen_rules_and_every_one_is_tested():
    names = {rule.__name__.removeprefix("rule_") for rule in TF_CONFIG_RULES} | {"not_json"}
    assert len(names) >= 15
    assert names == {case[0] for case in FAILING}


VALID = [
    (tf_config(TWO_WORKERS, index=1), MWMS),
    (tf_config({"chief": ["host-c:2222"], **TWO_WORKERS}, task_type="chief"), MWMS),
    (tf_config({"chief": ["host-c:1"], **TWO_WORKERS, "ps": ["host-p:1", "host-q:1"]}, task_type="ps", index=1), PS),
    (tf_config({"chief": ["host-c:1"], **TWO_WORKERS, "ps": ["host-p:1"]}), Strategy.AUTO),
    (tf_config({"worker": ["[::1]:2222", "[::1]:2223"]}), "multi_worker_mirrored"),
    (tf_config({**TWO_WORKERS, "evaluator": ["host-e:1"]}, task_type="evaluator"), MWMS),
    (tf_config({"worker": ["host-a:2222"]}), Strategy.AUTO),
    (tf_config({"worker": ["10.0.0.1:2222", "w-1.train.svc.cluster.local:65535"]}), MWMS),
]


@pytest.mark.parametrize("text, strategy", VALID)
def test_valid_configs_pass(text, strategy):
    assert check_tf_config(text, strategy) == []


def test_auto_with_ps_job_gets_the_parameter_server_rules():
    findings = check_tf_config(tf_config({**TWO_WORKERS, "ps": ["host-p:1"]}), Strategy.AUTO)
    assert [f.rule for f in findings] == ["ps_without_coordinator"]


def test_the_findings_list_every_error_and_the_warnings():
    text = tf_config({"worker": ["host-a", "host-a:0"], "master": ["m:1"]}, index=5)
    findings = check_tf_config(text, MWMS, source="tf_config.json")
    message = format_findings(findings, "tf_config.json")
    assert message.startswith("tf_config.json has 4 error(s)")
    for rule in ("unknown_job", "address_without_port", "port_out_of_range", "task_index_out_of_range"):
        assert f"[{rule}]" in message
    assert "tf_config.json of worker 5" in message
    assert {f.rule for f in findings} >= {"unknown_job", "task_index_out_of_range"}
    warnings = check_tf_config(tf_config(TWO_WORKERS), Strategy.DEFAULT)
    assert [w.rule for w in warnings] == ["tf_config_with_local_strategy"]


def test_unknown_strategy_is_rejected():
    with pytest.raises(ClusterConfigError, match=r"--strategy \('mwms'\) is not a strategy; use one of auto"):
        check_tf_config(tf_config(TWO_WORKERS), "mwms")


def test_split_address():
    assert split_address("host:22") == ("host", "22")
    assert split_address("[::1]:22") == ("::1", "22")
    assert split_address("host") == ("host", None)
