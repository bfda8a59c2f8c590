"""How a call to the stand-in ``flash_attn`` / ``flash_attn_interface`` reaches the chain's kernel.

The stand-in's functions carry flash-attn's own signatures (FA2's or FA3's). The kernel the
fallback chain picks may speak either API (the shipped ``flash-attn2`` and the Hub's
``flash-attn2`` speak FA2's; ``flash-attn3`` / ``vllm-flash-attn3`` speak FA3's), so each argument
is passed under the kernel's own name for it: FA3's ``page_table`` is FA2's ``block_table``. An
argument the kernel has no parameter for is dropped when it holds its default value or only tunes
speed (``num_splits``, ``pack_gqa``, ``sm_margin``, ``scheduler_metadata``), and refused otherwise,
since dropping it would change the result.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from kernel_loader.errors import UnsupportedAttentionOptionError, UnusableKernelError

__all__ = ["call_kernel", "chain_kernel"]

# Options that change speed, never the result; a kernel without them computes the same attention.
_SPEED_ONLY = frozenset({"num_splits", "pack_gqa", "sm_margin", "scheduler_metadata"})
# the stand-in's parameter name -> the same option under the other API's name
_OTHER_NAME = {"page_table": "block_table", "block_table": "page_table"}


def chain_kernel(chain: str) -> ModuleType:
    """The kernel module the fallback chain ``chain`` picked (walked once per process).

    Raises:
        KernelNotFoundError: no option of the chain is usable on this machine.
        UnusableKernelError: the chain picked the stand-in itself (kernel_loader's fallback chain
            must skip it; this guards against endless recursion).
    """
    from kernel_loader.attention.fallback import flash_chain_kernel
    from kernel_loader.flash_attn_compat import is_stand_in

    kernel = flash_chain_kernel(chain)
    if is_stand_in(kernel):
        raise UnusableKernelError(
            f"The {chain} fallback chain picked kernel_loader's own flash_attn stand-in, which has no kernel of its "
            f"own. Run `kernel-loader explain {chain}` to see the chain."
        )
    return kernel


@functools.lru_cache(maxsize=64)
def _parameters(fn: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(fn).parameters


def _is_default(value: Any, default: Any) -> bool:
    if default is None or value is None:
        return value is default
    if isinstance(value, (bool, int, float, tuple, list)):  # tensors never equal a scalar default here
        return tuple(value) == tuple(default) if isinstance(value, (tuple, list)) else value == default
    return False


def call_kernel(chain: str, api_function: Callable[..., Any], arguments: Mapping[str, Any]) -> Any:
    """Call the function named like ``api_function`` in ``chain``'s kernel with ``arguments``.

    ``arguments`` are ``api_function``'s parameters (its ``locals()``). A three-item FA2 answer
    ``(out, softmax_lse, None)`` to ``return_attn_probs`` is shortened to FA3's ``(out, softmax_lse)``
    when ``api_function`` speaks FA3 (it has no ``dropout_p``).

    Raises:
        UnsupportedAttentionOptionError: an argument changes the result but the kernel has no
            parameter for it.
        UnusableKernelError: the kernel has no function of that name.
        KernelNotFoundError: no kernel of the chain is usable here.
    """
    name = api_function.__name__
    kernel = chain_kernel(chain)
    target = getattr(kernel, name, None)
    if target is None:
        repo = getattr(getattr(kernel, "__kernel_resolution__", None), "repo_id", None) or kernel.__name__
        raise UnusableKernelError(
            f"{name} was called, but the kernel the {chain} chain picked ({repo}) has no {name}. "
            f"Run `kernel-loader explain {chain}` to see the chain."
        )
    accepted = _parameters(target)
    declared = _parameters(api_function)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    call: dict[str, Any] = {}
    for param, value in arguments.items():
        if param in accepted or takes_any:
            call[param] = value
        elif _OTHER_NAME.get(param) in accepted:
            call[_OTHER_NAME[param]] = value
        elif param in _SPEED_ONLY or _is_default(value, declared[param].default):
            continue
        else:
            raise UnsupportedAttentionOptionError(
                f"{name}({param}=...) cannot be honoured: the kernel the {chain} chain picked has no {param!r} "
                f"option, and leaving it out would change the result. Call it without {param}, or install the "
                f"flash-attn package that provides it (`kernel-loader explain {chain}` shows the chain)."
            )
    out = target(**call)
    if "dropout_p" not in declared and isinstance(out, tuple) and len(out) == 3 and out[2] is None:
        out = out[:2]
    return out
