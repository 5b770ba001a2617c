"""deployments/ as Kubernetes takes it: the RayCluster against KubeRay's CRD schema, the Kubernetes objects in it
(and any plain manifest) against Kubernetes' own schemas, and its autoscaler settings as the Ray autoscaler reads them.

No API server and no KubeRay operator run here: these are the checks `kubectl apply` makes before anything is
created, and what the autoscaler derives from the template; that a real cluster then scales is not tested.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import ray
import yaml
from ray.autoscaler._private.kuberay.autoscaling_config import (
    _derive_autoscaling_config_from_ray_cr,
)

from flows.stack.ray_cluster import WORKER_NODE
from tests.servers import ROOT

DEPLOYMENTS = ROOT / "deployments"
KUBERAY_CLUSTER = DEPLOYMENTS / "kuberay-cluster.yaml"
KUBERAY_VERSION = "v1.7.0"  # the release the schema was vendored from (schemas/README.md)
RAYCLUSTER_SCHEMA = Path(__file__).parent / "schemas" / f"raycluster-v1-kuberay-{KUBERAY_VERSION}.json"
# The Kubernetes API that KubeRay v1.7.0 is built against (its ray-operator/go.mod requires k8s.io/api v0.36.0).
KUBERNETES_VERSION = "1.36"

_FORMATS = jsonschema.FormatChecker(formats=())


@_FORMATS.checks("int32")
def _is_int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@_FORMATS.checks("int64")
def _is_int64(value: object) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with every object that lists its fields closed to others.

    `kubectl apply` validates strictly by default: a field the CRD does not declare fails the request, where the
    schema alone would have the API server drop it silently (a misspelt `maxReplica` would leave the default).
    """
    schema = dict(schema)
    if "properties" in schema:
        schema["properties"] = {name: _closed(sub) for name, sub in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            schema[key] = _closed(schema[key])
    return schema


@functools.cache
def _raycluster_validator() -> jsonschema.Draft4Validator:
    # A CRD's openAPIV3Schema is OpenAPI 3.0's subset of JSON Schema draft 4; the x-kubernetes-* keys are ignored.
    schema = _closed(json.loads(RAYCLUSTER_SCHEMA.read_text()))
    return jsonschema.Draft4Validator(schema, format_checker=_FORMATS)


def _schema_errors(manifest: dict[str, Any]) -> list[tuple[str, str, str]]:
    errors = _raycluster_validator().iter_errors(manifest)
    return sorted((error.json_path, error.validator, error.message) for error in errors)


def _raycluster() -> dict[str, Any]:
    return yaml.safe_load(KUBERAY_CLUSTER.read_text())


def test_kuberay_cluster_is_a_valid_raycluster_of_kuberay():
    manifest = _raycluster()
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayCluster")
    errors = _schema_errors(manifest)
    assert errors == [], "\n".join(f"{path}: {message}" for path, _, message in errors)


def _parent(manifest: dict, path: str) -> tuple[Any, str]:
    """The node that holds the last key of a dotted `path` (list indexes as numbers), and that key."""
    *parents, last = path.split(".")
    node = manifest
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    return node, last


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def change(manifest: dict) -> None:
        node, key = _parent(manifest, path)
        node[key] = value
    return change


def _delete(path: str) -> Callable[[dict], None]:
    def change(manifest: dict) -> None:
        node, key = _parent(manifest, path)
        del node[key]
    return change


@pytest.mark.parametrize("change, json_path, validator", [
    (_set("spec.workerGroupSpecs.0.minReplicas", "2"), "$.spec.workerGroupSpecs[0].minReplicas", "type"),
    (_set("spec.workerGroupSpecs.0.maxReplicas", 2**31), "$.spec.workerGroupSpecs[0].maxReplicas", "format"),
    (_delete("spec.workerGroupSpecs.0.groupName"), "$.spec.workerGroupSpecs[0]", "required"),
    (_set("spec.workerGroupSpecs.0.maxReplica", 8), "$.spec.workerGroupSpecs[0]", "additionalProperties"),
    (_set("spec.autoscalerOptions.upscalingMode", "Fast"), "$.spec.autoscalerOptions.upscalingMode", "enum"),
    (_set("spec.autoscalerOptions.version", "v3"), "$.spec.autoscalerOptions.version", "enum"),
    (_set("spec.enableInTreeAutoscaling", "true"), "$.spec.enableInTreeAutoscaling", "type"),
    (_delete("spec.headGroupSpec"), "$.spec", "required"),
    (_set("spec.headGroupSpec.template.spec.containers.0.ports.0.containerPort", "6379"),
     "$.spec.headGroupSpec.template.spec.containers[0].ports[0].containerPort", "type"),
], ids=["minReplicas-string", "maxReplicas-over-int32", "no-groupName", "misspelt-maxReplicas",
        "unknown-upscalingMode", "unknown-autoscaler-version", "autoscaling-flag-string", "no-headGroupSpec",
        "containerPort-string"])
def test_the_schema_check_refuses_a_broken_raycluster(change, json_path, validator):
    manifest = _raycluster()
    change(manifest)
    assert [(path, kind) for path, kind, _ in _schema_errors(manifest)] == [(json_path, validator)]


def test_kuberay_autoscaler_sizes_the_labelled_worker_group():
    manifest = _raycluster()
    spec = manifest["spec"]
    (workers,) = spec["workerGroupSpecs"]
    assert spec["enableInTreeAutoscaling"] is True and spec["autoscalerOptions"]["version"] == "v2"
    # The KubeRay operator's own rules (validation.go) that the autoscaler settings touch: minReplicas ≤ maxReplicas,
    # and with autoscaler v2 no pod template may set a restartPolicy other than Never.
    assert workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]
    # The launcher places a group only on live nodes, so the floor holds the repository's Ray run and a spare.
    ray_run = yaml.safe_load((ROOT / "examples" / "digits_ray.yaml").read_text())["train"]
    assert workers["minReplicas"] >= ray_run["workers"] + 1
    for group in (spec["headGroupSpec"], workers):
        assert group["template"]["spec"].get("restartPolicy", "Never") == "Never"
        assert all(c["image"].startswith("<registry>/") for c in group["template"]["spec"]["containers"])

    # What the Ray autoscaler makes of it: _derive_autoscaling_config_from_ray_cr is private, but it is what the
    # autoscaler sidecar calls on the RayCluster it reads, in the Ray version the template's image runs.
    assert spec["rayVersion"] == ray.__version__
    config = _derive_autoscaling_config_from_ray_cr(manifest)
    head, trainers = config["available_node_types"]["headgroup"], config["available_node_types"][workers["groupName"]]
    assert head["resources"]["CPU"] == 0 and WORKER_NODE not in head["resources"]  # no training task on the head
    # The autoscaler knows this group's pods carry WORKER_NODE: demand for it (tfdag's bundles) adds pods of this group.
    assert trainers["resources"][WORKER_NODE] == 1 and trainers["resources"]["CPU"] == 4
    assert (trainers["min_workers"], trainers["max_workers"]) == (workers["minReplicas"], workers["maxReplicas"])
    assert config["idle_timeout_minutes"] * 60 == spec["autoscalerOptions"]["idleTimeoutSeconds"]
    conservative = copy.deepcopy(manifest)
    conservative["spec"]["autoscalerOptions"]["upscalingMode"] = "Conservative"
    assert config["upscaling_speed"] > _derive_autoscaling_config_from_ray_cr(conservative)["upscaling_speed"]


def _pod_template(name: str, template: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


def _kubernetes_objects() -> list[tuple[str, dict[str, Any]]]:
    """(where, object) for each standard Kubernetes object in deployments/*.yaml.

    The pod templates of a RayCluster are core/v1 PodTemplateSpecs that KubeRay turns into pods, so each is checked
    as a PodTemplate; any other document with a `kind` is a plain manifest (the Prefect files have none: theirs are
    prefect.yaml documents or commented out).
    """
    objects = []
    for path in sorted(DEPLOYMENTS.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if not isinstance(document, dict) or "kind" not in document:
                continue
            if document["apiVersion"].startswith("ray.io/"):
                spec = document["spec"]
                groups = [("headGroupSpec", spec["headGroupSpec"])]
                groups += [(f"workerGroupSpecs[{g['groupName']}]", g) for g in spec["workerGroupSpecs"]]
                objects += [(f"{path.name}: {where}.template", _pod_template(where, group["template"]))
                            for where, group in groups]
            else:
                objects.append((f"{path.name}: {document['kind']}", document))
    return objects


def _validate_kubernetes(manifest: dict[str, Any]) -> str:
    # The strict schemas refuse unknown fields, as `kubectl apply` does; the package ships them (no network).
    return kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


_OBJECTS = _kubernetes_objects()


@pytest.mark.parametrize("manifest", [manifest for _, manifest in _OBJECTS], ids=[where for where, _ in _OBJECTS])
def test_kubernetes_objects_validate_against_kubernetes(manifest):
    # The version that answers is the schema set used: the newest the package has that is not newer than asked.
    assert _validate_kubernetes(manifest) == KUBERNETES_VERSION


@pytest.mark.parametrize("change, path, message", [
    (_set("template.spec.containers.0.resource", {}), ["template", "spec", "containers", 0], "'resource' was unexpected"),
    (_set("template.spec.containers.0.ports.0.containerPort", "6379"),
     ["template", "spec", "containers", 0, "ports", 0, "containerPort"], "is not of type 'integer'"),
    (_delete("template.spec.containers.0.name"), ["template", "spec", "containers", 0], "'name' is a required property"),
], ids=["misspelt-resources", "containerPort-string", "container-without-name"])
def test_the_kubernetes_check_refuses_a_broken_pod_template(change, path, message):
    spec = _raycluster()["spec"]
    manifest = _pod_template("headGroupSpec", spec["headGroupSpec"]["template"])
    change(manifest)
    with pytest.raises(kubernetes_validate.ValidationError) as raised:
        _validate_kubernetes(manifest)
    assert list(raised.value.path) == path and message in raised.value.message
