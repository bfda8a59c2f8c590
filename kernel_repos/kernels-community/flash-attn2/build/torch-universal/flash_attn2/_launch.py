"""Launching the Triton kernels with as little host work per call as Triton allows.

Why: in eager decoding (one query token per layer) and in short training steps the host's cost
per call, not the GPU's, sets the pace. ``kernel[grid](...)`` rebuilds the argument
specialisation, a string cache key, the launch metadata and the hook chain on every call.
After the first launch of a specialisation this module keeps the compiled kernel and calls its
launcher directly.

Correctness rests on the cache key: it holds everything Triton specialises a compiled kernel on:
each pointer's dtype and 16-byte alignment, each integer's divisibility by 16, equality to 1 and
width (32/64 bit; the width alone for ``do_not_specialize`` integers, which is cheaper to key),
the compile-time constants and the launch options, so a launch never reuses a
kernel compiled under other assumptions. ``FLASH_ATTN2_LAUNCH_CHECK=1`` also asks Triton for its
own choice on every call and raises if the two ever differ (the GPU check script runs that way).

Calling convention (all our kernels follow it): runtime arguments first, in kernel order, with
each position always of one kind (pointer: a tensor or None; a host ``TensorDescriptor``; int;
float); then every
``tl.constexpr`` parameter. A None pointer is part of the key (Triton compiles it as a constant).
Under ``TRITON_INTERPRET=1``, with launch hooks installed (profilers), or on a Triton whose
compiled kernels lack the expected attributes, every call takes Triton's own path.

Direct launches (on by default; ``FLASH_ATTN2_DIRECT_LAUNCH=0`` turns them off; see
:class:`DirectLaunch`): on a Triton whose CUDA launcher has the layout of Triton 3.6's or 3.7's,
the cached path also skips Triton's Python wrapper around the C launch function, which
re-encodes every host TMA descriptor on every launch, and hands the C function its final
argument list with each descriptor's ``CUtensorMap`` encoded once per (address, shape, strides).
On other Triton releases the cached path calls Triton's launcher as before.

Compiling: a cold kernel compiles on its first launch (seconds). :func:`compile_all` compiles
several specialisations at once on a small thread pool (Triton's compiler releases the GIL for
most of its work: MLIR passes, LLVM, ptxas), so the backward's three kernels cost the slowest of
them rather than their sum, and can compile while the forward runs.
``FLASH_ATTN2_COMPILE_THREADS=0`` (set before the import) compiles on the calling thread instead.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import operator
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch

_I32_MIN, _I32_MAX, _U64_MIN = -(2**31), 2**31 - 1, 2**63
# Threads that compile kernels ahead of their launch (read once at import: see the docstring).
# Two: the backward's longest compile on one, its small kernels one after the other on the other
# (the Gluon backward's are done long before it), while the forward compiles on the calling
# thread. More threads take more of the GIL from that forward's Python front end and LLVM stage.
# Measured (bench/NOTES.md; each configuration a fresh process, in a fixed order that favours the
# later runs): on an H100 host four threads (first) 4.96 s against two (third) 3.91 s, on an H200
# host two (first) 4.76 s against four (third) 4.68 s for the first call.
COMPILE_THREADS = int(os.environ.get("FLASH_ATTN2_COMPILE_THREADS", "2"))


def int_spec(i: int) -> int:
    """The property code Triton specialises an integer argument on (see module docstring)."""
    if i == 1:
        return 8
    width = 0 if _I32_MIN <= i <= _I32_MAX else (2 if i < _U64_MIN else 4)
    return width | (i & 15 == 0)


def _is_descriptor(a: Any) -> bool:
    # triton.tools.tensor_descriptor.TensorDescriptor (a TMA descriptor built on the host)
    return type(a).__name__ == "TensorDescriptor" and hasattr(a, "block_shape")


def _slot_types(args: tuple) -> Tuple[type, ...]:
    # a pointer slot holds a tensor or None (an absent optional pointer, a Triton constant); a
    # descriptor slot a TensorDescriptor
    return tuple(bool if isinstance(a, bool) else type(a) if isinstance(a, (int, float))
                 else type(a) if _is_descriptor(a) else torch.Tensor for a in args)


def _getter(positions: Sequence[int]) -> Callable[[tuple], tuple]:
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        p = positions[0]
        return lambda args: (args[p],)
    return operator.itemgetter(*positions)


def _unspecialised_positions(fn: Any) -> frozenset:
    """Arguments the kernel marks ``do_not_specialize``: Triton keys them on their width alone."""
    names = list(fn.arg_names)
    return frozenset(names.index(x) if isinstance(x, str) else int(x)
                     for x in (getattr(fn, "do_not_specialize", None) or ()))


def _constexpr_positions(fn: Any) -> list:
    if getattr(fn, "constexprs", None) is not None:
        return sorted(fn.constexprs)
    # the interpreter's function has no such list: read the annotations (strings under
    # ``from __future__ import annotations``)
    params = inspect.signature(fn.fn).parameters.values()
    return [i for i, p in enumerate(params) if "constexpr" in str(p.annotation)]


def current_stream(device: torch.device) -> int:
    """The raw handle of ``device``'s current CUDA stream (0: the default stream). Raises what
    torch raises without CUDA."""
    return torch._C._cuda_getCurrentRawStream(device.index)


def capturing(stream: int) -> bool:
    """Whether a CUDA graph is being captured on the current stream, ``stream``
    (:func:`current_stream`). Raises nothing.

    Stream 0, the default stream eager code runs on, is answered without asking the driver:
    CUDA refuses to begin a capture there (and PyTorch's graphs ask for another stream), while
    the question costs ~2.7 us of host time a call (bench/results/decode_host.md), which paces
    eager decoding.
    """
    return stream != 0 and torch.cuda.is_current_stream_capturing()


_KNOBS: Any = None


def _hooks_active() -> bool:
    """Whether a launch hook (a profiler such as Proton) wants to see launches."""
    global _KNOBS
    if _KNOBS is None:
        try:
            from triton import knobs as _KNOBS
        except ImportError:  # older Triton: no knobs module, so no hook to honour here
            return False
    hook = _KNOBS.runtime.launch_enter_hook
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return True if calls is None else bool(calls)


class Launcher:
    """``Launcher(kernel, **options)(grid, args, constexprs, num_warps, num_stages)`` launches
    ``kernel`` (a Triton or Gluon JIT function; ``options``: further launch options, such as a
    Gluon kernel's ``maxnreg``, the same on every launch).

    ``args`` are the runtime arguments in kernel order; ``constexprs`` the values of the
    kernel's ``tl.constexpr`` parameters in kernel order (they must come last in its signature).
    Raises ValueError at construction when they do not, and RuntimeError in check mode when the
    cache would pick a kernel Triton would not.
    """

    def __init__(self, fn: Any, **options: Any) -> None:
        self._fn = fn
        # launch options beyond num_warps / num_stages, the same on every launch (a Gluon
        # kernel's maxnreg)
        self._options = options
        names = list(fn.arg_names)
        constexpr = _constexpr_positions(fn)
        if constexpr != list(range(len(names) - len(constexpr), len(names))):
            raise ValueError(f"{names}: tl.constexpr parameters must come last for the Launcher")
        self._constexpr_names = tuple(names[i] for i in constexpr)
        self._unspecialised = _unspecialised_positions(fn)
        self._cache: Dict[tuple, tuple] = {}
        self._warmed: set = set()  # keys compiled ahead by warmup (Triton holds the kernels)
        self._ptrs: Callable[[tuple], tuple] | None = None
        self._descs: Callable[[tuple], tuple] | None = None  # None: the kernel takes no descriptor
        self._ints: Callable[[tuple], tuple] = _getter(())
        self._plain_ints: Callable[[tuple], tuple] = _getter(())
        self._types: Tuple[type, ...] = ()
        self._interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
        self._fast = not self._interpreted and os.environ.get("FLASH_ATTN2_FAST_LAUNCH", "1") != "0"
        self._check = os.environ.get("FLASH_ATTN2_LAUNCH_CHECK", "0") == "1"
        self._get_device: Callable[[], int] | None = None
        self._get_stream: Callable[[int], int] | None = None

    def _learn(self, args: tuple) -> None:
        """Bind the driver's device and stream queries, then learn the argument positions (in
        that order, and ``_ptrs`` last: a compile thread may learn them while the caller's
        thread checks ``_ptrs`` to take the fast path)."""
        from triton.runtime.driver import driver

        self._get_device = driver.active.get_current_device
        self._get_stream = driver.active.get_current_stream
        self._learn_positions(args)

    def _learn_positions(self, args: tuple) -> None:
        types = _slot_types(args)
        self._types = types
        plain = self._unspecialised
        self._ints = _getter([i for i, t in enumerate(types) if t is int and i not in plain])
        self._plain_ints = _getter([i for i, t in enumerate(types) if t is int and i in plain])
        descs = [i for i, t in enumerate(types) if t.__name__ == "TensorDescriptor"]
        self._descs = _getter(descs) if descs else None
        self._ptrs = _getter([i for i, t in enumerate(types) if t is torch.Tensor])

    def _key(self, device: int, args: tuple, constexprs: tuple, num_warps: int, num_stages: int) -> tuple:
        # Runs on every launch: plain list comprehensions (measured faster than map() over slot
        # wrappers) and C-level min/max/contains for the rare cases.
        ints = self._ints(args)
        if ints and (max(ints) > _I32_MAX or min(ints) < _I32_MIN):
            int_key: tuple = ("wide",) + tuple([int_spec(i) for i in ints])
        elif 1 in ints:  # 1 is its own class (Triton makes it a constant)
            int_key = ("one",) + tuple([-1 if i == 1 else i & 15 for i in ints])
        else:
            # the residue mod 16 decides divisibility: finer than Triton's split, so one key
            # never covers two of its kernels
            int_key = tuple([i & 15 for i in ints])
        plain = self._plain_ints(args)
        width_key = None  # all 32-bit: the common case, one C-level max/min to find it
        if plain and (max(plain) > _I32_MAX or min(plain) < _I32_MIN):
            width_key = tuple([int_spec(i) & 6 for i in plain])
        # Triton keys a descriptor on its element type and block shape (its base must be
        # 16-byte aligned, its shape and strides are runtime values)
        desc_key = None if self._descs is None else \
            tuple([(d.base.dtype, tuple(d.block_shape)) for d in self._descs(args)])
        return (
            device,  # a compiled kernel's function handle belongs to one device
            constexprs,
            num_warps,
            num_stages,
            tuple([(t.dtype, t.data_ptr() & 15 == 0) if t is not None else None for t in self._ptrs(args)]),
            int_key,
            width_key,
            desc_key,
        )

    def __call__(self, grid: Tuple[int, int, int], args: tuple, constexprs: tuple,
                 num_warps: int, num_stages: int) -> None:
        if self._fast and self._ptrs is not None:
            device = self._get_device()
            entry = self._cache.get(self._key(device, args, constexprs, num_warps, num_stages))
            if entry is not None and not _hooks_active():
                self._launch_cached(entry, device, grid, args, constexprs, num_warps, num_stages)
                return
        if len(constexprs) != len(self._constexpr_names):
            raise ValueError(f"{self._constexpr_names}: got {len(constexprs)} constexpr values")
        kwargs = dict(zip(self._constexpr_names, constexprs))
        if not self._interpreted:  # Triton's own path looks the kernel up under a key that holds it
            _hash_compiler_once()
        compiled = self._fn[grid](*args, num_warps=num_warps, num_stages=num_stages, **self._options, **kwargs)
        if not self._fast or compiled is None:
            return
        try:
            entry = (compiled.run, compiled.function, compiled.packed_metadata, compiled,
                     DirectLaunch.of(compiled))
        except AttributeError:  # a Triton whose compiled kernels look different: stay on its path
            self._fast = False
            return
        if self._ptrs is None:
            self._learn(args)
        elif self._check:
            self._check_types(args)
        self._cache[self._key(self._get_device(), args, constexprs, num_warps, num_stages)] = entry

    def keep(self, args: tuple, constexprs: tuple, num_warps: int, num_stages: int) -> Optional[tuple]:
        """After a launch with these arguments, that launch, for :meth:`launch_kept` to repeat
        without working the key out again; None where there is none to keep: the fast path off
        or not learnt yet, a launch hook installed, the kernel not in the cache, or a key that
        holds a specialised integer, a 64-bit one, a descriptor or a pointer not 16-byte aligned.

        Why: an eager decode step makes the same call on every layer, and working the key out
        (a pointer's dtype and alignment, each integer's width) was the largest part of the
        launch's host time after the launch itself (bench/results/decode_host.md). Raises nothing.
        """
        if not self._fast or self._ptrs is None or _hooks_active():
            return None
        key = self._key(self._get_device(), args, constexprs, num_warps, num_stages)
        entry = self._cache.get(key)
        if entry is None or key[5] or key[6] is not None or key[7] is not None:
            return None
        if not all(p is None or p[1] for p in key[4]):
            return None
        return key, entry, constexprs, num_warps, num_stages

    def launch_kept(self, kept: tuple, grid: Tuple[int, int, int], args: tuple) -> bool:
        """Launch ``args`` as :meth:`__call__` would, through ``kept`` (:meth:`keep`'s answer for
        an earlier call) and that call's constexprs and launch options, without working the key
        out: the caller vouches that ``args`` has the same key: each pointer slot None or not as
        then, of the same dtype, 16-byte aligned, every integer 32-bit. In check mode
        (``FLASH_ATTN2_LAUNCH_CHECK=1``) the key is worked out anyway and a difference raises
        RuntimeError. Returns False, launching nothing, where the current device is not the kept
        launch's or a launch hook wants to see launches (then call the Launcher itself)."""
        key, entry, constexprs, num_warps, num_stages = kept
        device = self._get_device()
        if device != key[0] or _hooks_active():
            return False
        if self._check:
            actual = self._key(device, args, constexprs, num_warps, num_stages)
            if actual != key:
                raise RuntimeError(f"Launcher: a kept launch of {self._fn} was handed other arguments: key {key} "
                                   f"kept, {actual} now")
        self._launch_cached(entry, device, grid, args, constexprs, num_warps, num_stages)
        return True

    def _launch_cached(self, entry: tuple, device: int, grid: Tuple[int, int, int], args: tuple,
                       constexprs: tuple, num_warps: int, num_stages: int) -> None:
        """Launch a cache entry's kernel: directly (:class:`DirectLaunch`) or through Triton's
        launcher; in check mode each against Triton's own choice and argument list first."""
        run, function, metadata, compiled, direct = entry
        if self._check:
            self._verify(grid, args, constexprs, num_warps, num_stages, compiled)
        if direct is not None and DIRECT_LAUNCH:
            if self._check:
                direct.verify(args + constexprs)
            direct(grid, self._get_stream(device), function, metadata, args + constexprs)
            return
        run(grid[0], grid[1], grid[2], self._get_stream(device), function, metadata,
            None, None, None, *args, *constexprs)

    def _check_types(self, args: tuple) -> None:
        types = _slot_types(args)
        if types != self._types:
            raise RuntimeError(f"Launcher: argument types changed between calls: {self._types} -> {types}")

    def _verify(self, grid, args, constexprs, num_warps, num_stages, compiled) -> None:
        self._check_types(args)
        kwargs = dict(zip(self._constexpr_names, constexprs))
        theirs = self._fn.warmup(*args, grid=grid, num_warps=num_warps, num_stages=num_stages, **self._options,
                                 **kwargs)
        if theirs is not compiled:
            raise RuntimeError(
                f"Launcher cache picked another compiled kernel than Triton for {self._fn}: key "
                f"{self._key(self._get_device(), args, constexprs, num_warps, num_stages)}"
            )

    def ready(self, args: tuple, constexprs: tuple, num_warps: int, num_stages: int) -> bool:
        """Whether the kernel a launch with these arguments needs was launched or compiled ahead
        by this Launcher already (then compiling ahead has nothing to do)."""
        if self._ptrs is None:  # set last by _learn: once it is, the rest of the key's parts are
            return False
        key = self._key(self._get_device(), args, constexprs, num_warps, num_stages)
        return key in self._cache or key in self._warmed

    def warmup(self, args: tuple, constexprs: tuple, num_warps: int, num_stages: int) -> None:
        """Compile the kernel a launch with these arguments needs, and load it, without launching.

        Pointers may be ``meta`` tensors (address 0, which Triton takes as 16-byte aligned, as a
        fresh allocation is): buffers a later launch allocates need not exist yet. Safe on a
        worker thread. Raises what Triton's compiler raises.
        """
        kwargs = dict(zip(self._constexpr_names, constexprs))
        _hash_compiler_once()
        compiled = self._fn.warmup(*args, grid=(1, 1, 1), num_warps=num_warps, num_stages=num_stages,
                                   **self._options, **kwargs)
        init = getattr(compiled, "_init_handles", None)
        if init is not None:  # load the module and build its launcher here, not at the first launch
            init()
        if self._ptrs is None:
            self._learn(args)
        self._warmed.add(self._key(self._get_device(), args, constexprs, num_warps, num_stages))

    @property
    def cached(self) -> int:
        """How many compiled specialisations the fast path holds (tests and benchmarks)."""
        return len(self._cache)


# Whether the cached path calls Triton's C launch function itself (see DirectLaunch); read per
# launch, so a benchmark can time both ways in one process. On by default: on the H200 it took
# 115-180 us of host time off a forward+backward call (bench/results/host_overhead.md), and the
# GPU check runs every launch through DirectLaunch.verify.
DIRECT_LAUNCH = os.environ.get("FLASH_ATTN2_DIRECT_LAUNCH", "1") != "0"
_TMAP_MEMO_MAX = 1024
# Triton releases (major, minor) whose CUDA launcher DirectLaunch reproduces, checked against that
# release's own wrapper (the C function's argument list identical on the Gluon and Triton
# kernels' launches, bench/results/direct_launch_equivalence*.md). 3.6 builds a C launch function
# per kernel that takes the arguments spread out; 3.7 has one C function for every kernel that
# takes them as one list after their annotations and signature; later releases changed the
# wrapper again.
DIRECT_TRITON = frozenset({(3, 6), (3, 7)})
_DIRECT_RELEASE: Optional[Tuple[int, int]] = None  # (0, 0): this Triton is none of them
TMA_TF32 = 11  # Triton 3.7's host element type for fp32 descriptors rounded to tf32


def _direct_release() -> Optional[Tuple[int, int]]:
    """This process's Triton release when DirectLaunch reproduces its launcher, else None."""
    global _DIRECT_RELEASE
    if _DIRECT_RELEASE is None:
        import triton

        from ._gluon_dispatch import triton_version_tuple

        release = triton_version_tuple(triton.__version__)
        _DIRECT_RELEASE = release if release in DIRECT_TRITON else (0, 0)
    return _DIRECT_RELEASE if _DIRECT_RELEASE in DIRECT_TRITON else None


class DirectLaunch:
    """``DirectLaunch.of(compiled)(grid, stream, function, metadata, args)`` launches ``compiled``
    as Triton's ``CudaLauncher.__call__`` would (Triton 3.6 or 3.7, :data:`DIRECT_TRITON`),
    without its Python layers; ``of`` returns None for a compiled kernel whose launcher is laid
    out otherwise (then Triton's path runs).

    Why: in a short training step the host issues launches more slowly than the GPU runs them.
    Triton wraps the C launch function in Python that walks every argument and, for each host
    ``TensorDescriptor``, encodes a ``CUtensorMap`` anew (``make_tensordesc_arg``), then calls it
    through ``CudaLauncher.__call__``, which builds two scratch closures per launch. Here the
    argument list is built with slices and each map is encoded once per (slot, address, shape,
    strides, padding, tf32 rounding): the map holds nothing else (the slot fixes its element
    type, box and swizzle), so a cached map is the one Triton would encode. ``verify(args)`` (the
    launch check mode) compares the list with the one Triton's own expansion gives and raises
    RuntimeError if they differ.
    """

    # Triton 3.6's layout; Triton 3.7's is DirectLaunchList below
    _FILL = "fill_tma_descriptor"  # the driver utility that encodes a map
    _TF32 = False  # whether a descriptor's round_f32_to_tf32 changes its map's element type

    def __init__(self, c_launch, cooperative, pdl, plan, fill, expand_like_triton, runner=None) -> None:
        self._launch = c_launch
        self._head = (cooperative, pdl, None, None)  # no scratch buffers: of() checked
        self._plan = plan  # per descriptor slot: (position, swizzle, element size, host type, box)
        self._fill = fill
        self._triton_expand = expand_like_triton
        self._maps: dict = {}

    @classmethod
    def of(cls, compiled: Any) -> Optional["DirectLaunch"]:
        release = _direct_release()
        if release is None:
            return None
        if cls is DirectLaunch and release == (3, 7):
            return DirectLaunchList.of(compiled)
        runner = getattr(compiled, "run", None)
        try:
            launch = runner.launch
            cooperative, pdl = runner.launch_cooperative_grid, runner.launch_pdl
            scratch = runner.global_scratch_size or runner.profile_scratch_size
            ctas = getattr(runner, "num_ctas", 1)
        except AttributeError:
            return None
        if scratch or ctas != 1 or type(runner).__name__ != "CudaLauncher":
            return None
        code = getattr(launch, "__code__", None)
        if code is None:  # the C function itself: Triton wraps only launches with descriptors
            return cls(launch, cooperative, pdl, (), None, None, runner) if callable(launch) else None
        if code.co_name != "inner" or set(code.co_freevars) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
            return None
        cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in launch.__closure__)))
        metas, positions = cells["tensordesc_meta"], sorted(cells["tensordesc_indices"])
        module = importlib.import_module(launch.__module__)
        to_host = getattr(module, "TMA_DTYPE_DEVICE_TO_HOST", None)
        make_arg = getattr(module, "make_tensordesc_arg", None)
        if (to_host is None or make_arg is None or not metas or len(metas) != len(positions)
                or any(m is None or m.get("fp4_padded") for m in metas)):
            return None
        from triton.runtime.driver import driver

        fill = getattr(driver.active.utils, cls._FILL, None)
        if fill is None:
            return None
        plan = tuple((p, m["swizzle"], m["elem_size"], to_host[m["elem_type"]], m["block_size"])
                     for p, m in zip(positions, metas))

        def expand_like_triton(args: tuple) -> list:
            out = []
            for i, a in enumerate(args):
                out.extend(make_arg(a, metas[positions.index(i)]) if i in positions else (a,))
            return out

        return cls(cells["launcher"], cooperative, pdl, plan, fill, expand_like_triton, runner)

    def _expand(self, args: tuple, fill: Optional[Callable] = None) -> list:
        # fill given (verify): every map encoded through it, none cached
        out: list = []
        start = 0
        maps = self._maps if fill is None else None
        for p, swizzle, size, kind, box in self._plan:
            out += args[start:p]
            d = args[p]
            shape, strides, ptr = d.shape, d.strides, d.base.data_ptr()
            tf32 = self._TF32 and d.round_f32_to_tf32
            key = (p, ptr, d.padding, tf32, *shape, *strides)
            tmap = maps.get(key) if maps is not None else None
            if tmap is None:
                tmap = (fill or self._fill)(ptr, swizzle, size, TMA_TF32 if tf32 else kind, box, shape, strides,
                                            1 if d.padding == "nan" else 0)
                if maps is not None:
                    if len(maps) >= _TMAP_MEMO_MAX:
                        maps.clear()
                    maps[key] = tmap
            out.append(tmap)
            out += shape
            out += strides
            start = p + 1
        out += args[start:]
        return out

    def __call__(self, grid: Tuple[int, int, int], stream: int, function: int, metadata: Any, args: tuple) -> None:
        self._launch(grid[0], grid[1], grid[2], stream, function, *self._head, metadata, None, None, None,
                     *(self._expand(args) if self._plan else args))

    def verify(self, args: tuple) -> None:
        """Raise RuntimeError unless this launch's argument list is the one Triton's own wrapper
        would build, each map's encode called with the same inputs (the maps themselves are
        opaque; both encodes are recorded instead of run)."""
        if not self._plan:
            return
        from triton.runtime.driver import driver

        def record(*inputs):
            return ("CUtensorMap", inputs)

        ours = self._expand(args, fill=record)
        utils = driver.active.utils
        real = getattr(utils, self._FILL)
        setattr(utils, self._FILL, record)
        try:
            theirs = self._triton_expand(args)
        finally:
            setattr(utils, self._FILL, real)
        same = len(ours) == len(theirs) and all(
            a is b or (not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b)
            for a, b in zip(ours, theirs))
        if not same:
            raise RuntimeError(f"DirectLaunch: the argument list differs from Triton's: {ours} != {theirs}")


class DirectLaunchList(DirectLaunch):
    """:class:`DirectLaunch` for Triton 3.7, whose one C launch function serves every kernel: it
    takes, after the grid, stream, function, launch flags, metadata, hooks and scratch buffers,
    the launcher's argument annotations and signature handle, then the kernel's arguments as one
    list (descriptors expanded, as in 3.6). Maps are encoded by ``fill_tma_descriptor_tiled``."""

    _FILL = "fill_tma_descriptor_tiled"
    _TF32 = True

    def __init__(self, c_launch, cooperative, pdl, plan, fill, expand_like_triton, runner=None) -> None:
        super().__init__(c_launch, cooperative, pdl, plan, fill, expand_like_triton, runner)
        # after metadata: launch metadata, the two hooks, the two scratch buffers (none: of() checked)
        self._flags = (cooperative, pdl)
        self._tail = (runner.arg_annotations, runner.kernel_signature)

    @classmethod
    def of(cls, compiled: Any) -> Optional["DirectLaunch"]:
        runner = getattr(compiled, "run", None)
        if not (hasattr(runner, "arg_annotations") and hasattr(runner, "kernel_signature")):
            return None
        return super().of(compiled)

    def __call__(self, grid: Tuple[int, int, int], stream: int, function: int, metadata: Any, args: tuple) -> None:
        self._launch(grid[0], grid[1], grid[2], stream, function, *self._flags, metadata, None, None, None, None, None,
                     *self._tail, self._expand(args) if self._plan else args)


_POOL: Optional[ThreadPoolExecutor] = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="flash_attn2-compile")
        return _POOL


Job = Tuple[Launcher, tuple, tuple, int, int]  # (launcher, args, constexprs, num_warps, num_stages)

_COMPILER_HASHED = False
_HASHING: Optional[threading.Thread] = None
_HELPER: Optional[threading.Thread] = None


def _triton_key() -> None:
    try:
        from triton.runtime.cache import triton_key
        triton_key()
    except Exception:  # no such function, or it failed: the compile computes it again and raises there
        pass


def _build_cuda_utils() -> None:
    """Have Triton's CUDA helper module built (or found in its cache) and loaded.

    Why: Triton builds it (``cuda_utils``: loading modules, device properties, TMA descriptors)
    from C with the host's compiler when its CUDA driver object is first created, which is at the
    first launch: about 0.25 s of gcc on an empty cache, on the first call's path. Built here, that
    step finds it in the cache. Only the module is built: creating Triton's driver asks torch
    whether CUDA is available, which initialises CUDA, and a CUDA initialised by an import breaks
    CUDA in processes the job forks later. Raises nothing (another Triton, no libcuda, a read-only
    cache: the first launch builds it as before and raises there)."""
    try:
        from triton.backends.nvidia.driver import CudaUtils
        CudaUtils()
    except Exception:
        pass


def hash_compiler_in_background() -> None:
    """Start computing Triton's hash of its own compiler (see :func:`_hash_compiler_once`) on a
    daemon thread, once per process, and building Triton's CUDA helper module (see
    :func:`_build_cuda_utils`) on a second one beside it; the first compile or cache lookup waits
    for both. Two threads, not one after the other: the hash reads a file and the helper runs
    the C compiler, so side by side the first call waits for the longer of them, not their sum
    (on an H200 host, 3.6 s of hashing then 0.46 s of gcc left a call made right after the
    import waiting 0.42 s: bench/results/compile_report_phases.md).

    Why: every compile's and every cache lookup's key holds that hash (about 0.3 s of reading
    libtriton, more from a cold disk), so computed at the first call it sits on the path
    of the first call, with an empty cache and with a prepared one alike. Started when the
    package is imported, it runs while the job builds its model. Not started with the compile
    threads off (``COMPILE_THREADS`` 0). Raises nothing."""
    global _HASHING, _HELPER
    if _HASHING is None and not _COMPILER_HASHED and COMPILE_THREADS > 0:
        # Triton is imported here, on the calling thread. Imported for the first time on the
        # hashing thread, beside the caller's own imports, it left a Triton without `backends`
        # (torch.compile in bench/attention.py raised on it): a first import that fails on a
        # thread (Python gives up on imports two threads wait on each other for) is dropped from
        # sys.modules while its submodules stay, and the next `import triton` builds a package
        # without them, the failure itself swallowed below. Once Triton is imported, the thread
        # imports nothing more: it reads files and runs the C compiler.
        try:
            import triton.runtime.cache  # noqa: F401
        except ImportError:  # no Triton: nothing will compile or look a kernel up
            return
        try:  # the helper module's builder, for the same reason
            import triton.backends.nvidia.driver  # noqa: F401
            import triton.runtime.build  # noqa: F401
        except ImportError:  # a Triton without a CUDA backend: the helper thread builds nothing
            pass
        _HASHING = threading.Thread(target=_triton_key, name="flash_attn2-compiler-hash", daemon=True)
        _HASHING.start()
        _HELPER = threading.Thread(target=_build_cuda_utils, name="flash_attn2-cuda-helper", daemon=True)
        _HELPER.start()


def _hash_compiler_once() -> None:
    """Have Triton's hash of its own compiler (``triton.runtime.cache.triton_key``: it reads the
    whole libtriton library) computed before anything compiles: wait for the thread that
    :func:`hash_compiler_in_background` started (and the one building Triton's CUDA helper
    module beside it), or compute it on the calling thread.

    Why: every compile's cache key holds that hash, and Triton caches it without a lock, so
    threads that compile at once each compute it again, in 1 MB reads that take and release the
    GIL while the forward compiles on the calling thread. Raises nothing (a Triton without that
    function: each compile hashes as it always does)."""
    global _COMPILER_HASHED
    if _COMPILER_HASHED:
        return
    if _HASHING is not None:
        _HASHING.join()
        if _HELPER is not None:  # the first launch creates Triton's driver, which loads the helper
            _HELPER.join()
    else:
        _triton_key()
    # set once the hash is cached: a compile thread that checks meanwhile waits for it too
    _COMPILER_HASHED = True


_COMPILER_IMPORTED = False


def _import_compiler() -> None:
    """Import Triton's code generator, which a first compile imports (with Gluon's language
    modules, some forty modules), on the calling thread before compiles start on the pool.

    Why: a first import of a module that two threads start at once can fail on one of them
    (Python gives up on imports that wait on each other), and a failed import leaves its
    package out of ``sys.modules`` with its submodules in (see :func:`hash_compiler_in_background`).
    Raises nothing (a Triton without that module: its compile imports what it needs)."""
    global _COMPILER_IMPORTED
    if not _COMPILER_IMPORTED:
        try:
            import triton.compiler.code_generator  # noqa: F401
        except ImportError:
            pass
        _COMPILER_IMPORTED = True


def compile_all(jobs: Iterable[Job], device: Any = None) -> list:
    """Start compiling the kernels of ``jobs`` that are not compiled yet, each on a thread of the
    pool; returns their Futures (empty when there is nothing to compile or threads are off:
    ``COMPILE_THREADS`` 0). Wait with :func:`wait`.

    ``device``: the CUDA device the kernels are for (a worker thread does not inherit the
    caller's current device).
    """
    if COMPILE_THREADS <= 0:
        return []
    todo = [job for job in jobs if not job[0].ready(*job[1:])]
    if not todo:
        return []
    _hash_compiler_once()
    _import_compiler()

    def one(job: Job) -> None:
        cuda = device is not None and torch.device(device).type == "cuda"
        with torch.cuda.device(device) if cuda else contextlib.nullcontext():
            job[0].warmup(*job[1:])

    pool = _pool()
    return [pool.submit(one, job) for job in todo]


def wait(futures: Iterable[Future]) -> None:
    """Block until every compile in ``futures`` is done; raises the first compile error."""
    for f in futures:
        f.result()
