"""Which names hold credentials, and the one way a value under such a name is written out: masked, kept as a
`${NAME}` reference, or (for a process of this run) turned into a reference to an environment variable."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# CONNECTION_STRING: an Azure connection string holds the account key (AZURE_STORAGE_CONNECTION_STRING, adlfs's
# connection_string); CREDENTIAL: GOOGLE_APPLICATION_CREDENTIALS, azure's credential option.
SECRET_MARKERS = ("KEY", "SECRET", "TOKEN", "PASSWORD", "CONNECTION_STRING", "CREDENTIAL")
# pydantic's SecretStr shows the same: a reader of the Prefect UI or MLflow recognises it.
MASK = "**********"
# The prefix of the environment variables that carry a literal secret to the processes of a run (SecretEnv).
SECRET_ENV_PREFIX = "TFDAG_SECRET_"
# The key of pydantic's serialization context that says how credentials are written (see `secrets_context`).
CONTEXT_KEY = "tfdag_secrets"
# scheme://user:password@host — the password part.
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]+:)(?P<password>[^/\s@]+)@")
# A value that is only `${NAME}` references (storage.expand_env) names variables and holds no secret.
_ENV_REFERENCES_ONLY = re.compile(r"^(\$\{[A-Za-z_][A-Za-z0-9_]*\})+$")


def is_secret_name(name: str) -> bool:
    """True for names that look like credentials (they contain KEY, SECRET, TOKEN, PASSWORD, CONNECTION_STRING or
    CREDENTIAL, in any case)."""
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


def is_env_reference(value: Any) -> bool:
    """True for a string made only of `${NAME}` references, such as `"${AWS_SECRET_ACCESS_KEY}"`."""
    return isinstance(value, str) and bool(_ENV_REFERENCES_ONLY.match(value))


def is_masked(value: Any) -> bool:
    """True for a string in which a credential was masked (a whole value, or a URL's password)."""
    return isinstance(value, str) and MASK in value


class SecretEnv:
    """Literal secrets of a config, each moved to an environment variable while the config is written for another
    process of the same run (a worker's spec): the spec holds `${TFDAG_SECRET_…}`, the process's environment the
    value, and the worker resolves the reference where it opens the storage (storage.expand_env)."""

    def __init__(self) -> None:
        self.env: dict[str, str] = {}

    def reference(self, where: str, value: str) -> str:
        """`${NAME}` for a new variable NAME (derived from `where`, the key path) that holds `value`."""
        for name, held in self.env.items():
            if held == value:
                return f"${{{name}}}"
        base = SECRET_ENV_PREFIX + (re.sub(r"[^A-Za-z0-9]+", "_", where).strip("_").upper() or "VALUE")
        name, number = base, 1
        while name in self.env:
            number += 1
            name = f"{base}_{number}"
        self.env[name] = value
        return f"${{{name}}}"


def secrets_context(env: SecretEnv | None = None, *, reveal: bool = False) -> dict[str, Any]:
    """The serialization context for `model_dump(context=...)` of a config: by default (no context) every credential
    is masked; with `env`, literal secrets become references to variables collected in `env`; `reveal` keeps values
    (only for a copy that never leaves this process, such as a config re-validated with overrides)."""
    return {CONTEXT_KEY: "reveal" if reveal else env}


def serialize_secrets(value: Any, context: Any, where: str = "") -> Any:
    """How a config writes a field that may hold credentials: settings (storage options, a runtime env) or a URL.

    The one serializer of credentials: under a secret name (at any depth) a literal becomes MASK, a `${NAME}`
    reference stays; a URL's password likewise. `context` is pydantic's serialization context (see
    `secrets_context`): None masks.
    """
    mode = context.get(CONTEXT_KEY) if isinstance(context, Mapping) else None
    if mode == "reveal":
        return value
    return _masked("", value, where, mode if isinstance(mode, SecretEnv) else None, secret=False)


def mask_secrets(values: Mapping[str, Any] | None, env: SecretEnv | None = None) -> dict[str, Any]:
    """A copy of `values` safe to log or store: the value under every secret name replaced by MASK (or, with `env`,
    by a reference to a variable in `env`), and the password of every URL likewise.

    Nested mappings (fsspec's `client_kwargs`, say) are masked the same way; a secret name masks its whole value,
    nested or not, except a `${NAME}` reference, which names a variable, not its value.

    Args:
        values: environment variables, storage_options or any other settings; None reads as empty.
        env: collects the literal secrets as environment variables instead of masking them.

    Returns:
        A new dict; `values` is left as it was.
    """
    return {name: _masked(str(name), value, str(name), env, secret=False) for name, value in (values or {}).items()}


def _masked(name: str, value: Any, where: str, env: SecretEnv | None, *, secret: bool) -> Any:
    secret = secret or is_secret_name(name)
    if value is None or isinstance(value, bool):
        return value  # a flag (`anon: true`) is a setting, not a credential
    if secret and env is None and not isinstance(value, str):
        return MASK  # a secret name masks its whole value, nested or not
    if isinstance(value, Mapping):
        return {key: _masked(str(key), item, f"{where}.{key}" if where else str(key), env, secret=secret)
                for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_masked(name, item, f"{where}_{i}", env, secret=secret) for i, item in enumerate(value)]
    if not isinstance(value, str):
        return value  # a number in a process's own copy (the strings beside it are references)
    if secret:
        # Kept as written: the process that opens the storage resolves the reference from its own environment.
        if is_env_reference(value) or value == MASK:
            return value
        return env.reference(where, value) if env is not None else MASK
    return _mask_url_password(value, where, env)


def _mask_url_password(text: str, where: str, env: SecretEnv | None) -> str:
    def replace(match: re.Match[str]) -> str:
        password = match.group("password")
        if is_env_reference(password) or password == MASK:
            return match.group(0)
        shown = env.reference(f"{where}_password", password) if env is not None else MASK
        return f"{match.group('head')}{shown}@"

    return _URL_PASSWORD.sub(replace, text)


def mask_url_passwords(text: str) -> str:
    """`text` with the password of every `scheme://user:password@host` replaced by MASK (a `${NAME}` reference
    kept): the one rule for a tracking URI in a log line, a message or an artifact."""
    return _mask_url_password(text, "", None)
