"""What this machine has: the relevant environment (secrets masked), package versions, TF build and devices."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict

from pipeline_lib.core.secrets import mask_secrets


def relevant_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The `TF_*`, `XLA_FLAGS` and `CUDA_VISIBLE_DEVICES` variables, masked, sorted by name."""
    environ = os.environ if environ is None else environ
    picked = {k: v for k, v in environ.items()
              if k.startswith("TF_") or k in ("XLA_FLAGS", "CUDA_VISIBLE_DEVICES")}
    return mask_secrets(dict(sorted(picked.items())))


_DISTRIBUTIONS = {
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel", "tensorflow-macos",
                   "tf-nightly"),
    "keras": ("keras", "keras-nightly"),
    "protobuf": ("protobuf",),
    "numpy": ("numpy",),
    "tfdag": ("tfdag",),
    "prefect": ("prefect",),
}


def package_versions(names: Sequence[str] = ("tensorflow", "keras", "protobuf", "numpy", "tfdag", "prefect")
                     ) -> dict[str, str]:
    """Python and package versions from the installed metadata (no package is imported).

    A package that is not installed reads "not installed".
    """
    versions = {"python": platform.python_version()}
    for name in names:
        found = "not installed"
        for distribution in _DISTRIBUTIONS.get(name, (name,)):
            try:
                found = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        versions[name] = found
    return versions


class GpuInfo(BaseModel):
    """A visible GPU: TensorFlow's device name, its model and total memory (None where unknown)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str
    name: str | None = None
    memory_mb: int | None = None


def _nvidia_smi_gpus() -> list[tuple[str, int]]:
    """(name, memory MiB) per GPU from nvidia-smi, in its index order; [] without it."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return []
    try:
        output = subprocess.run([binary, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in output.strip().splitlines():
        name, _, memory = line.rpartition(",")
        try:
            rows.append((name.strip(), int(float(memory.strip()))))
        except ValueError:
            continue
    return rows


def visible_gpus(environ: Mapping[str, str] | None = None) -> tuple[GpuInfo, ...]:
    """The GPUs TensorFlow sees, without initialising its runtime (logical devices can still be set)."""
    import tensorflow as tf

    devices = tf.config.list_physical_devices("GPU")
    if not devices:
        return ()
    smi = _nvidia_smi_gpus()
    visible = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES", "")
    order = list(range(len(smi)))
    if visible.strip():
        wanted = [int(part) for part in visible.split(",") if part.strip().isdigit()]
        if len(wanted) == len([p for p in visible.split(",") if p.strip()]):
            order = [i for i in wanted if i < len(smi)]
    found = []
    for position, device in enumerate(devices):
        try:
            name = tf.config.experimental.get_device_details(device).get("device_name")
        except (RuntimeError, ValueError):  # pragma: no cover - depends on the driver
            name = None
        memory = None
        if position < len(order):
            smi_name, memory = smi[order[position]]
            name = name or smi_name
        found.append(GpuInfo(device=device.name, name=name, memory_mb=memory))
    return tuple(found)


def tf_build_info() -> dict[str, str]:
    """CUDA and cuDNN versions TensorFlow was built with (tf.sysconfig.get_build_info()), as strings."""
    import tensorflow as tf

    info = tf.sysconfig.get_build_info()
    keys = ("cuda_version", "cudnn_version", "is_cuda_build", "is_rocm_build")
    return {key: str(info.get(key, "")) for key in keys}


def visible_devices() -> dict[str, tuple[str, ...]]:
    """Physical device names by type (CPU, GPU, TPU); listing them does not initialise TensorFlow."""
    import tensorflow as tf

    return {kind: tuple(d.name for d in tf.config.list_physical_devices(kind)) for kind in ("CPU", "GPU", "TPU")}
