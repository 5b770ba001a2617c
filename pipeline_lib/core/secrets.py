"""Which names hold credentials, and copies of settings with those values masked for logs and reports."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# CONNECTION_STRING: an Azure connection string holds the account key (AZURE_STORAGE_CONNECTION_STRING, adlfs's
# connection_string); CREDENTIAL: GOOGLE_APPLICATION_CREDENTIALS, azure's credential option.
SECRET_MARKERS = ("KEY", "SECRET", "TOKEN", "PASSWORD", "CONNECTION_STRING", "CREDENTIAL")
MASK = "***"
# scheme://user:password@host — the password part.
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]+:)[^/\s@]+@")


def is_secret_name(name: str) -> bool:
    """True for names that look like credentials (they contain KEY, SECRET, TOKEN, PASSWORD, CONNECTION_STRING or
    CREDENTIAL, in any case)."""
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


def mask_secrets(values: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of `values` safe to log: the value under every secret name replaced by ***.

    Nested mappings (fsspec's `client_kwargs`, say) are masked the same way; a secret name masks
    its whole value, nested or not, except a `${NAME}` reference, which names a variable, not its value.

    Args:
        values: environment variables, storage_options or any other settings; None reads as empty.

    Returns:
        A new dict; `values` is left as it was.
    """
    return {name: _masked(str(name), value) for name, value in (values or {}).items()}


# A value that is only `${NAME}` references (storage.expand_env) names variables and holds no secret.
_ENV_REFERENCES_ONLY = re.compile(r"^(\$\{[A-Za-z_][A-Za-z0-9_]*\})+$")


def is_env_reference(value: Any) -> bool:
    """True for a string made only of `${NAME}` references, such as `"${AWS_SECRET_ACCESS_KEY}"`."""
    return isinstance(value, str) and bool(_ENV_REFERENCES_ONLY.match(value))


def _masked(name: str, value: Any) -> Any:
    if is_secret_name(name):
        # Kept as written: a rerun resolves the reference from its own environment.
        return value if is_env_reference(value) else MASK
    if isinstance(value, Mapping):
        return mask_secrets(value)
    return value


def mask_url_passwords(text: str) -> str:
    """`text` with the password of every `scheme://user:password@host` replaced by ***."""
    return _URL_PASSWORD.sub(lambda m: f"{m.group('head')}{MASK}@", text)
