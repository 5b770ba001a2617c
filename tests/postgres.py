"""A throwaway PostgreSQL cluster on a loopback port for the tests that need a real database server (a study's
`tune.storage` with parallel writers): `initdb` into a temp directory, `pg_ctl start`, `pg_ctl stop` at the end.

Debian's `postgresql` package (installed by `.ci/install-test-deps`) puts its programs in
/usr/lib/postgresql/<version>/bin, off the PATH. PostgreSQL refuses to run as root: under root the cluster belongs
to, and runs as, the package's `postgres` user (else `nobody`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pipeline_lib.core.net import free_port

USER = "tfdag"  # the cluster's superuser; trust authentication on loopback, so the URL has no password


def postgres_bin_dir() -> Path | None:
    """Where `initdb` and `pg_ctl` are: the PATH's, else the newest of Debian's versioned directories."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(versions[-1]).parent if versions else None


def _run_as() -> tuple[int, int] | None:
    """The (uid, gid) to run PostgreSQL as when this process is root; None otherwise."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            entry = pwd.getpwnam(name)
            return entry.pw_uid, entry.pw_gid
    raise RuntimeError("running as root with neither a postgres nor a nobody user: PostgreSQL refuses root")


@contextlib.contextmanager
def postgres_cluster(bin_dir: Path) -> Iterator[str]:
    """A running cluster whose data and socket live in a new temp directory (under /tmp, which its user can reach
    when it is not ours), removed at the end; yields its SQLAlchemy URL (psycopg2 driver, the `postgres` database)."""
    ids = _run_as()
    with tempfile.TemporaryDirectory(prefix="tfdag-postgres-") as name:
        yield from _cluster(Path(name), bin_dir, ids)


def _cluster(directory: Path, bin_dir: Path, ids: tuple[int, int] | None) -> Iterator[str]:

    def as_owner() -> None:
        if ids is not None:
            os.setgid(ids[1])
            os.setuid(ids[0])

    data, sockets = directory / "data", directory / "sockets"
    sockets.mkdir(parents=True)
    if ids is not None:
        os.chown(directory, *ids)
        os.chown(sockets, *ids)
    run = {"preexec_fn": as_owner, "capture_output": True, "text": True, "timeout": 120, "cwd": directory,
           "env": {**os.environ, "LC_ALL": "C"}}
    done = subprocess.run([str(bin_dir / "initdb"), "-D", str(data), "-U", USER, "--auth=trust", "--no-sync",
                           "-E", "UTF8"], check=False, **run)
    if done.returncode != 0:
        raise RuntimeError(f"initdb failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    port = free_port()
    options = f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=50"
    log = directory / "postgres.log"
    done = subprocess.run([str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(log), "-w", "-t", "60",
                           "start"], check=False, **run)
    if done.returncode != 0:
        raise RuntimeError(f"pg_ctl start failed ({done.returncode}):\n{done.stdout}{done.stderr}\n"
                           f"{log.read_text() if log.exists() else ''}")
    try:
        yield f"postgresql+psycopg2://{USER}@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"], check=False, **run)
