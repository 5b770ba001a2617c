"""Which Prefect API a `tfdag` command uses, chosen before Prefect is imported: PREFECT_API_URL, a running
`tfdag stack`, or an ephemeral server whose database stays under the project's `.tfdag/`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from pipeline_lib.config import DEFAULT_ROOT, RAY_ADDRESS_ENV

# The ephemeral server's database, under the state root. Prefect's default, ~/.prefect/prefect.db, is shared by
# every install of the user: a newer Prefect migrates it and an older one then fails to start on it ("Can't
# locate revision").
DATABASE_NAME = Path("prefect") / "prefect.db"
_DATABASE_ENV = ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")
# Prefect gives the ephemeral server 20 s to start; creating a fresh database takes longer than that on a busy
# machine, and the run then fails before any stage starts.
_STARTUP_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
_STARTUP_TIMEOUT_S = "90"


@dataclass(frozen=True)
class PrefectApi:
    """The API chosen: `url` None means Prefect starts an ephemeral server on `database_path`."""

    source: str  # "PREFECT_API_URL", "tfdag stack" or "ephemeral"
    url: str | None = None
    database_path: Path | None = None
    ray_address: str | None = None  # the running stack's Ray cluster, exported as RAY_ADDRESS

    def describe(self) -> str:
        if self.url is None:
            return f"an ephemeral Prefect server (database {self.database_path}; `tfdag stack up` keeps one running)"
        ray = f"; Ray: the stack's cluster at {self.ray_address} (RAY_ADDRESS)" if self.ray_address else ""
        return f"the Prefect API at {self.url} ({self.source}){ray}"


def _running_stack(root: str | os.PathLike[str]):
    """The state of the `tfdag stack` under `root` when its Prefect server answers, else None."""
    from flows import stack

    state = stack.read_state(root)
    record = state.service("prefect-server") if state is not None else None
    if record is None or stack.find_process(record) is None:
        return None
    return state if stack.prefect_server_answers(state.prefect_api_url) else None


def choose_prefect_api(root: str | os.PathLike[str] = DEFAULT_ROOT,
                       environ: MutableMapping[str, str] = os.environ) -> PrefectApi:
    """Pick the Prefect API and set `environ` for it; call before Prefect is imported (it reads them at import).

    PREFECT_API_URL wins; then a running `tfdag stack` under `root` (PREFECT_API_URL is set to it, so workers
    inherit it, and RAY_ADDRESS to the stack's Ray cluster when it has one and RAY_ADDRESS is unset); else Prefect will start an ephemeral server, and its database goes to `<root>/prefect/prefect.db`
    unless a database URL is set already. A Prefect profile with an API URL still applies then (`api_from_profile`).

    Args:
        root: the state root (`./.tfdag`).
        environ: the environment to read and update.

    Returns:
        What was chosen, for the line the CLI prints.
    """
    if environ.get("PREFECT_API_URL"):
        return PrefectApi("PREFECT_API_URL", environ["PREFECT_API_URL"])
    state = _running_stack(root)
    if state is not None:
        environ["PREFECT_API_URL"] = state.prefect_api_url
        ray_address = None
        if state.ray is not None and not environ.get(RAY_ADDRESS_ENV):
            # `tfdag stack up --ray N && tfdag run examples/digits_ray.yaml`: train.launcher: ray finds the stack's
            # cluster as the stack's own worker does.
            ray_address = environ[RAY_ADDRESS_ENV] = state.ray.address
        return PrefectApi("tfdag stack", state.prefect_api_url, ray_address=ray_address)
    database = (Path(root) / DATABASE_NAME).resolve()
    if not any(environ.get(name) for name in _DATABASE_ENV):
        database.parent.mkdir(parents=True, exist_ok=True)
        environ[_DATABASE_ENV[0]] = f"sqlite+aiosqlite:///{database}"
    environ.setdefault(_STARTUP_TIMEOUT_ENV, _STARTUP_TIMEOUT_S)
    return PrefectApi("ephemeral", database_path=database)


def api_from_profile(chosen: PrefectApi) -> PrefectApi:
    """`chosen`, or the API URL of the active Prefect profile when it names one (imports Prefect's settings)."""
    if chosen.url is not None:
        return chosen
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        return PrefectApi("the active Prefect profile", settings.api.url)
    return chosen


@contextlib.contextmanager
def heartbeats_only_when_set() -> Iterator[None]:
    """Within the block (a flow `tfdag` runs in its own process), Prefect's flow-run heartbeats only where the user set
    their frequency (PREFECT_FLOWS_HEARTBEAT_FREQUENCY, in the environment or the Prefect profile).

    Heartbeats feed Prefect's detection of crashed ("zombie") flow runs, which a user turns on with an automation and
    that setting. Otherwise nothing reads them, and Prefect ends every flow run by waiting out its heartbeat thread's
    current one-second sleep: up to a second of each short `tfdag run`. Flow runs a worker starts (deployments) keep
    Prefect's default."""
    from prefect.settings import (
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        get_current_settings,
        temporary_settings,
    )

    if "heartbeat_frequency" in get_current_settings().flows.model_fields_set:
        yield
        return
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield
