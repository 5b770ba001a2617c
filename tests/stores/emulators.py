"""The Google Cloud Storage and Azure Blob Storage emulators as child processes on 127.0.0.1, stoppable mid-test.

Each keeps its objects in a directory, so a stop (an outage: connections are refused) and a start on the same port
find every bucket and object still there. `gcp-storage-emulator` comes with the `dev` extra; Azurite is the npm
package that `.ci/install-test-deps` installs into `.tfdag-test-tools/` with Debian's Node.js.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOLS_DIR = REPO / ".tfdag-test-tools"

# Azurite's well-known development account: published by Microsoft, valid only against the emulator.
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def azurite_command() -> list[str] | None:
    """How to start Azurite's blob service here, or None when it is not installed."""
    local = TOOLS_DIR / "node_modules" / ".bin" / "azurite-blob"
    if local.exists() and shutil.which("node"):
        return [str(local)]
    found = shutil.which("azurite-blob")
    return [found] if found else None


def gcs_emulator_installed() -> bool:
    return importlib.util.find_spec("gcp_storage_emulator") is not None


def azurite_connection_string(endpoint: str, key: str = AZURITE_KEY) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={key};"
            f"BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};")


class EmulatorProcess:
    """One emulator child process on 127.0.0.1:`port`, started and stopped on demand (thread-safe)."""

    def __init__(self, name: str, argv: list[str], port: int, data_dir: Path, env: dict[str, str] | None = None):
        self.name = name
        self.argv = argv
        self.port = port
        self.data_dir = data_dir
        self.env = {**os.environ, **(env or {})}
        self.log_path = data_dir.parent / f"{name}.log"
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, timeout_s: float = 60.0) -> None:
        with self._lock:
            if self.running:
                return
            self.data_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as log:
                self._process = subprocess.Popen(self.argv, cwd=self.data_dir, env=self.env, stdout=log,
                                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                 start_new_session=True)
            deadline = time.monotonic() + timeout_s
            while not _accepts(self.port):
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self._kill()
                    raise RuntimeError(f"{self.name} did not start on 127.0.0.1:{self.port}: "
                                       f"{self.log_path.read_text(errors='replace')[-2000:]}")
                time.sleep(0.1)

    def stop(self) -> None:
        """End the process; from here on connections to its port are refused."""
        with self._lock:
            self._kill()

    def _kill(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _accepts(self.port) and time.monotonic() < deadline:
            time.sleep(0.05)


def _accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def gcs_emulator(port: int, data_dir: Path) -> EmulatorProcess:
    # The emulator with a byte-exact multipart reader: see gcs_emulator_main.py.
    argv = [sys.executable, "-m", "tests.stores.gcs_emulator_main", "start", "--host", "127.0.0.1", "--port", str(port),
            "-q"]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return EmulatorProcess("gcp-storage-emulator", argv, port, data_dir,
                           env={"STORAGE_BASE": str(data_dir), "PYTHONPATH": path})


def azurite(port: int, data_dir: Path, command: list[str]) -> EmulatorProcess:
    argv = [*command, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(data_dir),
            "--silent", "--skipApiVersionCheck", "--loose", "--disableTelemetry"]
    return EmulatorProcess("azurite", argv, port, data_dir)
