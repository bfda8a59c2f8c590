"""Patching: the two ``PreTrainedModel`` methods the bridge wraps, and how they are put back.

Every version in the supported range decides a model's attention implementation in
``PreTrainedModel._check_and_adjust_attn_implementation`` (called by ``__init__`` -- hence
``from_pretrained`` / ``from_config`` -- and by ``set_attn_implementation``). The wrapped check asks
:func:`~kernel_loader.integrations.transformers.routing.route` first and hands everything it does
not route to transformers unchanged. ``set_attn_implementation`` is wrapped so that kernel ids in
the per-backbone dict form are registered before transformers validates them.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kernel_loader.errors import UnsupportedTransformersVersionError
from kernel_loader.integrations.transformers.routing import (
    MISSING,
    BridgeState,
    rewrite_request,
    route,
    route_subconfigs,
)

__all__ = ["Patch", "patch_method", "wrap_check", "wrap_set"]

StateGetter = Callable[[], "BridgeState | None"]


@dataclass
class Patch:
    """One replaced attribute and what to put back."""

    owner: Any
    name: str
    previous: Any  # the owner's own attribute (``MISSING`` when it was inherited)

    def restore(self) -> None:
        if self.previous is MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.previous)


def _argument(args: tuple, kwargs: dict, position: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def wrap_check(original: Callable[..., Any], current: StateGetter, lock: threading.RLock) -> Callable[..., Any]:
    """``_check_and_adjust_attn_implementation`` that routes first (``current()`` is the live state)."""

    @functools.wraps(original)
    def _check_and_adjust_attn_implementation(self: Any, attn_implementation: Any = None, *args: Any, **kwargs: Any) -> Any:
        state = current()
        if state is None:  # disabled while a model was being built in another thread
            return original(self, attn_implementation, *args, **kwargs)
        is_init_check = bool(_argument(args, kwargs, 0, "is_init_check", False))
        trust = bool(_argument(args, kwargs, 1, "allow_all_kernels", False))
        with lock:
            routed = route(state, self, attn_implementation, trust)
            if is_init_check:
                route_subconfigs(state, self.config, trust)
        if routed is not None:
            return routed
        return original(self, attn_implementation, *args, **kwargs)

    _check_and_adjust_attn_implementation.__kernel_loader_bridge__ = True  # type: ignore[attr-defined]
    return _check_and_adjust_attn_implementation


def wrap_set(original: Callable[..., Any], current: StateGetter, lock: threading.RLock) -> Callable[..., Any]:
    """``set_attn_implementation`` that registers sub-configs' kernel ids before transformers checks them."""

    @functools.wraps(original)
    def set_attn_implementation(self: Any, attn_implementation: Any, *args: Any, **kwargs: Any) -> Any:
        state = current()
        if state is not None:
            trust = bool(_argument(args, kwargs, 0, "allow_all_kernels", False))
            with lock:
                attn_implementation = rewrite_request(state, attn_implementation, trust)
        return original(self, attn_implementation, *args, **kwargs)

    set_attn_implementation.__kernel_loader_bridge__ = True  # type: ignore[attr-defined]
    return set_attn_implementation


def patch_method(
    state: BridgeState, owner: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]], supported: str
) -> None:
    """Replace ``owner.name`` by ``wrap(original)`` and remember how to undo it.

    Raises:
        UnsupportedTransformersVersionError: ``owner`` has no such method.
    """
    original = getattr(owner, name, None)
    if original is None or not callable(original):
        raise UnsupportedTransformersVersionError(
            f"transformers {state.version} has no {owner.__name__}.{name}; the kernel_loader bridge supports "
            f"transformers {supported}."
        )
    previous = owner.__dict__.get(name, MISSING)
    state.patches.append(Patch(owner, name, previous))
    setattr(owner, name, wrap(original))
