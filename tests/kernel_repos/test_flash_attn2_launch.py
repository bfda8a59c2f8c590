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


# --- Alignment decisions on real launches -------------------------------------------------
# A cached launch reuses a kernel compiled for other arguments; it is right only when Triton
# would have specialised both calls alike (16-byte-aligned pointers, multiples of 16, 1s), else a
# kernel compiled with vector loads could meet a pointer they do not fit ("misaligned address").
# The interpreter does not fault, so the decision itself is checked: the launches of packed
# views (kv / qkv packed: k and v start H*D elements in), odd head dims and storage offsets,
# recorded through the public functions, keyed as the Launcher keys them, must never put two
# launches Triton tells apart under one key. The decode kernel's own ALIGNED flag (strides
# passed divided by 16) must only be set when every stride it divides is a multiple of 16.

import itertools as _it  # noqa: E402

from launch_record import launcher_key, recording, triton_specialisation  # noqa: E402


def _packed(shape, offset):
    """An fp16 tensor of ``shape`` in a buffer starting ``offset`` elements in."""
    n = 1
    for s in shape:
        n *= s
    return torch.empty(offset + n, dtype=torch.float16).narrow(0, offset, n).view(shape)


def _cu(lengths):
    return torch.tensor([0] + list(_it.accumulate(lengths)), dtype=torch.int32)


def _calls(d, offset):
    """The public calls a training step and a decode step make on packed views of head dim d."""
    lens = [7, 12]
    grad = lambda shape: _packed(shape, offset).requires_grad_()  # noqa: E731
    yield "qkvpacked", lambda: fa.flash_attn_qkvpacked_func(grad((2, 19, 3, 3, d)), causal=True)
    yield "kvpacked-gqa", lambda: fa.flash_attn_kvpacked_func(grad((2, 19, 4, d)), grad((2, 23, 2, 2, d)),
                                                              softcap=5.0, window_size=(4, 3))
    yield "varlen-qkvpacked", lambda: fa.flash_attn_varlen_qkvpacked_func(grad((sum(lens), 3, 3, d)), _cu(lens), 12,
                                                                          causal=True)
    yield "varlen-kvpacked", lambda: fa.flash_attn_varlen_kvpacked_func(
        grad((sum(lens), 4, d)), grad((sum(lens), 2, 4, d)), _cu(lens), _cu(lens), 12, 12, causal=True,
        dropout_p=0.2, alibi_slopes=torch.rand(2, 4))
    k_dec, v_dec = _packed((2, 40, 2, 2, d), offset).unbind(2)
    yield "decode-kvpacked", lambda: fa.flash_attn_func(_packed((2, 1, 4, d), offset), k_dec, v_dec, causal=True)
    # v alone with heads d + 8 elements apart: only its head stride is not a multiple of 16
    v_odd = _packed((2, 40, 2 * d + 16), offset).as_strided((2, 40, 2, d), (40 * (2 * d + 16), 2 * d + 16, d + 8, 1))
    yield "decode-v-strided", lambda: fa.flash_attn_func(_packed((2, 3, 4, d), offset), _packed((2, 40, 2, d), 0), v_odd)


def _run(call):
    out = call()
    if out.requires_grad:
        out.backward(torch.ones_like(out))


HEAD_DIMS_AND_OFFSETS = [(d, off) for d in (5, 59, 64, 80, 111) for off in (0, 8, 3)]


def test_no_launcher_key_covers_two_of_tritons_specialisations(monkeypatch):
    launches = []
    with recording(fa, monkeypatch) as rec:
        for d, offset in HEAD_DIMS_AND_OFFSETS:
            for _name, call in _calls(d, offset):
                _run(call)
        launches = [r for r in rec if r.grid is not None]
    by_key: dict = {}
    for r in launches:
        by_key.setdefault(launcher_key(r), []).append(r)
    shared = 0
    for key, group in by_key.items():
        specs = {triton_specialisation(r) for r in group}
        assert len(specs) == 1, (key, specs)
        shared += len({tuple(a.data_ptr() for a in r.args if isinstance(a, torch.Tensor)) for r in group}) > 1
    # the walk is not vacuous: views 8 elements in (16 bytes) share their kernel with views at 0,
    # views 3 elements in (6 bytes) do not
    assert shared > 0
    names = {r.name for r in launches}
    assert {"_fwd_kernel", "_delta_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_split_kernel"} <= names


def test_the_decode_kernel_claims_aligned_strides_only_when_they_are(monkeypatch):
    decisions = []
    with recording(fa, monkeypatch) as rec:
        for d, offset in HEAD_DIMS_AND_OFFSETS:
            for name, call in _calls(d, offset):
                if name.startswith("decode"):
                    _run(call)
        for r in rec:
            if r.name != "_split_kernel":
                continue
            names = r.launcher._fn.arg_names
            arg = lambda name: r.args[names.index(name)]  # noqa: E731
            aligned = r.constexprs[r.launcher._constexpr_names.index("ALIGNED")]
            q, k, v = arg("Q"), arg("K"), arg("V")
            head_dim = arg("head_dim")
            unit = 16 if aligned else 1
            # what the kernel will multiply back: every row stride it was given, and head_dim
            strides = [arg(f"stride_{t}{a}") * unit for t in "qkv" for a in ("b", "s", "h")]
            real = [s for t in (q, k, v) for s in t.stride()[:3]]
            decisions.append(aligned)
            for given, true in zip(strides, real):
                assert given in (0, true), (given, true)  # 0: a stride of a length-1 axis, never used
            if aligned:
                assert all(s % 16 == 0 for s in strides) and (head_dim * 16) % 16 == 0
                assert head_dim * 16 == q.shape[-1]
    assert True in decisions and False in decisions


def test_a_kept_launch_repeats_a_call_without_working_its_key_out(fake_driver, monkeypatch):
    """Launcher.keep hands back the launch a call took; launch_kept repeats it for new arguments
    of the same key (new addresses and integer values) with the kept constants and options."""
    jit = _FakeJitUnspecialised()
    launcher = _launcher(jit)
    x, y = torch.zeros(64), torch.zeros(64)
    launcher((1, 1, 1), (x, 32, 1.0), (16,), 4, 2)
    kept = launcher.keep((x, 32, 1.0), (16,), 4, 2)
    assert kept is not None
    keys = []
    monkeypatch.setattr(launcher, "_key", lambda *a: keys.append(a))
    assert launcher.launch_kept(kept, (5, 1, 1), (y, 77, 0.5)) is True
    assert keys == [] and jit.slow_calls == 1
    (compiled,) = jit.compiled.values()
    assert compiled.runs[-1] == (5, 1, 1, 1234, compiled.function, compiled.packed_metadata, None, None, None,
                                 y, 77, 0.5, 16)


def test_only_launches_whose_key_a_caller_can_vouch_for_are_kept(fake_driver, monkeypatch):
    x = torch.zeros(64)
    specialised = _launcher(_FakeJit())  # n keyed on its residue: not kept
    specialised((1, 1, 1), (x, 32, 1.0), (16,), 4, 2)
    assert specialised.keep((x, 32, 1.0), (16,), 4, 2) is None
    launcher = _launcher(_FakeJitUnspecialised())
    assert launcher.keep((x, 32, 1.0), (16,), 4, 2) is None  # nothing launched yet
    launcher((1, 1, 1), (x[1:], 32, 1.0), (16,), 4, 2)
    assert launcher.keep((x[1:], 32, 1.0), (16,), 4, 2) is None  # a pointer not 16-byte aligned
    launcher((1, 1, 1), (x, 2**31, 1.0), (16,), 4, 2)
    assert launcher.keep((x, 2**31, 1.0), (16,), 4, 2) is None  # a 64-bit integer
    launcher((1, 1, 1), (x, 32, 1.0), (16,), 4, 2)
    monkeypatch.setattr(launch, "_hooks_active", lambda: True)
    assert launcher.keep((x, 32, 1.0), (16,), 4, 2) is None  # a profiler wants to see launches


def test_a_kept_launch_steps_aside_for_another_device_or_a_hook_and_is_checked_in_check_mode(
        fake_driver, monkeypatch):
    jit = _FakeJitUnspecialised()
    launcher = _launcher(jit)
    x = torch.zeros(64)
    launcher((1, 1, 1), (x, 32, 1.0), (16,), 4, 2)
    kept = launcher.keep((x, 32, 1.0), (16,), 4, 2)
    (compiled,) = jit.compiled.values()
    runs = len(compiled.runs)
    monkeypatch.setattr(launcher, "_get_device", lambda: 1)
    assert launcher.launch_kept(kept, (1, 1, 1), (x, 32, 1.0)) is False
    monkeypatch.setattr(launcher, "_get_device", lambda: 0)
    monkeypatch.setattr(launch, "_hooks_active", lambda: True)
    assert launcher.launch_kept(kept, (1, 1, 1), (x, 32, 1.0)) is False
    assert len(compiled.runs) == runs  # neither launched anything
    monkeypatch.setattr(launch, "_hooks_active", lambda: False)
    launcher._check = True
    assert launcher.launch_kept(kept, (1, 1, 1), (x, 48, 1.0)) is True  # the same key: checked, launched
    with pytest.raises(RuntimeError, match="kept launch"):
        launcher.launch_kept(kept, (1, 1, 1), (x[1:], 32, 1.0))  # a caller that vouched wrongly
