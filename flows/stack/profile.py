"""The user's Prefect profile: `up` points one at the stack and activates it, `down` switches back."""

from __future__ import annotations

import re
import subprocess

from flows.stack.processes import StackError, base_env, console_script

PROFILE = "tfdag-local"


def _user_prefect(*args: str) -> subprocess.CompletedProcess:
    """The `prefect` CLI as the user's shell sees it (their PREFECT_HOME and profiles, not the stack's)."""
    env = base_env()
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_PROFILE", None)
    return subprocess.run([console_script("prefect"), *args], env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, check=False)


def active_profile() -> str | None:
    """The user's active Prefect profile name."""
    match = re.search(r"PREFECT_PROFILE='([^']+)'", _user_prefect("config", "view").stdout)
    return match.group(1) if match else None


def use_profile(api_url: str, name: str = PROFILE) -> str | None:
    """Point a Prefect profile at the stack's API and make it active, so a plain `prefect ...` reaches the stack.

    Returns:
        The profile that was active before (`down` switches back to it).
    """
    previous = active_profile()
    _user_prefect("profile", "create", name)  # fails harmlessly when it exists
    for args in (("--profile", name, "config", "set", f"PREFECT_API_URL={api_url}"), ("profile", "use", name)):
        result = _user_prefect(*args)
        if result.returncode != 0:
            raise StackError(f"`prefect {' '.join(args)}` failed: {(result.stdout + result.stderr)[-2000:]}")
    return previous if previous != name else None


def restore_profile(profile: str | None, previous: str | None) -> str | None:
    """Make `previous` active again when `profile` (the stack's) still is; returns a line saying so, or None."""
    if not (profile and previous and active_profile() == profile):
        return None
    if _user_prefect("profile", "use", previous).returncode != 0:
        return None
    return f"Prefect profile {previous!r} is active again"
