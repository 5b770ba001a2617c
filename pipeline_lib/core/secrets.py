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
    its whole value, nested or not.

    Args:
        values: environment variables, storage_options or any other settings; None reads as empty.

    Returns:
        A new dict; `values` is left as it was.
    """
    return {name: _masked(str(name), value) for name, value in (values or {}).items()}


def _masked(name: str, value: Any) -> Any:
    if is_secret_name(name):
        return MASK
    if isinstance(value, Mapping):
        return mask_secrets(value)
    return value


def mask_url_passwords(text: str) -> str:
    """`text` with the password of every `scheme://user:password@host` replaced by ***."""
    return _URL_PASSWORD.sub(lambda m: f"{m.group('head')}{MASK}@", text)
