import platform
import subprocess
import sys

import pytest
import torch

from kernel_loader import machine as machine_mod
from kernel_loader.errors import InvalidArgumentError
from kernel_loader.machine import Machine, detect_machine

H200 = ("GPU-aaaa-1111", (9, 0), "NVIDIA H200")
A100 = ("GPU-bbbb-2222", (8, 0), "NVIDIA A100")


def test_detect_machine_matches_torch_and_platform():
    m = detect_machine()
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    assert m.torch_version == f"{major}.{minor}"
    assert m.backend in ("cuda", "rocm", "xpu", "metal", "cpu")
    if torch.version.cuda is None and not getattr(torch.version, "hip", None):
        assert m.backend in ("cpu", "metal", "xpu") and m.gpu_capability is None
    assert m.os == platform.system().lower()
    if m.os == "linux":
        assert m.cxx11_abi == torch.compiled_with_cxx11_abi()
    assert detect_machine() is m  # cached


def test_files_and_driver_tell_what_the_imported_torch_tells():
    cpu, os_name = machine_mod._platform()
    from_files = machine_mod._detect_from_files(cpu, os_name, machine_mod._torch_dir())
    assert from_files == machine_mod._detect_with_torch(cpu, os_name)


def test_describing_the_machine_does_not_import_torch():
    code = (
        "import sys; from kernel_loader.machine import detect_machine; m = detect_machine(); "
        "assert m.torch_version, m; assert 'torch' not in sys.modules, 'torch was imported'; print(m.describe())"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "NumPy" not in proc.stderr


def fake_torch(tmp_path, version_py, init_py="", cmake=None):
    root = tmp_path / "torch"
    root.mkdir()
    (root / "version.py").write_text(version_py)
    (root / "__init__.py").write_text(init_py)
    if cmake is not None:
        (root / "share/cmake/Torch").mkdir(parents=True)
        (root / "share/cmake/Torch/TorchConfig.cmake").write_text(cmake)
    return root


CUDA_VERSION_PY = "from typing import Optional\n__version__ = '2.8.0+cu128'\ncuda: Optional[str] = '12.8'\nhip = None\n"


def test_a_cuda_build_without_a_driver_is_cuda_without_a_gpu(tmp_path):
    root = fake_torch(tmp_path, CUDA_VERSION_PY, cmake='set(TORCH_CXX_FLAGS "-D_GLIBCXX_USE_CXX11_ABI=0")\n')
    m = machine_mod._detect_from_files("x86_64", "linux", root, list_gpus=lambda: None)
    assert (m.torch_version, m.backend, m.backend_version, m.cxx11_abi, m.gpu_capability) == ("2.8", "cuda", "12.8", False, None)


def test_gpu_capability_comes_from_the_driver(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    init = 'def compiled_with_cxx11_abi() -> builtins.bool:\n    r"""Returns whether..."""\n    return True\n'
    root = fake_torch(tmp_path, CUDA_VERSION_PY, init_py=init)
    m = machine_mod._detect_from_files("x86_64", "linux", root, list_gpus=lambda: [H200, H200])
    assert (m.cxx11_abi, m.gpu_capability, m.gpu_name) == (True, (9, 0), "NVIDIA H200")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert machine_mod._detect_from_files("x86_64", "linux", root, list_gpus=lambda: [H200]).gpu_capability is None


def test_cuda_visible_devices_picks_device_zero():
    gpus = [H200, A100]
    assert machine_mod._probe_gpu(gpus, "1", "PCI_BUS_ID").capability == (8, 0)
    assert machine_mod._probe_gpu(gpus, "GPU-bbbb", "PCI_BUS_ID").capability == (8, 0)
    assert machine_mod._probe_gpu(gpus, "bbbb", None).capability == (8, 0)  # one GPU visible: no ordering question
    assert machine_mod._probe_gpu(gpus, "-1", None).capability is None
    assert machine_mod._probe_gpu(gpus, "7", None).capability is None
    # mixed GPUs in CUDA's default fastest-first order: the driver cannot say which is device 0
    assert machine_mod._probe_gpu(gpus, None, None).ambiguous
    assert machine_mod._probe_gpu(gpus, None, "PCI_BUS_ID").capability == (9, 0)


def test_mixed_gpus_fall_back_to_torch(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    root = fake_torch(tmp_path, CUDA_VERSION_PY)
    assert machine_mod._detect_from_files("x86_64", "linux", root, list_gpus=lambda: [H200, A100]) is None


def test_no_driver_library_means_no_gpu_list():
    assert machine_mod._nvml_gpus("libnvidia-ml-not-here.so.1") is None


def test_rocm_version_and_gpu_arch(tmp_path):
    root = fake_torch(tmp_path, "__version__ = '2.7.1+rocm6.3'\ncuda = None\nhip = '6.3.42131-fa1d09cbd'\n")
    m = machine_mod._detect_from_files("x86_64", "linux", root)
    assert (m.backend, m.backend_version, m.cxx11_abi) == ("rocm", "6.3", None)
    nodes = tmp_path / "nodes"
    (nodes / "0").mkdir(parents=True)
    (nodes / "0" / "properties").write_text("cpu_cores_count 64\ngfx_target_version 0\n")
    (nodes / "1").mkdir()
    (nodes / "1" / "properties").write_text("simd_count 440\ngfx_target_version 90010\n")
    assert machine_mod._rocm_gpu_arch(nodes) == "gfx90a"
    assert machine_mod._rocm_gpu_arch(tmp_path / "absent") is None


def test_without_torch_only_noarch_builds_can_match(tmp_path):
    m = machine_mod._detect_from_files("x86_64", "linux", None)
    assert (m.torch_version, m.backend) == (None, "cpu")


def test_unreadable_version_file_lets_torch_answer(tmp_path):
    root = fake_torch(tmp_path, "this is not python(")
    assert machine_mod._detect_from_files("x86_64", "linux", root) is None


def test_machine_describe_and_json():
    m = Machine("2.8", True, "cuda", "12.8", "x86_64", "linux", (9, 0), None, "H100")
    text = m.describe()
    assert "torch 2.8" in text and "cuda 12.8" in text and "9.0" in text and "x86_64-linux" in text
    assert m.to_json()["gpu_capability"] == [9, 0]
    assert m.with_backend("cpu").gpu_capability is None


def test_with_backend_names_the_known_backends_and_this_machines():
    m = Machine("2.8", True, "cpu", None, "x86_64", "linux")
    with pytest.raises(InvalidArgumentError, match=r"'tpu' is not a known backend; known: cuda, rocm, xpu, metal, cpu \(this machine has cpu\)"):
        m.with_backend("tpu")
    with pytest.raises(InvalidArgumentError, match=r"'cuda' is not available here.*has cpu$"):
        m.with_backend("cuda")
