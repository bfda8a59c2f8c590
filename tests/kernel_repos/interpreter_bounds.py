"""Out-of-bounds checks for Triton kernels run by the interpreter (``TRITON_INTERPRET=1``).

On a GPU an access outside a tensor's buffer either faults (``illegal memory access``) or, inside
the caching allocator's larger segment, silently reads a neighbour's bytes, which
``compute-sanitizer`` cannot see either. Under the interpreter every load and store goes through
two builder methods with the lanes' raw addresses and masks, so each enabled lane can be checked
against the buffers the launch was given.

``with within_arguments() as seen:`` makes every interpreted launch in the block raise
:class:`OutOfBounds` at the first enabled lane whose element does not lie entirely inside the
storage of one of that launch's tensor arguments; ``seen["accesses"]`` counts the checked calls.
On a CPU the interpreter's host copy of an argument is the argument itself, so copying it back
after the launch is skipped: a test can pass a view of a buffer of several GB whose pages it
never touches (memory is only committed where it writes).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np


class OutOfBounds(AssertionError):
    """A kernel touched memory outside every tensor argument of its launch."""


def caused_by_out_of_bounds(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised from, an :class:`OutOfBounds` (the interpreter wraps a
    kernel's exceptions in its own)."""
    while exc is not None:
        if isinstance(exc, OutOfBounds) or "OutOfBounds" in str(exc):
            return True
        exc = exc.__cause__
    return False


def _ranges_of(args: list, kwargs: dict) -> list[tuple[int, int]]:
    found: list[tuple[int, int]] = []

    def visit(arg: object) -> None:
        if isinstance(arg, tuple):
            for a in arg:
                visit(a)
        elif hasattr(arg, "untyped_storage"):
            storage = arg.untyped_storage()
            found.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))

    for a in list(args) + list(kwargs.values()):
        visit(a)
    return found


@contextlib.contextmanager
def within_arguments() -> Iterator[dict]:
    """Check every interpreted load and store of the launches inside the block (see module doc)."""
    from triton.runtime import interpreter

    executor = interpreter.GridExecutor
    builder = interpreter.InterpreterBuilder
    real_init, real_load, real_store = executor._init_args_hst, builder.create_masked_load, builder.create_masked_store
    real_restore = executor._restore_args_dev
    state: dict = {"ranges": [], "accesses": 0}

    def init(self, args_dev, kwargs):
        args_hst, kwargs_hst = real_init(self, args_dev, kwargs)
        # on a CPU the host copies are the tensors themselves; their storages bound every access
        state["ranges"] = _ranges_of(args_hst, kwargs_hst)
        state["kernel"] = getattr(self.fn, "__name__", repr(self.fn))
        return args_hst, kwargs_hst

    def restore(self, args_dev, args_hst, kwargs, kwargs_hst):
        pairs = list(zip(args_dev, args_hst)) + [(kwargs[k], kwargs_hst[k]) for k in kwargs]
        if any(isinstance(a, tuple) or (hasattr(a, "data_ptr") and
                                        a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr())
               for a, b in pairs):
            real_restore(self, args_dev, args_hst, kwargs, kwargs_hst)

    def check(ptrs, mask, what: str) -> None:
        state["accesses"] += 1
        addr = np.asarray(ptrs.data, dtype=np.uint64)
        on = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
        size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        live = addr[on]
        if live.size == 0:
            return
        ok = np.zeros(live.shape, dtype=bool)
        for start, end in state["ranges"]:
            ok |= (live >= start) & (live + size <= end)
        if not ok.all():
            bad = int(live[~ok][0])
            nearest = min(state["ranges"], key=lambda r: min(abs(bad - r[0]), abs(bad - r[1])), default=(0, 0))
            raise OutOfBounds(f"{state.get('kernel')}: {what} of {int((~ok).sum())} lane(s) outside every tensor "
                              f"argument; first at {bad:#x}, {bad - nearest[0]:+d} bytes from the start of the "
                              f"nearest buffer [{nearest[0]:#x}, {nearest[1]:#x})")

    def load(self, ptrs, mask, other, cache_policy, is_volatile):
        check(ptrs, mask, "load")
        return real_load(self, ptrs, mask, other, cache_policy, is_volatile)

    def store(self, ptrs, value, mask, cache_policy):
        check(ptrs, mask, "store")
        return real_store(self, ptrs, value, mask, cache_policy)

    executor._init_args_hst, executor._restore_args_dev = init, restore
    builder.create_masked_load, builder.create_masked_store = load, store
    try:
        yield state
    finally:
        executor._init_args_hst, executor._restore_args_dev = real_init, real_restore
        builder.create_masked_load, builder.create_masked_store = real_load, real_store
