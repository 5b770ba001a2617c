"""`train.ray`: the Ray launcher's settings (`launch/ray_launcher.py` names this model as its `config_model`).

It lives in `config`, below `launch`, because `PipelineConfig`'s schema (the YAML and Prefect's parameter form)
is built from it; nothing in it imports Ray.
"""

from __future__ import annotations

import enum
import os

from pydantic import Field, field_validator

from pipeline_lib.config.base import ConfigError, SecretSettings, _Frozen


class RayPlacement(str, enum.Enum):
    SPREAD = "spread"  # one task per node (STRICT_SPREAD)
    PACK = "pack"  # as few nodes as fit (PACK)


RAY_ADDRESS_ENV = "RAY_ADDRESS"


def checked_resources(key: str, value: dict[str, float]) -> dict[str, float]:
    """`value`, the resources a Ray task asks for, when every amount is ≥ 0 and one is > 0."""
    negative = {k: v for k, v in value.items() if v < 0}
    if negative:
        raise ValueError(f"{key} {negative} must be ≥ 0 (CPU, GPU, memory in bytes, or a custom "
                         "resource of your nodes)")
    if not any(v > 0 for v in value.values()):
        raise ValueError(f"{key} ({value}) reserves nothing; give each task at least one "
                         "resource, e.g. {CPU: 1}")
    return value


class RayConfig(_Frozen):
    """`train.ray`: where the Ray cluster is and what each task reserves on it (used when train.launcher is ray)."""

    address: str | None = None  # None: $RAY_ADDRESS
    """the Ray head's GCS address (`10.0.0.5:6379`); neither set with `launcher: ray` → an error naming both"""
    resources_per_worker: dict[str, float] = Field(default_factory=lambda: {"CPU": 1.0})
    """what each task's bundle reserves: `CPU`, `GPU`, `memory` (bytes) and custom resources; more than any node
    has → an error before any actor starts"""
    placement: RayPlacement = RayPlacement.SPREAD
    """`spread`: one task per node (`STRICT_SPREAD`; too few nodes → an error with the nodes needed and
    available), `pack`: as few nodes as fit"""
    runtime_env: SecretSettings = Field(default_factory=dict)  # passed through to every task's actor
    """passed through to every task's actor (`env_vars`, `pip`, `working_dir`…)"""
    node_ip_address: str | None = None  # this driver's IP as Ray nodes reach it (ray.init's _node_ip_address)
    """this driver's IP as the nodes reach it (`ray.init(_node_ip_address=...)`); unset: Ray picks"""
    placement_timeout_s: float = Field(60.0, gt=0.0)
    """how long Ray may take to place the bundles and answer the actors' first calls"""

    @field_validator("resources_per_worker")
    @classmethod
    def _known_resources(cls, value: dict[str, float]) -> dict[str, float]:
        return checked_resources("resources_per_worker", value)

    def resolved_address(self, environ: dict[str, str] | None = None) -> str:
        """train.ray.address, else $RAY_ADDRESS.

        Raises:
            ConfigError: when neither is set, naming both.
        """
        environ = os.environ if environ is None else environ
        address = self.address or environ.get(RAY_ADDRESS_ENV, "").strip()
        if not address:
            raise ConfigError("train.launcher is 'ray' but neither train.ray.address nor the RAY_ADDRESS environment "
                              "variable is set; set train.ray.address to the Ray head (e.g. '10.0.0.5:6379' or "
                              "'ray://head:10001') or export RAY_ADDRESS")
        return address
