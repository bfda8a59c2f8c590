"""DirectLaunch: the cached launch path calling Triton 3.6's C launch function itself, without the
Python wrapper that re-encodes every TMA descriptor on every launch.

The Triton installed here is another release (whose launcher takes other arguments, so the
direct path stays off for it). Triton 3.6's side is played by a stand-in laid out as that
release's launcher is: a ``CudaLauncher`` whose ``launch`` is the wrapper closure over the C
function, the descriptor slots and their metadata, with ``make_tensordesc_arg`` and the TMA
element-type table in the wrapper's module (this one). Against the real Triton 3.6 the argument
lists were compared without a GPU, the C function and the encode recorded (bench/NOTES.md).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import triton37_launcher as t37
from flash_ref import load_flash_attn2

fa = load_flash_attn2()
launch = importlib.import_module(fa.__name__ + "._launch")

# What Triton 3.6's driver module holds (values as in its source: the device and host numbering
# of TMA element types differ for 8, 9 and 10)
TMA_DTYPE_DEVICE_TO_HOST = {i: i for i in range(16)}
TMA_DTYPE_DEVICE_TO_HOST.update({8: 10, 9: 8, 10: 9})


def make_tensordesc_arg(arg, metadata):
    """Triton 3.6's expansion of one host descriptor: the encoded map, then shape and strides."""
    tmap = sys.modules["triton.runtime.driver"].driver.active.utils.fill_tma_descriptor(
        arg.base.data_ptr(), metadata["swizzle"], metadata["elem_size"],
        TMA_DTYPE_DEVICE_TO_HOST[metadata["elem_type"]], metadata["block_size"], arg.shape, arg.strides,
        1 if arg.padding == "nan" else 0)
    return [tmap, *arg.shape, *arg.strides]


def _wrapper(launcher, tensordesc_indices, tensordesc_meta):
    """Triton 3.6's wrapper around the C launch function (the closure DirectLaunch reads)."""
    def inner(*args):
        final = list(args[:13])
        slot = 0
        for i, arg in enumerate(args[13:]):
            if i in tensordesc_indices:
                final.extend(make_tensordesc_arg(arg, tensordesc_meta[slot]))
                slot += 1
            else:
                final.append(arg)
        return launcher(*final)

    inner.__module__ = __name__
    return inner


class CudaLauncher:
    """Triton 3.6's launcher object: the attributes DirectLaunch reads, and its own call."""

    def __init__(self, c_launch, indices=(), metas=None, scratch=0):
        self.launch = _wrapper(c_launch, set(indices), metas) if indices else c_launch
        self.num_ctas = 1
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = False
        self.launch_pdl = False

    def __call__(self, gx, gy, gz, stream, function, *args):
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None, *args)


class CLaunch:
    """The compiled C launch function: records each call (an object with no ``__code__``, as a
    C function has none)."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(list(args))


META = dict(swizzle=3, elem_size=2, elem_type=9, block_size=[1, 64, 1, 128], fp4_padded=False)


def _descriptor(t, block=(1, 64, 1, 128)):
    return SimpleNamespace(base=t, shape=list(t.shape), strides=list(t.stride()), block_shape=list(block),
                           padding="zero")


def _release(monkeypatch, release, fill_name):
    """Play Triton ``release`` for DirectLaunch: its release check passes, and the driver's map
    encode (``fill_name``) records its inputs and returns ("map", n); returns the records."""
    monkeypatch.setattr(launch, "_DIRECT_RELEASE", release)
    encoded = []

    def fill(*inputs):
        encoded.append(inputs)
        return ("map", len(encoded))

    driver_module = sys.modules["triton.runtime.driver"]
    monkeypatch.setattr(driver_module, "driver", SimpleNamespace(active=SimpleNamespace(
        utils=SimpleNamespace(**{fill_name: fill}),
        get_current_device=lambda: 0, get_current_stream=lambda device: 1234)))
    return encoded


@pytest.fixture
def triton36(monkeypatch):
    """Triton 3.6 for DirectLaunch (maps from ``fill_tma_descriptor``)."""
    return _release(monkeypatch, (3, 6), "fill_tma_descriptor")


def _q(seed=0):
    torch.manual_seed(seed)
    return torch.randn(2, 128, 4, 128).to(torch.bfloat16)


def test_the_argument_list_is_tritons_and_each_map_is_encoded_once_per_address(triton36):
    c_launch = CLaunch()
    runner = CudaLauncher(c_launch, indices=(0, 2), metas=[META, dict(META, swizzle=2)])
    direct = launch.DirectLaunch.of(SimpleNamespace(run=runner))
    q, k = _q(0), _q(1)
    args = (_descriptor(q), 5, _descriptor(k), None, 1.5, True)  # the last: a constexpr's value
    runner(4, 2, 1, 1234, "function", "metadata", None, None, None, *args)  # Triton's own path
    direct((4, 2, 1), 1234, "function", "metadata", args)
    direct((4, 2, 1), 1234, "function", "metadata", (_descriptor(q), 5, _descriptor(k), None, 1.5, True))
    theirs, ours, again = c_launch.calls
    assert ours == again  # the second launch reused the maps...
    assert len(triton36) == 4  # ...which Triton encoded twice and the direct path once
    head = [4, 2, 1, 1234, "function", False, False, None, None, "metadata", None, None, None]
    assert theirs[:13] == ours[:13] == head
    # after the head, Triton's expansion: map, shape, strides per descriptor, the rest as given
    assert theirs[13:] == [("map", 1), *q.shape, *q.stride(), 5, ("map", 2), *k.shape, *k.stride(), None, 1.5, True]
    assert ours[13:] == [("map", 3), *q.shape, *q.stride(), 5, ("map", 4), *k.shape, *k.stride(), None, 1.5, True]
    assert triton36[0] == triton36[2] and triton36[1] == triton36[3]  # the same encodes
    # a tensor at another address gets its own map
    direct((4, 2, 1), 1234, "function", "metadata", (_descriptor(q.clone()), 5, _descriptor(k), None, 1.5, True))
    assert len(triton36) == 5 and c_launch.calls[-1][13] == ("map", 5)


def test_kernels_without_descriptors_call_the_c_function_with_their_arguments(triton36):
    c_launch = CLaunch()
    direct = launch.DirectLaunch.of(SimpleNamespace(run=CudaLauncher(c_launch)))
    x = torch.zeros(8)
    direct((3, 1, 1), 7, "function", "metadata", (x, 32, 0.5, 16))
    assert c_launch.calls == [[3, 1, 1, 7, "function", False, False, None, None, "metadata", None, None, None,
                               x, 32, 0.5, 16]]


def test_verify_raises_when_the_list_differs_from_tritons(triton36, monkeypatch):
    c_launch = CLaunch()
    compiled = SimpleNamespace(run=CudaLauncher(c_launch, indices=(0,), metas=[META]))
    direct = launch.DirectLaunch.of(compiled)
    args = (_descriptor(_q()), 7, True)
    direct.verify(args)  # the same list: nothing raised, nothing launched, no map cached
    assert c_launch.calls == [] and direct._maps == {}
    real = make_tensordesc_arg  # a Triton whose expansion encodes otherwise
    monkeypatch.setattr(sys.modules[__name__], "make_tensordesc_arg",
                        lambda arg, metadata: real(arg, dict(metadata, swizzle=0)))
    with pytest.raises(RuntimeError, match="differs from Triton's"):
        launch.DirectLaunch.of(compiled).verify(args)


@pytest.mark.parametrize("change", ["scratch", "wrapper", "fp4", "class"])
def test_launchers_laid_out_otherwise_keep_tritons_path(triton36, change):
    runner = CudaLauncher(CLaunch(), indices=(0,), metas=[dict(META, fp4_padded=change == "fp4")],
                          scratch=64 if change == "scratch" else 0)
    if change == "wrapper":
        runner.launch = lambda *args: None  # a closure over other names
    if change == "class":
        runner = SimpleNamespace(**vars(runner))
    assert launch.DirectLaunch.of(SimpleNamespace(run=runner)) is None


def test_only_the_triton_releases_it_was_checked_against_take_it(monkeypatch):
    import triton

    runner = CudaLauncher(CLaunch())
    monkeypatch.setattr(launch, "_DIRECT_RELEASE", None)
    monkeypatch.setattr(launch, "DIRECT_TRITON", frozenset({(3, 6)}))
    on_36 = triton.__version__.startswith("3.6.")
    assert (launch.DirectLaunch.of(SimpleNamespace(run=runner)) is not None) == on_36
    assert launch.DIRECT_TRITON == {(3, 6)}  # restored below by monkeypatch; the shipped set:
    monkeypatch.undo()
    assert launch.DIRECT_TRITON == {(3, 6), (3, 7)}


# Triton 3.7: one C launch function for every kernel, the kernel's arguments as one list last
@pytest.fixture
def triton37(monkeypatch):
    """Triton 3.7 for DirectLaunch (maps from ``fill_tma_descriptor_tiled``)."""
    return _release(monkeypatch, (3, 7), "fill_tma_descriptor_tiled")


def _descriptor37(t, tf32=False):
    return SimpleNamespace(**vars(_descriptor(t)), round_f32_to_tf32=tf32)


HEAD37 = [4, 2, 1, 1234, "function", False, False, "metadata", None, None, None, None, None, ("annotations",),
          "signature handle"]


def test_triton37_gets_the_list_its_own_wrapper_builds_with_each_map_encoded_once(triton37):
    c_launch = CLaunch()
    runner = t37.CudaLauncher(c_launch, indices=(0, 2), metas=[META, dict(META, swizzle=2)])
    direct = launch.DirectLaunch.of(SimpleNamespace(run=runner))
    assert type(direct) is launch.DirectLaunchList
    q, k = _q(0), _q(1)
    args = (_descriptor37(q), 5, _descriptor37(k), None, 1.5, True)
    runner(4, 2, 1, 1234, "function", "metadata", None, None, None, *args)  # Triton's own path
    direct((4, 2, 1), 1234, "function", "metadata", args)
    direct((4, 2, 1), 1234, "function", "metadata", args)
    theirs, ours, again = c_launch.calls
    assert theirs[:15] == ours[:15] == HEAD37 and len(theirs) == len(ours) == 16
    assert theirs[15] == [("map", 1), *q.shape, *q.stride(), 5, ("map", 2), *k.shape, *k.stride(), None, 1.5, True]
    assert ours[15] == [("map", 3), *q.shape, *q.stride(), 5, ("map", 4), *k.shape, *k.stride(), None, 1.5, True]
    assert ours == again and len(triton37) == 4  # the second direct launch reused the maps
    assert triton37[0] == triton37[2] and triton37[1] == triton37[3]  # the same encodes as Triton's
    direct.verify(args)


def test_triton37_rounds_to_tf32_in_the_map_and_keys_the_map_on_it(triton37):
    c_launch = CLaunch()
    runner = t37.CudaLauncher(c_launch, indices=(0,), metas=[dict(META, elem_type=7, elem_size=4)])
    direct = launch.DirectLaunch.of(SimpleNamespace(run=runner))
    x = torch.zeros(2, 128, 4, 128)
    for tf32 in (False, True, False):
        direct((1, 1, 1), 1234, "function", "metadata", (_descriptor37(x, tf32), 3))
    runner(1, 1, 1, 1234, "function", "metadata", None, None, None, _descriptor37(x, True), 3)
    # two maps (rounded and not), not three; the rounded one as Triton encodes it (element type 11)
    assert [inputs[3] for inputs in triton37] == [7, 11, 11]
    assert triton37[1] == triton37[2]
    direct.verify((_descriptor37(x, True), 3))


def test_triton37_kernels_without_descriptors_pass_their_arguments_as_given(triton37):
    c_launch = CLaunch()
    runner = t37.CudaLauncher(c_launch)
    direct = launch.DirectLaunch.of(SimpleNamespace(run=runner))
    x = torch.zeros(8)
    runner(4, 2, 1, 1234, "function", "metadata", None, None, None, x, 32, 0.5, 16)
    direct((4, 2, 1), 1234, "function", "metadata", (x, 32, 0.5, 16))
    theirs, ours = c_launch.calls
    assert theirs == ours == HEAD37 + [(x, 32, 0.5, 16)]


@pytest.mark.parametrize("change", ["scratch", "no annotations", "wrapper", "fp4"])
def test_triton37_launchers_laid_out_otherwise_keep_tritons_path(triton37, change):
    runner = t37.CudaLauncher(CLaunch(), indices=(0,), metas=[dict(META, fp4_padded=change == "fp4")],
                              scratch=64 if change == "scratch" else 0)
    if change == "no annotations":  # a 3.6-shaped launcher under a 3.7 release check
        del runner.arg_annotations
    if change == "wrapper":
        runner.launch = lambda *args: None
    assert launch.DirectLaunch.of(SimpleNamespace(run=runner)) is None


def test_triton37_verify_raises_when_the_list_differs(triton37, monkeypatch):
    compiled = SimpleNamespace(run=t37.CudaLauncher(CLaunch(), indices=(0,), metas=[META]))
    args = (_descriptor37(_q()), 7, True)
    launch.DirectLaunch.of(compiled).verify(args)
    real = t37.make_tensordesc_arg
    monkeypatch.setattr(t37, "make_tensordesc_arg", lambda arg, metadata: real(arg, dict(metadata, swizzle=0)))
    with pytest.raises(RuntimeError, match="differs from Triton's"):
        launch.DirectLaunch.of(compiled).verify(args)


class _Compiled:
    def __init__(self, runner):
        self.run = runner
        self.function = "function"
        self.packed_metadata = "metadata"


class _FakeJit:
    """Plays Triton's JIT function: one compiled kernel, whose launcher is a Triton 3.6 one."""

    arg_names = ["X", "n", "BLOCK"]
    constexprs = [2]

    def __init__(self, c_launch):
        self.compiled = _Compiled(CudaLauncher(c_launch))
        self.slow_calls = 0

    def __getitem__(self, grid):
        def runner(*args, **kwargs):
            self.slow_calls += 1
            return self.compiled
        return runner


@pytest.mark.parametrize("direct", [True, False])
def test_the_cached_path_takes_the_direct_launch_when_the_switch_is_on(triton36, monkeypatch, direct):
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", direct)
    c_launch = CLaunch()
    jit = _FakeJit(c_launch)
    launcher = launch.Launcher(jit)
    launcher._fast = True  # conftest sets TRITON_INTERPRET=1, which turns the cached path off
    x = torch.zeros(64)
    launcher((2, 1, 1), (x, 32), (16,), 4, 2)  # the first launch: Triton's own (nothing recorded here)
    seen = []
    monkeypatch.setattr(CudaLauncher, "__call__", lambda self, *a: seen.append(a))
    launcher((3, 1, 1), (x, 48), (16,), 4, 2)
    assert jit.slow_calls == 1
    if direct:  # the C function, straight from the cached path
        assert seen == [] and c_launch.calls == [[3, 1, 1, 1234, "function", False, False, None, None, "metadata",
                                                  None, None, None, x, 48, 16]]
    else:  # through Triton's launcher object
        assert c_launch.calls == [] and seen == [(3, 1, 1, 1234, "function", "metadata", None, None, None, x, 48, 16)]


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False)])
def test_direct_launches_are_on_unless_the_environment_turns_them_off(value, on):
    # read once at import: a fresh process shows the default a user gets
    env = {k: v for k, v in os.environ.items() if k != "FLASH_ATTN2_DIRECT_LAUNCH"}
    if value is not None:
        env["FLASH_ATTN2_DIRECT_LAUNCH"] = value
    package = Path(importlib.import_module(fa.__name__).__file__).parent
    env["PYTHONPATH"] = os.pathsep.join([str(package.parent), env.get("PYTHONPATH", "")])
    probe = f"import importlib; print(importlib.import_module('{package.name}._launch').DIRECT_LAUNCH)"
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(on)
