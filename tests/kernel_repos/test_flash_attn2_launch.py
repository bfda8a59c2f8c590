"""The Launcher of the shipped flash-attn2 repo: cached launches must pick the kernel Triton would.

There is no GPU here, so Triton's side is played by a small stand-in with the same interface
(``kernel[grid](...)`` returns a compiled kernel with ``run``/``function``/``packed_metadata``,
``warmup`` returns Triton's choice). The GPU check script runs the real thing in check mode
(bench/host_overhead.py). The specialisation rules themselves are compared with Triton's own.
"""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

from flash_ref import load_flash_attn2

fa = load_flash_attn2()
launch = importlib.import_module(fa.__name__ + "._launch")


def test_integer_classes_never_mix_two_of_tritons_specialisations():
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    values = [0, 1, 2, 15, 16, 17, 31, 32, 48, -1, -16, -17, 2**31 - 1, 2**31, 2**31 + 16, 2**40 + 3,
              2**63, 2**63 + 16]
    seen: dict = {}
    for v in values:
        theirs = native_specialize_impl(BaseBackend, v, False, True, True)
        ours = launch.int_spec(v)
        assert seen.setdefault(ours, theirs) == theirs, (v, ours, theirs)


def test_width_classes_of_unspecialised_integers_match_triton():
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    seen: dict = {}
    for v in [0, 1, 2, 16, 17, -1, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**40, 2**63, 2**64 - 1]:
        theirs = native_specialize_impl(BaseBackend, v, False, False, True)  # do_not_specialize
        ours = launch.int_spec(v) & 6
        assert seen.setdefault(ours, theirs) == theirs, (v, ours, theirs)


class _Compiled:
    def __init__(self, tag):
        self.tag = tag
        self.function = f"function-{tag}"
        self.packed_metadata = ("meta", tag)
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class _FakeJit:
    """Plays Triton: one compiled kernel per (alignment of X, n mod 16, n == 1, constants)."""

    arg_names = ["X", "n", "scale", "BLOCK"]
    constexprs = [3]

    def __init__(self):
        self.compiled = {}
        self.slow_calls = 0

    def _pick(self, args, kwargs):
        x, n, _scale = args
        key = (x.data_ptr() % 16 == 0, n % 16 == 0, n == 1, kwargs["BLOCK"], kwargs["num_warps"])
        return self.compiled.setdefault(key, _Compiled(key))

    def __getitem__(self, grid):
        def runner(*args, **kwargs):
            self.slow_calls += 1
            return self._pick(args, kwargs)
        return runner

    def warmup(self, *args, grid, **kwargs):
        return self._pick(args, kwargs)


@pytest.fixture
def fake_driver(monkeypatch):
    driver_module = sys.modules["triton.runtime.driver"]
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 1234)
    monkeypatch.setattr(driver_module, "driver", SimpleNamespace(active=active))


def _launcher(jit):
    launcher = launch.Launcher(jit)
    launcher._fast = True  # conftest sets TRITON_INTERPRET=1, which turns the cached path off
    return launcher


def test_second_launch_skips_triton_and_passes_every_argument(fake_driver):
    jit = _FakeJit()
    launcher = _launcher(jit)
    x = torch.zeros(64)
    launcher((2, 1, 1), (x, 32, 0.5), (16,), 4, 2)
    launcher((3, 1, 1), (x, 48, 0.25), (16,), 4, 2)
    assert jit.slow_calls == 1
    (compiled,) = jit.compiled.values()
    assert compiled.runs == [(3, 1, 1, 1234, compiled.function, compiled.packed_metadata, None, None, None,
                              x, 48, 0.25, 16)]


def test_a_new_specialisation_goes_back_to_triton(fake_driver):
    jit = _FakeJit()
    launcher = _launcher(jit)
    x = torch.zeros(64)
    launcher((1, 1, 1), (x, 32, 1.0), (16,), 4, 2)
    launcher((1, 1, 1), (x[1:], 32, 1.0), (16,), 4, 2)  # misaligned pointer
    launcher((1, 1, 1), (x, 33, 1.0), (16,), 4, 2)  # n no longer a multiple of 16
    launcher((1, 1, 1), (x, 1, 1.0), (16,), 4, 2)  # n == 1
    launcher((1, 1, 1), (x, 32, 1.0), (32,), 4, 2)  # another constant
    launcher((1, 1, 1), (x, 32, 1.0), (16,), 8, 2)  # other launch options
    assert jit.slow_calls == 6
    launcher((1, 1, 1), (x[1:], 64 + 32, 2.0), (16,), 4, 2)  # same classes as the second call
    assert jit.slow_calls == 6 and launcher.cached == 6


class _FakeJitUnspecialised(_FakeJit):
    """Plays Triton for a kernel with ``do_not_specialize=["n"]``: n is keyed on its width alone."""

    do_not_specialize = ["n"]

    def _pick(self, args, kwargs):
        x, n, _scale = args
        key = (x.data_ptr() % 16 == 0, -(2**31) <= n < 2**31, kwargs["BLOCK"], kwargs["num_warps"])
        return self.compiled.setdefault(key, _Compiled(key))


def test_unspecialised_integers_reuse_one_kernel_until_their_width_changes(fake_driver):
    jit = _FakeJitUnspecialised()
    launcher = _launcher(jit)
    x = torch.zeros(64)
    for n in (32, 33, 1, 7, 2**31 - 1):  # residues and 1 do not matter to Triton here
        launcher((1, 1, 1), (x, n, 1.0), (16,), 4, 2)
    assert jit.slow_calls == 1 and launcher.cached == 1
    launcher((1, 1, 1), (x, 2**31, 1.0), (16,), 4, 2)  # 64-bit: another kernel
    launcher((1, 1, 1), (x, 2**31 + 1, 1.0), (16,), 4, 2)
    assert jit.slow_calls == 2 and launcher.cached == 2
    (first, wide) = jit.compiled.values()
    assert [r[10] for r in first.runs] == [33, 1, 7, 2**31 - 1] and [r[10] for r in wide.runs] == [2**31 + 1]


def test_launch_hooks_take_tritons_path(fake_driver, monkeypatch):
    jit = _FakeJit()
    launcher = _launcher(jit)
    x = torch.zeros(64)
    launcher((1, 1, 1), (x, 32, 1.0), (16,), 4, 2)
    monkeypatch.setattr(launch, "_hooks_active", lambda: True)
    launcher((1, 1, 1), (x, 32, 1.0), (16,), 4, 2)
    assert jit.slow_calls == 2


def test_check_mode_raises_when_the_cache_disagrees_with_triton(fake_driver):
    jit = _FakeJit()
    launcher = _launcher(jit)
    launcher._check = True
    x = torch.zeros(64)
    launcher((1, 1, 1), (x, 32, 1.0), (16,), 4, 2)
    launcher((1, 1, 1), (x, 32, 1.0), (16,), 4, 2)  # agrees: fine
    jit.compiled.clear()  # Triton would now hand out a different kernel
    with pytest.raises(RuntimeError, match="another compiled kernel"):
        launcher((1, 1, 1), (x, 32, 1.0), (16,), 4, 2)


def test_constexpr_parameters_must_come_last_and_be_complete():
    class Bad(_FakeJit):
        arg_names = ["X", "BLOCK", "n"]
        constexprs = [1]

    with pytest.raises(ValueError, match="must come last"):
        launch.Launcher(Bad())
    with pytest.raises(ValueError, match="constexpr values"):
        launch.Launcher(_FakeJit())((1, 1, 1), (torch.zeros(4), 3, 1.0), (), 4, 2)


class _FakeJitOptional(_FakeJit):
    """A kernel with an optional pointer Y: None compiles as a constant, a tensor as a pointer."""

    arg_names = ["X", "Y", "n", "scale", "BLOCK"]
    constexprs = [4]

    def _pick(self, args, kwargs):
        x, y, n, _scale = args
        key = (x.data_ptr() % 16 == 0, y is None, n % 16 == 0, n == 1, kwargs["BLOCK"], kwargs["num_warps"])
        return self.compiled.setdefault(key, _Compiled(key))


def test_an_absent_pointer_is_part_of_the_key(fake_driver):
    jit = _FakeJitOptional()
    launcher = _launcher(jit)
    x, y = torch.zeros(64), torch.zeros(8)
    launcher((1, 1, 1), (x, None, 32, 1.0), (16,), 4, 2)
    launcher((1, 1, 1), (x, None, 48, 1.0), (16,), 4, 2)
    assert jit.slow_calls == 1
    launcher((1, 1, 1), (x, y, 32, 1.0), (16,), 4, 2)
    assert jit.slow_calls == 2
    launcher((1, 1, 1), (x, y, 64, 1.0), (16,), 4, 2)
    assert jit.slow_calls == 2 and launcher.cached == 2


def test_each_device_gets_its_own_cached_kernel(monkeypatch):
    """A compiled kernel's function handle belongs to one GPU: another current device goes back
    to Triton, which loads the kernel there."""
    driver_module = sys.modules["triton.runtime.driver"]
    current = {"device": 0}
    active = SimpleNamespace(get_current_device=lambda: current["device"], get_current_stream=lambda device: 7)
    monkeypatch.setattr(driver_module, "driver", SimpleNamespace(active=active))
    jit = _FakeJit()
    launcher = _launcher(jit)
    x = torch.zeros(64)
    launcher((1, 1, 1), (x, 32, 1.0), (16,), 4, 2)
    launcher((1, 1, 1), (x, 32, 1.0), (16,), 4, 2)
    assert jit.slow_calls == 1
    current["device"] = 1
    launcher((1, 1, 1), (x, 32, 1.0), (16,), 4, 2)
    assert jit.slow_calls == 2 and launcher.cached == 2
