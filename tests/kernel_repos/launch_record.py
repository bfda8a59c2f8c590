"""Recording the launches of the shipped kernel's entry points without running them, as a GPU of
a given capability would make them, and Triton's own specialisation of each (what a compiled
kernel is specialised on: pointer alignment, integer divisibility, constants).

No GPU and no compile: the launch arguments are built by the real host code on CPU tensors
(their strides and addresses are what matter), and Triton's specialiser runs on them.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Iterator, List, NamedTuple


class Launch(NamedTuple):
    launcher: object
    grid: tuple
    args: tuple
    constexprs: tuple
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return self.launcher._fn.__name__


def modules(fa) -> dict:
    """The package's modules a recording touches."""
    return {m: importlib.import_module(f"{fa.__name__}.{m}")
            for m in ("_launch", "_triton_fwd", "_triton_bwd", "_triton_decode", "_configs")}


@contextlib.contextmanager
def recording(fa, monkeypatch, capability=(9, 0)) -> Iterator[List[Launch]]:
    """Launches made inside the block (none runs), the forward and backward host code believing
    it is on a GPU of ``capability`` (decode keeps its CPU tiles); compiles started ahead (``_launch.compile_all``) are recorded as launches
    too, with grid None."""
    mods = modules(fa)
    out: List[Launch] = []

    def record(self, grid, args, constexprs, num_warps, num_stages):
        out.append(Launch(self, grid, args, constexprs, num_warps, num_stages))

    def compile_all(jobs, device=None):
        out.extend(Launch(j[0], None, *j[1:]) for j in jobs)
        return []

    monkeypatch.setattr(mods["_launch"].Launcher, "__call__", record)
    monkeypatch.setattr(mods["_launch"], "compile_all", compile_all)
    for m in ("_triton_fwd", "_triton_bwd"):
        monkeypatch.setattr(mods[m], "device_capability", lambda t: capability)
    yield out


def triton_specialisation(launch: Launch) -> tuple:
    """Triton's specialisation of ``launch``'s runtime arguments (per argument: type and 'D' for
    a 16-byte-aligned pointer / multiple-of-16 integer, or a constant), then the constexprs."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    fn = launch.launcher._fn
    plain = launch.launcher._unspecialised
    spec = tuple(native_specialize_impl(CUDABackend, a, False, i not in plain, True)
                 for i, a in enumerate(launch.args))
    return spec + tuple(launch.constexprs) + (launch.num_warps, launch.num_stages, fn.__name__)


def launcher_key(launch: Launch) -> tuple:
    """The key the Launcher's fast path would file ``launch`` under (positions learned from it)."""
    launcher = type(launch.launcher)(launch.launcher._fn)  # a fresh one: the shipped ones keep their state
    launcher._learn_positions(launch.args)
    return (launch.name, launcher._key(0, launch.args, launch.constexprs, launch.num_warps, launch.num_stages))
