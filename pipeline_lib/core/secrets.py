"""Which names hold credentials, the one way a value under such a name is written out (masked, kept as a
`${NAME}` or `${SCHEME:NAME}` reference, or, for a process of this run, turned into a reference to an environment
variable), and the registry of the stores that resolve `${SCHEME:NAME}` references."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from pipeline_lib.core.errors import UserError

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
# `${NAME}`: an environment variable. `${SCHEME:NAME}`: a secret kept by a store (a Prefect Secret block:
# `${prefect-secret:NAME}`), fetched by the resolver registered for SCHEME in the process that needs the value. Not
# Prefect's `{{ prefect.blocks.… }}` template: `prefect deploy` replaces that by the value and stores it among the
# deployment's parameters.
REFERENCE = re.compile(r"\$\{(?:(?P<variable>[A-Za-z_][A-Za-z0-9_]*)|(?P<scheme>[a-z][a-z0-9-]*):(?P<name>[^}\s]+))\}")
# A value that is only references names variables or stored secrets and holds none.
_REFERENCES_ONLY = re.compile(rf"^(?:{REFERENCE.pattern})+$")
# scheme -> resolve_fn(name) -> the secret; see register_resolver.
_RESOLVERS: dict[str, Callable[[str], str]] = {}
_RESOLVED: dict[tuple[str, str], str] = {}


class SecretReferenceError(UserError, LookupError):
    """A `${SCHEME:NAME}` reference cannot be resolved: no resolver for SCHEME here, or the store has no NAME."""


def register_resolver(scheme: str, resolve_fn: Callable[[str], str]) -> None:
    """Make `${SCHEME:NAME}` references resolvable in this process (the layer that may import the store's client
    registers it: `tasks.secrets` for Prefect Secret blocks).

    Args:
        scheme: lowercase letters, digits and dashes, e.g. `prefect-secret`.
        resolve_fn: returns the secret stored under a name; raises LookupError (with a message naming the fix)
            when the store has no such name.
    """
    if not re.fullmatch(r"[a-z][a-z0-9-]*", scheme):
        raise ValueError(f"reference scheme {scheme!r} must be lowercase letters, digits and dashes")
    _RESOLVERS[scheme] = resolve_fn
    for key in [key for key in _RESOLVED if key[0] == scheme]:
        del _RESOLVED[key]


def has_store_reference(text: str) -> bool:
    """True when `text` holds a `${SCHEME:NAME}` reference."""
    return any(match.group("scheme") for match in REFERENCE.finditer(text))


def resolve_references(text: str, where: str, variable_fn: Callable[[str], str] | None = None) -> str:
    """`text` with every `${SCHEME:NAME}` reference replaced by the secret its store holds (each fetched once per
    process) and every `${NAME}` by `variable_fn(NAME)` (kept as written without one), in one pass: a resolved value
    is never read again as a reference.

    Raises:
        SecretReferenceError: naming `where`, the reference and the fix.
    """
    def resolve(match: re.Match[str]) -> str:
        if match.group("variable"):
            return variable_fn(match.group("variable")) if variable_fn else match.group(0)
        scheme, name = match.group("scheme"), match.group("name")
        if (scheme, name) in _RESOLVED:
            return _RESOLVED[(scheme, name)]
        resolve_fn = _RESOLVERS.get(scheme)
        if resolve_fn is None:
            known = ", ".join(sorted(_RESOLVERS)) or "none"
            raise SecretReferenceError(
                f"{where} refers to {match.group(0)}, and no resolver for {scheme!r} is registered in this process "
                f"(registered: {known}); run it through the tfdag flows (they register prefect-secret) or write "
                "a \"${VARIABLE}\" reference")
        try:
            value = resolve_fn(name)
        except LookupError as error:
            raise SecretReferenceError(f"{where} refers to {match.group(0)}: {error}") from None
        _RESOLVED[(scheme, name)] = value
        return value

    return REFERENCE.sub(resolve, text)


def is_secret_name(name: str) -> bool:
    """True for names that look like credentials (they contain KEY, SECRET, TOKEN, PASSWORD, CONNECTION_STRING or
    CREDENTIAL, in any case)."""
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


def is_reference(value: Any) -> bool:
    """True for a string made only of `${NAME}` and `${SCHEME:NAME}` references, such as
    `"${AWS_SECRET_ACCESS_KEY}"` or `"${prefect-secret:aws-secret}"`: it names where the secret is, not the secret."""
    return isinstance(value, str) and bool(_REFERENCES_ONLY.match(value))


def is_masked(value: Any) -> bool:
    """True for a string in which a credential was masked (a whole value, or a URL's password)."""
    return isinstance(value, str) and MASK in value


class SecretEnv:
    """Literal secrets of a config, each moved to an environment variable while the config is written for another
    process of the same run (a worker's spec): the spec holds `${TFDAG_SECRET_…}`, the process's environment the
    value, and the worker resolves the reference where it opens the storage (storage.expand_env).

    A `${SCHEME:NAME}` reference is resolved here, in the process that has its store's resolver, and its value moved
    the same way (a worker process of the local launcher or of Ray need not reach the store); with
    `resolve_stores=False` it is kept as written, and `env` collects the literal secrets only.
    """

    def __init__(self, *, resolve_stores: bool = True) -> None:
        self.env: dict[str, str] = {}
        self.resolve_stores = resolve_stores

    def referenced(self, where: str, value: str) -> str:
        """How a reference (`is_reference`) is written for the process: a `${NAME}` kept, a store's secret moved to a
        variable."""
        if self.resolve_stores and has_store_reference(value):
            return self.reference(where, resolve_references(value, where))
        return value

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

    The one serializer of credentials: under a secret name (at any depth) a literal becomes MASK, a `${NAME}` or
    `${SCHEME:NAME}` reference stays; a URL's password likewise. `context` is pydantic's serialization context (see
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
    nested or not, except a reference (`is_reference`), which names where the secret is, not its value.

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
    if value == MASK:
        return value
    if is_reference(value):
        # Kept as written (under any name): the process that opens the storage resolves it, a `${NAME}` from its own
        # environment; for another process a store's secret is resolved here (SecretEnv.referenced).
        return env.referenced(where, value) if env is not None else value
    if secret:
        return env.reference(where, value) if env is not None else MASK
    return _mask_url_password(value, where, env)


def _mask_url_password(text: str, where: str, env: SecretEnv | None) -> str:
    def replace(match: re.Match[str]) -> str:
        password = match.group("password")
        if password == MASK:
            return match.group(0)
        if is_reference(password):
            return f"{match.group('head')}{env.referenced(f'{where}_password', password)}@" if env else match.group(0)
        shown = env.reference(f"{where}_password", password) if env is not None else MASK
        return f"{match.group('head')}{shown}@"

    return _URL_PASSWORD.sub(replace, text)


def mask_url_passwords(text: str) -> str:
    """`text` with the password of every `scheme://user:password@host` replaced by MASK (a `${NAME}` reference
    kept): the one rule for a tracking URI in a log line, a message or an artifact."""
    return _mask_url_password(text, "", None)
