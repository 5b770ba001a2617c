"""Which Prefect API a `tfdag` command uses, chosen before Prefect is imported: PREFECT_API_URL, a running
`tfdag stack`, or an ephemeral server whose database stays under the project's `.tfdag/`."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from pipeline_lib.config import DEFAULT_ROOT

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

    def describe(self) -> str:
        if self.url is None:
            return f"an ephemeral Prefect server (database {self.database_path}; `tfdag stack up` keeps one running)"
        return f"the Prefect API at {self.url} ({self.source})"


def _running_stack_api(root: str | os.PathLike[str]) -> str | None:
    """The API URL of the `tfdag stack` under `root` when its Prefect server answers, else None."""
    from flows import stack

    state = stack.read_state(root)
    record = state.service("prefect-server") if state is not None else None
    if record is None or stack.find_process(record) is None:
        return None
    return state.prefect_api_url if stack.prefect_server_answers(state.prefect_api_url) else None


def choose_prefect_api(root: str | os.PathLike[str] = DEFAULT_ROOT,
                       environ: MutableMapping[str, str] = os.environ) -> PrefectApi:
    """Pick the Prefect API and set `environ` for it; call before Prefect is imported (it reads them at import).

    PREFECT_API_URL wins; then a running `tfdag stack` under `root` (PREFECT_API_URL is set to it, so workers
    inherit it); else Prefect will start an ephemeral server, and its database goes to `<root>/prefect/prefect.db`
    unless a database URL is set already. A Prefect profile with an API URL still applies then (`api_from_profile`).

    Args:
        root: the state root (`./.tfdag`).
        environ: the environment to read and update.

    Returns:
        What was chosen, for the line the CLI prints.
    """
    if environ.get("PREFECT_API_URL"):
        return PrefectApi("PREFECT_API_URL", environ["PREFECT_API_URL"])
    stack_url = _running_stack_api(root)
    if stack_url is not None:
        environ["PREFECT_API_URL"] = stack_url
        return PrefectApi("tfdag stack", stack_url)
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
