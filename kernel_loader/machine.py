"""What this machine can run: torch version and ABI, compute backend, CPU, OS and GPU.

Variant selection takes a :class:`Machine` argument, so tests describe a machine instead of
faking files, and ``kernel-loader explain --machine ...`` can answer for another host.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import importlib.util
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, NamedTuple

from kernel_loader import constants
from kernel_loader.errors import InvalidArgumentError

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
            InvalidArgumentError: (a ValueError) ``backend`` is unknown, or neither ``"cpu"``
                nor this machine's backend.
        """
        if backend == self.backend:
            return self
        if backend == "cpu":
            return replace(self, backend="cpu", backend_version=None, gpu_capability=None, gpu_arch=None)
        if backend not in BACKENDS:
            raise InvalidArgumentError(
                f"backend={backend!r} is not a known backend; known: {', '.join(BACKENDS)} "
                f"(this machine has {self.available_backends()})"
            )
        raise InvalidArgumentError(
            f"backend={backend!r} is not available here: this machine (torch {self.torch_version or 'not installed'}) "
            f"has {self.available_backends()}"
        )

    def available_backends(self) -> str:
        """The backends this machine can use, e.g. ``"cuda or cpu"``."""
        return "cpu" if self.backend == "cpu" else f"{self.backend} or cpu"

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


# -- torch, read from its installed files --------------------------------------------------------
#
# Importing torch costs seconds on a small machine; every fact variant selection needs is also
# written in files torch ships as text, so they are read from there. The torch import remains
# only as the last resort (an install whose files do not say).


def _torch_dir() -> Path | None:
    spec = importlib.util.find_spec("torch")  # a top-level find_spec imports nothing
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _version_py(torch_dir: Path) -> dict[str, object]:
    """The constants assigned in ``torch/version.py`` (``__version__``, ``cuda``, ``hip``, ``xpu``)."""
    try:
        tree = ast.parse((torch_dir / "version.py").read_text())
    except (OSError, SyntaxError, ValueError):
        return {}
    values: dict[str, object] = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            values[target.id] = value.value
    return values


_ABI_RETURN_RE = re.compile(r"def compiled_with_cxx11_abi\(\)[^:]*:\s*(?:r?\"\"\".*?\"\"\"\s*)?return (True|False)\b", re.S)
_ABI_FLAG_RE = re.compile(rb"_GLIBCXX_USE_CXX11_ABI=([01])")


def _torch_cxx11_abi(torch_dir: Path) -> bool | None:
    """Whether torch was built with the cxx11 C++ ABI, from the files it ships.

    Recent torch answers ``compiled_with_cxx11_abi()`` with a literal in ``torch/__init__.py``;
    older releases write ``-D_GLIBCXX_USE_CXX11_ABI=0|1`` into ``TorchConfig.cmake``. None when
    neither says (variant selection then ignores the ABI tag).
    """
    try:
        match = _ABI_RETURN_RE.search((torch_dir / "__init__.py").read_text(errors="replace"))
    except OSError:
        match = None
    if match:
        return match[1] == "True"
    for cmake in ("share/cmake/Torch/TorchConfig.cmake", "share/cmake/Caffe2/Caffe2Targets.cmake"):
        try:
            flag = _ABI_FLAG_RE.search((torch_dir / cmake).read_bytes())
        except OSError:
            continue
        if flag:
            return flag[1] == b"1"
    return None


def _major_minor(text: str) -> str:
    return ".".join(text.split("+")[0].split("-")[0].split(".")[:2])


# -- the GPU, asked of the driver ------------------------------------------------------------------


class _GpuProbe(NamedTuple):
    capability: tuple[int, int] | None
    name: str | None
    ambiguous: bool = False  # visible GPUs differ and the CUDA device order is not the driver's


def _nvml_gpus(library: str = "libnvidia-ml.so.1") -> list[tuple[str, tuple[int, int], str]] | None:
    """``[(uuid, capability, name), ...]`` in NVML (PCI bus) order, or None without a driver."""
    try:
        nvml = ctypes.CDLL(library)
    except OSError:
        return None
    try:
        if nvml.nvmlInit_v2() != 0:
            return None
        try:
            count = ctypes.c_uint()
            if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
                return None
            gpus = []
            for index in range(count.value):
                handle = ctypes.c_void_p()
                if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
                    continue
                major, minor = ctypes.c_int(), ctypes.c_int()
                if nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0:
                    continue
                name, uuid = ctypes.create_string_buffer(96), ctypes.create_string_buffer(96)
                nvml.nvmlDeviceGetName(handle, name, 96)
                nvml.nvmlDeviceGetUUID(handle, uuid, 96)
                gpus.append((uuid.value.decode(errors="replace"), (major.value, minor.value), name.value.decode(errors="replace")))
            return gpus
        finally:
            nvml.nvmlShutdown()
    except (AttributeError, OSError):  # a driver too old for these entry points
        return None


def _nvidia_smi_gpus() -> list[tuple[str, tuple[int, int], str]] | None:
    """The same list from ``nvidia-smi`` when the NVML library cannot be opened directly."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=uuid,compute_cap,name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",", 2)]
        if len(parts) == 3 and re.fullmatch(r"\d+\.\d+", parts[1]):
            major, minor = parts[1].split(".")
            gpus.append((parts[0], (int(major), int(minor)), parts[2]))
    return gpus


def _visible(gpus: list[tuple[str, tuple[int, int], str]], visible: str | None) -> list[tuple[str, tuple[int, int], str]]:
    """The GPUs CUDA will see under ``CUDA_VISIBLE_DEVICES`` (indices or UUID prefixes), in its order."""
    if visible is None:
        return gpus
    chosen = []
    for item in (v.strip() for v in visible.split(",")):
        if item.isdigit() and int(item) < len(gpus):
            chosen.append(gpus[int(item)])
        elif item and not item.lstrip("-").isdigit():
            found = [g for g in gpus if g[0].startswith(item) or g[0].startswith("GPU-" + item)]
            if len(found) != 1:
                break
            chosen.append(found[0])
        else:
            break  # CUDA stops at the first invalid entry
    return chosen


def _probe_gpu(gpus: list[tuple[str, tuple[int, int], str]] | None, visible: str | None, order: str | None) -> _GpuProbe:
    if not gpus:
        return _GpuProbe(None, None)
    seen = _visible(gpus, visible)
    if not seen:
        return _GpuProbe(None, None)
    if order != "PCI_BUS_ID" and len({(cap, name) for _, cap, name in seen}) > 1:
        # CUDA's default order is fastest first, not the driver's bus order: only torch knows
        # which of these mixed GPUs is device 0.
        return _GpuProbe(None, None, ambiguous=True)
    return _GpuProbe(seen[0][1], seen[0][2])


def _list_gpus() -> list[tuple[str, tuple[int, int], str]] | None:
    return _nvml_gpus() or _nvidia_smi_gpus()


def _detect_from_files(
    cpu: str, os_name: str, torch_dir: Path | None, list_gpus: Callable[[], list | None] = _list_gpus
) -> Machine | None:
    """The machine from torch's installed files and the driver; None when they do not tell."""
    if torch_dir is None:
        return Machine(None, None, "cpu", None, cpu, os_name)
    info = _version_py(torch_dir)
    version = info.get("__version__")
    if not isinstance(version, str):
        return None
    cxx11 = _torch_cxx11_abi(torch_dir) if os_name == "linux" else None
    hip, cuda_version, xpu = info.get("hip"), info.get("cuda"), info.get("xpu")
    backend, backend_version = "cpu", None
    if isinstance(hip, str) and hip:
        backend, backend_version = "rocm", _major_minor(hip)
    elif isinstance(cuda_version, str) and cuda_version:
        backend, backend_version = "cuda", _major_minor(cuda_version)
    elif isinstance(xpu, str) and xpu:
        # torch reports e.g. "20250100"; variants say xpu20251 (year.minor), as in `kernels`.
        backend, backend_version = "xpu", f"{xpu[0:4]}.{xpu[5:6]}"
    elif os_name == "darwin" and cpu == "aarch64":
        backend = "metal"  # every arm64 macOS torch wheel is built with MPS
    capability = gpu_arch = gpu_name = None
    if backend == "cuda":
        probe = _probe_gpu(list_gpus(), constants.cuda_visible_devices(), constants.cuda_device_order())
        if probe.ambiguous:
            return None
        capability, gpu_name = probe.capability, probe.name
    elif backend == "rocm":
        gpu_arch = _rocm_gpu_arch(Path("/sys/class/kfd/kfd/topology/nodes"))
    return Machine(_major_minor(version), cxx11, backend, backend_version, cpu, os_name, capability, gpu_arch, gpu_name)


def _rocm_gpu_arch(nodes: Path) -> str | None:
    """The gfx name of the first GPU node in the amdkfd topology (``gfx_target_version 90010`` -> gfx90a)."""
    try:
        folders = sorted(nodes.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 1 << 30)
    except OSError:
        return None
    for folder in folders:
        try:
            text = (folder / "properties").read_text()
        except OSError:
            continue
        match = re.search(r"^gfx_target_version (\d+)$", text, re.M)
        if match and int(match[1]) > 0:
            value = int(match[1])
            return f"gfx{value // 10000}{(value // 100) % 100:x}{value % 100:x}"
    return None


def _detect_with_torch(cpu: str, os_name: str) -> Machine:
    """The machine as the imported torch reports it (the last resort, and the tests' reference)."""
    try:
        import torch
    except ImportError:
        return Machine(None, None, "cpu", None, cpu, os_name)

    torch_version = _major_minor(torch.__version__)
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
        backend, backend_version = "rocm", _major_minor(torch.version.hip)
    elif torch.version.cuda is not None:
        backend, backend_version = "cuda", _major_minor(torch.version.cuda)
    elif getattr(torch.version, "xpu", None):
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


@functools.lru_cache(maxsize=1)
def detect_machine() -> Machine:
    """Describe this host (computed once per process).

    Reads torch's installed files (``torch/version.py``, the ABI it was built with) and asks the
    GPU driver (NVML, else ``nvidia-smi``) for the compute capability, so torch is not imported;
    only when those do not tell (e.g. mixed GPUs in CUDA's fastest-first order) is torch
    imported. Without torch the machine is ``cpu`` with ``torch_version=None`` (only noarch
    builds can match). A CUDA build of torch without a visible GPU is ``cuda`` with
    ``gpu_capability=None``. Never raises: a probe that fails leaves its field at None.
    """
    cpu, os_name = _platform()
    try:
        found = _detect_from_files(cpu, os_name, _torch_dir())
    except Exception:  # a damaged install: let torch itself answer
        found = None
    return found if found is not None else _detect_with_torch(cpu, os_name)
