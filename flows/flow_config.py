"""The pipeline config as commands and flows load it: `load` (a path, or the bundled demo), and a flow's `config`
parameter, refused when Prefect recorded it with a literal secret in it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline_lib.config import ConfigError, PipelineConfig, load_config, resolve_config
from pipeline_lib.config.pipeline import is_inline
from tasks import secrets as prefect_secrets

# Imported above, tasks.secrets makes `${prefect-secret:NAME}` references (Prefect Secret blocks) resolvable in a
# flow's process; the launchers hand the values on to the worker processes (PipelineConfig.for_process).
PREFECT_SECRET_SCHEME = prefect_secrets.SCHEME
# The config of every flow and command given none: the bundled demo.
DEFAULT_CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "digits.yaml")


def load(path: str | None) -> PipelineConfig:
    """The pipeline config at `path` (default: the bundled one), checked as it loads (`${prefect-secret:NAME}`
    references resolved: this module registers them). Loads without TensorFlow."""
    return load_config(path or DEFAULT_CONFIG)


def refuse_recorded_secrets(found: list[str], parameter: str, masked_parameters: dict[str, Any]) -> None:
    """Fail the flow run, before any stage, when its recorded parameters hold a literal secret.

    Prefect records a flow run's parameters before any flow code runs, and an inline config (YAML text or a
    mapping) as it was given. The recorded parameters are replaced by `masked_parameters` first (best effort: the
    error is what matters).

    Args:
        found: the key paths of the literal secrets (empty: nothing to refuse).
        parameter: the parameter that holds them, as the message names it.
        masked_parameters: every parameter of the run, the secrets masked.

    Raises:
        ConfigError: one line naming the keys, why, and the two references that work.
    """
    if not found:
        return
    try:
        prefect_secrets.replace_recorded_parameters(masked_parameters)
        replaced = "; the recorded copy was replaced by its masked form"
    except Exception as error:  # noqa: BLE001 - see the docstring
        replaced = f"; replacing the recorded copy failed ({type(error).__name__})"
    raise ConfigError(
        f"{parameter} holds a literal secret at {', '.join(found)}: Prefect records the flow run's parameter as it was "
        f"given (inline YAML, a mapping, overrides){replaced}; write the secret as a \"${{VARIABLE}}\" reference or a "
        f"\"${{{PREFECT_SECRET_SCHEME}:BLOCK_NAME}}\" reference to a Prefect Secret block, or pass the path of a "
        "YAML file (or a PipelineConfig from Python) instead")


def load_flow_config(config: PipelineConfig | str) -> PipelineConfig:
    """The `config` parameter of the training-pipeline flow as a PipelineConfig, refused (refuse_recorded_secrets)
    when Prefect recorded it inline with a literal secret.

    What Prefect recorded decides, not the argument: Prefect validates a mapping into a PipelineConfig before the
    flow runs, and records a PipelineConfig masked but a mapping as it was given.
    """
    recorded = prefect_secrets.recorded_parameters() or {"config": config}
    given = recorded.get("config", config)
    if is_inline(given):
        inline = resolve_config(given)
        masked = inline.masked_yaml() if isinstance(given, str) else inline.model_dump(mode="json", by_alias=True)
        refuse_recorded_secrets(inline.literal_secrets(), "config", {**recorded, "config": masked})
    return resolve_config(config)
