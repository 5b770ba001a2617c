"""Tests for pipeline_lib.cluster.address: the one host:port rule, for TF_CONFIG and for launcher-made specs."""

from __future__ import annotations

import pytest

from pipeline_lib.cluster.address import address_problem, validate_cluster_addresses
from pipeline_lib.cluster.report import ClusterConfigError

VALID = ["host-a:2222", "127.0.0.2:1", "10.1.2.3:65535", "[::1]:2222", "[fe80::1]:80", "w-0.svc.cluster.local:2222",
         "localhost:8470", "node.:22"]

# (address, rule, a substring of the problem)
INVALID = [
    ("grpc://host-a:2222", "address_not_host_port", "URL scheme 'grpc://'"),
    ("http://10.0.0.1:80/x", "address_not_host_port", "e.g. '10.0.0.1:80'"),
    ("host-a:2222 ", "address_not_host_port", "whitespace"),
    ("host a:2222", "address_not_host_port", "remove it: 'hosta:2222'"),
    ("host-a:2222/path", "address_not_host_port", "has a path"),
    (":2222", "address_without_port", "has no host"),
    ("host-a", "address_without_port", "has no port"),
    ("host-a:", "port_not_numeric", "has port ''"),
    ("host-a:x1", "port_not_numeric", "not a number"),
    ("host-a:0", "port_out_of_range", "outside 1..65535"),
    ("host-a:65536", "port_out_of_range", "outside 1..65535"),
    ("-host:22", "address_bad_host", "not a valid hostname"),
    ("host..a:22", "address_bad_host", "not a valid hostname"),
    ("a" * 64 + ":22", "address_bad_host", "not a valid hostname"),
    ("256.1.1.1:22", "address_bad_host", "not an IPv4 address"),
    ("::1:2222", "address_bad_host", "without brackets"),
    ("[not-v6]:22", "address_bad_host", "not an IPv6 address"),
    (2222, "address_without_port", "is 2222, not a 'host:port' string"),
]


@pytest.mark.parametrize("address", VALID)
def test_valid_addresses_pass(address):
    assert address_problem(address) is None


@pytest.mark.parametrize("address, rule, text", INVALID)
def test_each_bad_address_names_its_problem_and_fix(address, rule, text):
    problem = address_problem(address)
    assert problem is not None and problem.rule == rule
    assert text in problem.text


def test_a_launcher_spec_with_a_bad_address_is_refused_naming_the_task_the_value_and_the_fix():
    with pytest.raises(ClusterConfigError) as error:
        validate_cluster_addresses({"worker": ("127.0.0.2:5000", "grpc://127.0.0.2:5001")},
                                   "the cluster the Ray launcher generated")
    message = str(error.value)
    assert "the cluster the Ray launcher generated: cluster.worker[1] 'grpc://127.0.0.2:5001'" in message
    assert "e.g. '127.0.0.2:5001'" in message
    assert [f.rule for f in error.value.findings] == ["address_not_host_port"]
    validate_cluster_addresses({"worker": ("127.0.0.2:5000", "127.0.0.2:5001")}, "ok")
