from dataclasses import replace

import pytest

from kernel_loader.machine import Machine
from kernel_loader.variants import arch_rejection, parse_variant, rank_variants, select_variant

H100 = Machine("2.8", True, "cuda", "12.8", "x86_64", "linux", (9, 0), None, "H100")
T4 = replace(H100, gpu_capability=(7, 5), gpu_name="T4")
CPU = Machine("2.8", True, "cpu", None, "x86_64", "linux")
MAC = Machine("2.8", None, "metal", None, "aarch64", "darwin")
ROCM = Machine("2.8", True, "rocm", "6.4", "x86_64", "linux", None, "gfx942")

NAMES = [
    "torch28-cxx11-cu126-x86_64-linux",
    "torch28-cxx11-cu128-x86_64-linux",
    "torch28-cxx11-cu129-x86_64-linux",
    "torch27-cxx11-cu128-x86_64-linux",
    "torch28-cxx98-cu128-x86_64-linux",
    "torch28-cxx11-cu128-aarch64-linux",
    "torch28-cxx11-cu118-x86_64-linux",
    "torch28-cxx11-rocm64-x86_64-linux",
    "torch28-metal-aarch64-darwin",
    "torch28-cxx11-cpu-x86_64-linux",
    "torch-stable-abi27-cu128-x86_64-linux",
    "torch-stable-abi29-cu128-x86_64-linux",
    "torch-universal",
    "torch-cuda",
    "torch-cpu",
    "something-new",
]


def test_parse_variant_fields():
    v = parse_variant("torch28-cxx11-cu128-x86_64-linux")
    assert (v.kind, v.torch_version, v.cxx11_abi, v.backend, v.backend_version, v.cpu_arch, v.os) == (
        "torch", "2.8", True, "cuda", "12.8", "x86_64", "linux")
    assert parse_variant("torch210-cu130-x86_64-windows").torch_version == "2.10"
    assert parse_variant("torch210-cu130-x86_64-windows").backend_version == "13.0"
    assert parse_variant("torch-stable-abi210-cu128-aarch64-linux").kind == "stable-abi"
    assert parse_variant("torch28-cxx11-rocm64-x86_64-linux").backend_version == "6.4"
    assert parse_variant("torch28-xpu20251-x86_64-linux").backend_version == "2025.1"
    assert parse_variant("torch-universal").kind == "noarch"
    assert parse_variant("torch-fpga").kind == "unknown"
    assert parse_variant("torch28-cxx11-tpu-x86_64-linux").kind == "unknown"


def _by_name(decisions):
    return {d.variant: d for d in decisions}


def test_ranking_on_cuda_machine():
    decisions = rank_variants(NAMES, H100)
    accepted = [d.variant for d in decisions if d.accepted]
    assert accepted == [
        "torch-stable-abi27-cu128-x86_64-linux",
        "torch28-cxx11-cu128-x86_64-linux",
        "torch28-cxx11-cu126-x86_64-linux",
        "torch-cuda",
        "torch-universal",
    ]
    assert [d.rank for d in decisions if d.accepted] == [0, 1, 2, 3, 4]
    by = _by_name(decisions)
    assert "CUDA 12.9" in by["torch28-cxx11-cu129-x86_64-linux"].reason
    assert "torch 2.7" in by["torch27-cxx11-cu128-x86_64-linux"].reason
    assert "ABI" in by["torch28-cxx98-cu128-x86_64-linux"].reason
    assert "aarch64" in by["torch28-cxx11-cu128-aarch64-linux"].reason
    assert "same major" in by["torch28-cxx11-cu118-x86_64-linux"].reason
    assert "torch >= 2.9" in by["torch-stable-abi29-cu128-x86_64-linux"].reason
    assert "unrecognised" in by["something-new"].reason
    assert all(d.rank is None for d in decisions if not d.accepted)


def test_ranking_on_cpu_rocm_and_mac():
    cpu = [d.variant for d in rank_variants(NAMES, CPU) if d.accepted]
    assert cpu == ["torch28-cxx11-cpu-x86_64-linux", "torch-cpu", "torch-universal"]
    rocm = [d.variant for d in rank_variants(NAMES, ROCM) if d.accepted]
    assert rocm == ["torch28-cxx11-rocm64-x86_64-linux", "torch-universal"]
    mac = [d.variant for d in rank_variants(NAMES, MAC) if d.accepted]
    assert mac == ["torch28-metal-aarch64-darwin", "torch-universal"]


def test_backend_restriction():
    accepted = [d.variant for d in rank_variants(NAMES, H100, backend="cpu") if d.accepted]
    assert accepted == ["torch28-cxx11-cpu-x86_64-linux", "torch-cpu", "torch-universal"]
    with pytest.raises(ValueError, match="not available"):
        rank_variants(NAMES, CPU, backend="cuda")


def test_no_torch_only_noarch():
    machine = Machine(None, None, "cpu", None, "x86_64", "linux")
    accepted = [d.variant for d in rank_variants(NAMES, machine) if d.accepted]
    assert accepted == ["torch-cpu", "torch-universal"]


@pytest.mark.parametrize(
    "archs, capability, ok",
    [
        (["8.0+PTX"], (9, 0), True),
        (["8.0+PTX"], (7, 5), False),
        (["8.0"], (8, 6), True),
        (["8.0"], (9, 0), False),
        (["9.0a"], (9, 0), True),
        (["9.0a"], (10, 0), False),
        (["10.0f"], (10, 3), True),
        (["10.0f"], (12, 0), False),
        (["7.5", "8.0", "9.0"], (9, 0), True),
        (["sm_new"], (9, 0), True),  # unreadable: cannot judge, let it through
    ],
)
def test_arch_rejection_cuda(archs, capability, ok):
    machine = replace(H100, gpu_capability=capability)
    reason = arch_rejection({"backend": {"type": "cuda", "archs": archs}}, machine)
    assert (reason is None) == ok
    if not ok:
        assert f"{capability[0]}.{capability[1]}" in reason and archs[0] in reason


def test_arch_rejection_other_cases():
    assert arch_rejection(None, T4) is None
    assert arch_rejection({"backend": {"type": "universal", "archs": ["8.0+PTX"]}}, CPU) is None  # no GPU
    assert "gfx942" in arch_rejection({"backend": {"type": "rocm", "archs": ["gfx90a"]}}, ROCM)
    assert arch_rejection({"backend": {"type": "rocm", "archs": ["gfx942"]}}, ROCM) is None


def test_select_variant_skips_arch_mismatch_before_import():
    names = ["torch28-cxx11-cu128-x86_64-linux", "torch-universal"]
    meta = {
        "torch28-cxx11-cu128-x86_64-linux": {"backend": {"type": "cuda", "archs": ["9.0a"]}},
        "torch-universal": {"backend": {"type": "universal"}},
    }
    asked = []

    def read(v):
        asked.append(v)
        return meta[v]

    chosen, decisions = select_variant(names, T4, read)
    assert chosen == "torch-universal"
    assert asked == names  # metadata read best-first, stopping at the first that fits
    rejected = _by_name(decisions)["torch28-cxx11-cu128-x86_64-linux"]
    assert not rejected.accepted and "capability 7.5" in rejected.reason
    assert _by_name(decisions)["torch-universal"].rank == 0

    chosen, _ = select_variant(names, H100, read)
    assert chosen == "torch28-cxx11-cu128-x86_64-linux"


def test_select_variant_nothing_fits():
    chosen, decisions = select_variant(["torch27-cxx11-cu128-x86_64-linux"], H100, None)
    assert chosen is None and len(decisions) == 1 and not decisions[0].accepted
