"""Prefect's side of credentials: `${prefect-secret:NAME}` references resolved from Prefect Secret blocks (registered
on import), and a flow run's recorded parameters replaced by their masked form."""

from __future__ import annotations

import json
from typing import Any

from pipeline_lib.core import secrets

# Prefect is imported inside each function: importing this module only registers the reference scheme, so the CLI's
# stage commands (which import it to resolve `${prefect-secret:NAME}` too) pay for Prefect only when a config names a
# block, and never before `tfdag` has chosen its Prefect API.

SCHEME = "prefect-secret"


def load_secret_block(name: str) -> str:
    """The value of the Prefect Secret block `name` on the current Prefect API (a JSON value as JSON text).

    Raises:
        LookupError: when the server has no Secret block of that name, naming how to create it.
    """
    from prefect.blocks.system import Secret

    try:
        block = Secret.load(name, _sync=True)
    except ValueError as error:  # Prefect's "Unable to find block document named ..."
        raise LookupError(f"{error}; create it with `prefect block create secret` or "
                          f"`Secret(value=...).save({name!r})` on this Prefect server") from None
    value = block.get()
    return value if isinstance(value, str) else json.dumps(value)


secrets.register_resolver(SCHEME, load_secret_block)


def recorded_parameters() -> dict[str, Any] | None:
    """The parameters of the running flow run as Prefect recorded them (JSON, before the flow validated them: a dict
    given for a PipelineConfig is recorded as given); None outside a flow run."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return None
    return dict(context.flow_run.parameters)


def replace_recorded_parameters(parameters: dict[str, Any]) -> None:
    """Replace the running flow run's recorded parameters (all of them: Prefect does not merge) on the server."""
    from prefect import get_client
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    with get_client(sync_client=True) as client:
        client.update_flow_run(context.flow_run.id, parameters=parameters).raise_for_status()
