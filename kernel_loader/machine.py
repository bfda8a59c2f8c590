"""What this machine can run: torch version and ABI, compute backend, CPU, OS and GPU.

Variant selection takes a :class:`Machine` argument, so tests describe a machine instead of
faking files, and ``kernel-loader explain --machine ...`` can answer for another host.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass, replace

BACKENDS = ("cuda", "rocm", "xpu", "metal", "cpu")


@dataclass(frozen=True)
class Machine:
    """A description of the host a kernel will run on.

    ``torch_version`` is ``"MAJOR.MINOR"`` (None without torch); ``backend`` one of
    :data:`BACKENDS`; ``backend_version`` e.g. ``"12.8"`` for CUDA 12.8 (None for cpu/metal);
    ``cpu_arch`` e.g. ``"x86_64"``/``"aarch64"``; ``os`` ``"linux"``/``"darwin"``/``"windows"``;
    ``gpu_capability`` the CUDA compute capability ``(major, minor)`` of the current device or
    None; ``gpu_arch`` the ROCm arch name (``"gfx90a"``) or None.
    """

    torch_version: str | None
    cxx11_abi: bool | None
    backend: str
    backend_version: str | None
    cpu_arch: str
    os: str
    gpu_capability: tuple[int, int] | None = None
    gpu_arch: str | None = None
    gpu_name: str | None = None

    def with_backend(self, backend: str) -> Machine:
        """This machine restricted to ``backend`` (``"cpu"`` is always possible).

        Raises:
            ValueError: ``backend`` is neither ``"cpu"`` nor this machine's backend.
        """
        if backend == self.backend:
            return self
        if backend == "cpu":
            return replace(self, backend="cpu", backend_version=None, gpu_capability=None, gpu_arch=None)
        raise ValueError(
            f"backend={backend!r} is not available here: this machine has {self.backend!r} "
            f"(torch {self.torch_version}); use 'cpu' or {self.backend!r}"
        )

    def describe(self) -> str:
        """One line, e.g. ``torch 2.8, cxx11 ABI, cuda 12.8, x86_64-linux, GPU capability 9.0``."""
        parts = [f"torch {self.torch_version or 'not installed'}"]
        if self.cxx11_abi is not None:
            parts.append("cxx11 ABI" if self.cxx11_abi else "pre-cxx11 ABI")
        parts.append(f"{self.backend} {self.backend_version}" if self.backend_version else self.backend)
        parts.append(f"{self.cpu_arch}-{self.os}")
        if self.gpu_capability is not None:
            parts.append(f"GPU capability {self.gpu_capability[0]}.{self.gpu_capability[1]}")
        if self.gpu_arch:
            parts.append(f"GPU arch {self.gpu_arch}")
        if self.gpu_name:
            parts.append(self.gpu_name)
        return ", ".join(parts)

    def to_json(self) -> dict:
        """A JSON-ready dict of every field."""
        return {
            "torch_version": self.torch_version,
            "cxx11_abi": self.cxx11_abi,
            "backend": self.backend,
            "backend_version": self.backend_version,
            "cpu_arch": self.cpu_arch,
            "os": self.os,
            "gpu_capability": list(self.gpu_capability) if self.gpu_capability else None,
            "gpu_arch": self.gpu_arch,
            "gpu_name": self.gpu_name,
        }


def _platform() -> tuple[str, str]:
    cpu = platform.machine().lower()
    os_name = platform.system().lower()
    cpu = {"arm64": "aarch64", "amd64": "x86_64", "x64": "x86_64"}.get(cpu, cpu)
    return cpu, os_name


@functools.lru_cache(maxsize=1)
def detect_machine() -> Machine:
    """Describe this host (computed once per process).

    Imports torch when it is installed; without torch the machine is described as ``cpu`` with
    ``torch_version=None`` (only noarch builds can match). Never raises: a probe that fails
    (e.g. a broken driver) leaves its field at None.
    """
    cpu, os_name = _platform()
    try:
        import torch
    except ImportError:
        return Machine(None, None, "cpu", None, cpu, os_name)

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    torch_version = f"{major}.{minor}"
    cxx11: bool | None = None
    if os_name == "linux":
        try:
            cxx11 = bool(torch.compiled_with_cxx11_abi())
        except Exception:  # very old torch
            cxx11 = None

    backend, backend_version = "cpu", None
    capability: tuple[int, int] | None = None
    gpu_arch = gpu_name = None
    if getattr(torch.version, "hip", None):
        backend, backend_version = "rocm", ".".join(torch.version.hip.split("-")[0].split(".")[:2])
    elif torch.version.cuda is not None:
        backend, backend_version = "cuda", ".".join(torch.version.cuda.split(".")[:2])
    elif getattr(torch.version, "xpu", None):
        # torch reports e.g. "20250100"; variants say xpu20251 (year.minor), as in `kernels`.
        xpu = str(torch.version.xpu)
        backend, backend_version = "xpu", f"{xpu[0:4]}.{xpu[5:6]}"
    elif os_name == "darwin" and torch.backends.mps.is_available():
        backend = "metal"

    if backend in ("cuda", "rocm"):
        try:
            if torch.cuda.is_available():
                index = torch.cuda.current_device()
                props = torch.cuda.get_device_properties(index)
                gpu_name = props.name
                if backend == "cuda":
                    capability = (int(props.major), int(props.minor))
                else:
                    gpu_arch = str(getattr(props, "gcnArchName", "") or "").split(":")[0] or None
        except Exception:
            pass
    return Machine(torch_version, cxx11, backend, backend_version, cpu, os_name, capability, gpu_arch, gpu_name)
