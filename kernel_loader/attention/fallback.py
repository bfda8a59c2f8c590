"""Where ``"flash_attention_2"`` / ``"flash_attention_3"`` get their kernel, in order.

``flash_attention_2``: the ``flash_attn`` package (if installed, importable and this machine has a
CUDA GPU of compute capability 8.0+) -> the Hub kernel ``kernels-community/flash-attn2`` (through
the loader: cache, mirror, Hub) -> the copy kernel_loader ships.

``flash_attention_3``: ``flash_attn_interface`` (Hopper, 9.0+) -> ``kernels-community/flash-attn3``
-> ``kernels-community/vllm-flash-attn3`` -> the shipped copy (FA3's API is served by the shipped
flash-attn2 kernel when no FA3 copy is shipped).

The chain is walked once per process and name: every step's outcome is logged once at INFO, and a
``UserWarning`` names the final choice when it is not the first option. ``explain_chain(name)``
walks it afresh and returns the story as text (``kernel-loader explain flash_attention_2``).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from kernel_loader.errors import KernelLoaderError, KernelNotFoundError

logger = logging.getLogger(__name__)

__all__ = [
    "FLASH_CHAINS",
    "FallbackStep",
    "FallbackOutcome",
    "resolve_flash_chain",
    "flash_chain_kernel",
    "explain_chain",
    "reset_fallback_cache",
]


@dataclass(frozen=True)
class _Option:
    kind: str  # "package" | "hub" | "shipped"
    targets: tuple[str, ...]
    min_capability: tuple[int, int] = (8, 0)
    install_hint: str = ""


FLASH_CHAINS: dict[str, tuple[_Option, ...]] = {
    "flash_attention_2": (
        _Option("package", ("flash_attn",), (8, 0), "pip install flash-attn --no-build-isolation"),
        _Option("hub", ("kernels-community/flash-attn2",)),
        _Option("shipped", ("kernels-community/flash-attn2",)),
    ),
    "flash_attention_3": (
        _Option("package", ("flash_attn_interface",), (9, 0), "build flash-attention's hopper/ folder"),
        _Option("hub", ("kernels-community/flash-attn3",)),
        _Option("hub", ("kernels-community/vllm-flash-attn3",)),
        _Option(
            "shipped",
            ("kernels-community/flash-attn3", "kernels-community/vllm-flash-attn3", "kernels-community/flash-attn2"),
        ),
    ),
}


@dataclass
class FallbackStep:
    """One option of the chain: what was tried, whether it is used, and why (not)."""

    option: str
    ok: bool
    reason: str


@dataclass
class FallbackOutcome:
    """The walked chain. ``kernel`` is the chosen module (None when every option failed)."""

    name: str
    steps: list[FallbackStep] = field(default_factory=list)
    kernel: ModuleType | None = None
    chosen: int | None = None

    def explain(self) -> str:
        """The chain as numbered lines plus the outcome."""
        lines = [f"{self.name}: FlashAttention fallback chain on this machine"]
        for i, step in enumerate(self.steps, 1):
            mark = "USED" if self.chosen == i - 1 else ("ok" if step.ok else "no")
            lines.append(f"  {i}. [{mark}] {step.option}: {step.reason}")
        if self.kernel is None:
            lines.append("  => no FlashAttention kernel is usable here; use attn_implementation='sdpa'.")
        else:
            lines.append(f"  => {self.name} runs on {self.steps[self.chosen].option}")  # type: ignore[index]
        return "\n".join(lines)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _cuda_capability() -> tuple[tuple[int, int] | None, str]:
    import torch

    if not torch.cuda.is_available():
        return None, "this machine has no CUDA GPU visible to torch"
    try:
        cap = torch.cuda.get_device_capability()
    except Exception as exc:  # a broken driver must not crash the fallback
        return None, f"the CUDA device cannot be queried ({_first_line(exc)})"
    return (int(cap[0]), int(cap[1])), f"GPU {torch.cuda.get_device_name()} (sm{cap[0]}{cap[1]})"


def _try_package(opt: _Option) -> tuple[ModuleType | None, str]:
    pkg = opt.targets[0]
    try:
        spec = importlib.util.find_spec(pkg)
    except (ImportError, ValueError) as exc:  # a half-imported or broken package in sys.modules
        return None, f"cannot be looked up ({_first_line(exc)})"
    if spec is None:
        return None, f"not installed ({opt.install_hint})"
    from kernel_loader.flash_attn_compat import is_stand_in

    if is_stand_in(spec):  # it runs on this chain's choice: taking it here would recurse
        return None, f"not installed (only kernel_loader's stand-in, from install_flash_attn(), which runs on the option used below)"
    cap, where = _cuda_capability()
    if cap is None:
        return None, f"installed, but {where}; the package runs only on CUDA GPUs"
    if cap < opt.min_capability:
        need = f"sm{opt.min_capability[0]}{opt.min_capability[1]}"
        return None, f"installed, but {where} is older than the {need} it needs"
    try:
        module = importlib.import_module(pkg)
    except Exception as exc:  # an ABI mismatch shows up here; it is a reason, not a crash
        return None, f"installed, but importing it failed ({_first_line(exc)})"
    if getattr(module, "flash_attn_varlen_func", None) is None:
        return None, f"imported, but {pkg} has no flash_attn_varlen_func"
    return module, f"installed and usable on {where}"


def _try_hub(opt: _Option, cache_dir: Path | None = None) -> tuple[ModuleType | None, str]:
    from kernel_loader.loader import import_resolution, resolve_kernel

    repo = opt.targets[0]
    try:
        # The shipped copy is the chain's own last step, so this step never answers with it.
        res = resolve_kernel(repo, shipped=False, cache_dir=cache_dir)
        module = import_resolution(res)
    except KernelLoaderError as exc:
        return None, _first_line(exc)
    except Exception as exc:  # a network or import failure is a reason to fall back, not a crash
        return None, f"loading failed unexpectedly ({_first_line(exc)})"
    if getattr(module, "flash_attn_varlen_func", None) is None:
        return None, f"loaded, but {repo} exports no flash_attn_varlen_func"
    detail = ", ".join(x for x in (f"sha {res.sha[:12]}" if res.sha else "", f"variant {res.variant}" if res.variant else "") if x)
    return module, f"loaded from {res.source}" + (f" ({detail})" if detail else "")


def _try_shipped(opt: _Option) -> tuple[ModuleType | None, str]:
    from kernel_loader.loader import get_bundled_kernel

    skipped: list[str] = []
    for repo in opt.targets:
        try:
            module = get_bundled_kernel(repo)
        except KernelNotFoundError as exc:
            skipped.append(f"{repo}: {_first_line(exc)}" if _no_bundled() else f"{repo} is not shipped")
            continue
        except Exception as exc:  # KernelLoaderError, or an import-time failure of the package
            skipped.append(f"{repo}: {_first_line(exc)}")
            continue
        if getattr(module, "flash_attn_varlen_func", None) is None:
            skipped.append(f"{repo}: shipped copy has no flash_attn_varlen_func")
            continue
        res = getattr(module, "__kernel_resolution__", None)
        variant = getattr(res, "variant", None)
        found = f"shipped copy of {repo}" + (f" (variant {variant})" if variant else "")
        if skipped:  # e.g. no FA3 copy is shipped, so FA2's kernel (same API) serves flash_attention_3
            found += " (" + "; ".join(skipped) + ")"
        return module, found
    return None, "; ".join(skipped)


def _no_bundled() -> bool:
    """Whether shipped copies are disabled (then the loader's own message is the reason)."""
    from kernel_loader import constants

    return constants.no_bundled()


def _label(opt: _Option) -> str:
    if opt.kind == "package":
        return f"the {opt.targets[0]} package"
    if opt.kind == "hub":
        return f"Hub kernel {opt.targets[0]}"
    return "the shipped kernel"


_TRY = {"package": _try_package, "hub": _try_hub, "shipped": _try_shipped}
_outcomes: dict[str, FallbackOutcome] = {}
_lock = threading.Lock()


def _walk(name: str, cache_dir: Path | None = None) -> FallbackOutcome:
    chain = FLASH_CHAINS.get(name)
    if chain is None:
        raise KeyError(f"no FlashAttention fallback chain for {name!r}; known: {', '.join(FLASH_CHAINS)}")
    outcome = FallbackOutcome(name)
    for opt in chain:
        if outcome.kernel is not None:
            break
        module, reason = _try_hub(opt, cache_dir) if opt.kind == "hub" else _TRY[opt.kind](opt)
        outcome.steps.append(FallbackStep(_label(opt), module is not None, reason))
        if module is not None:
            outcome.kernel = module
            outcome.chosen = len(outcome.steps) - 1
    return outcome


def resolve_flash_chain(name: str, *, refresh: bool = False) -> FallbackOutcome:
    """Walk (once per process) the chain for ``name`` and return what was found.

    Logs each step once and warns once when the choice is not the first option.

    Raises:
        KeyError: ``name`` has no chain (only ``flash_attention_2`` and ``flash_attention_3`` do).
    """
    with _lock:
        if not refresh and name in _outcomes:
            return _outcomes[name]
        outcome = _walk(name)
        _outcomes[name] = outcome
    for i, step in enumerate(outcome.steps, 1):
        logger.info("%s fallback step %d, %s: %s%s", name, i, step.option, step.reason,
                    " (used)" if outcome.chosen == i - 1 else "")
    if outcome.kernel is not None and outcome.chosen:
        skipped = "; ".join(f"{s.option}: {s.reason}" for s in outcome.steps[: outcome.chosen])
        warnings.warn(
            f"{name} uses {outcome.steps[outcome.chosen].option} ({outcome.steps[outcome.chosen].reason}) because "
            f"{skipped.rstrip('.')}. Run `kernel-loader explain {name}` for the whole chain.",
            UserWarning,
            stacklevel=3,
        )
    return outcome


def flash_chain_kernel(name: str) -> ModuleType:
    """The kernel module the chain picks for ``name``.

    Raises:
        KernelNotFoundError: no option of the chain is usable here (the message holds every reason).
        KeyError: ``name`` has no chain.
    """
    outcome = resolve_flash_chain(name)
    if outcome.kernel is None:
        raise KernelNotFoundError(
            f"attn_implementation={name!r} has no usable FlashAttention kernel on this machine:\n"
            f"{outcome.explain()}\nInstall one of the options above, or use attn_implementation='sdpa'."
        )
    return outcome.kernel


def explain_chain(name: str, *, cache_dir: str | Path | None = None) -> str:
    """Walk the chain for ``name`` afresh (nothing logged or cached) and describe every step.

    ``cache_dir`` is the kernel cache the Hub step looks in (default: ``KERNEL_LOADER_CACHE``).

    Raises:
        KeyError: ``name`` has no chain.
    """
    return _walk(name, Path(cache_dir) if cache_dir is not None else None).explain()


def reset_fallback_cache() -> None:
    """Forget walked chains (for tests, or after installing a package)."""
    with _lock:
        _outcomes.clear()


def chain_attention(name: str) -> Any:
    """The attention function registered as ``name``: FlashAttention through the chain's kernel.

    The kernel is resolved on the first call, so importing kernel_loader never touches the Hub.
    """
    from kernel_loader.attention.backends.flash import flash_attention_forward

    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        kwargs.pop("kernel", None)
        return flash_attention_forward(
            module, query, key, value, attention_mask, kernel=flash_chain_kernel(name), **kwargs
        )

    attention.__name__ = "flash_attention_forward"
    attention.__qualname__ = f"flash_attention_forward[{name}]"
    attention.__doc__ = f"FlashAttention through the {name} fallback chain (see kernel_loader.attention.fallback)."
    return attention
