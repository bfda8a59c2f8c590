import platform

import torch

from kernel_loader.machine import Machine, detect_machine


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


def test_machine_describe_and_json():
    m = Machine("2.8", True, "cuda", "12.8", "x86_64", "linux", (9, 0), None, "H100")
    text = m.describe()
    assert "torch 2.8" in text and "cuda 12.8" in text and "9.0" in text and "x86_64-linux" in text
    assert m.to_json()["gpu_capability"] == [9, 0]
    assert m.with_backend("cpu").gpu_capability is None
