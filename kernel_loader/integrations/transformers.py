"""transformers bridge: ``attn_implementation="org/kernel-repo"`` through kernel_loader.

transformers hands any kernel id given as ``attn_implementation`` (``"org/repo"``,
``"org/repo@rev"``, ``"org/repo:fn"``, ``"paged|org/repo"``), and its FlashAttention fallback when
the ``flash_attn`` package is missing, to the ``kernels`` package. After :func:`enable` those go
through kernel_loader instead -- whether ``kernels`` is installed or not::

    import kernel_loader.integrations.transformers as klt
    klt.enable()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kernels-community/flash-attn2")
    model.set_attn_implementation("sdpa")

The automatic switch: with ``KERNEL_LOADER_TRANSFORMERS=1`` in the environment, importing this
module enables the bridge.

How it hooks in. Every version in the supported range (4.57.x, 5.17 to 5.24) decides a model's
attention implementation in one method, ``PreTrainedModel._check_and_adjust_attn_implementation``
(called by ``__init__`` -- hence ``from_pretrained`` / ``from_config`` -- and by
``set_attn_implementation``). The bridge wraps that method: a kernel id, or ``flash_attention_2`` /
``flash_attention_3`` when transformers' own check says the FlashAttention package is not
usable, is resolved by kernel_loader (:mod:`kernel_loader.attention`), and the attention function
and mask formatter kernel_loader built for it are registered in transformers' own
``ALL_ATTENTION_FUNCTIONS`` / ``ALL_MASK_ATTENTION_FUNCTIONS`` under the name the model will use.
Everything else goes to transformers unchanged. ``set_attn_implementation`` is wrapped as well, so
that kernel ids inside the per-backbone dict form are registered before transformers validates
them. :func:`disable` puts back exactly what was there: both methods and every registry entry the
bridge added or replaced.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kernel_loader.errors import UnsupportedTransformersVersionError

logger = logging.getLogger(__name__)

__all__ = [
    "ENV_SWITCH",
    "SUPPORTED_RANGE",
    "disable",
    "enable",
    "is_enabled",
    "registered_names",
]

#: The environment variable that enables the bridge when this module is imported.
ENV_SWITCH = "KERNEL_LOADER_TRANSFORMERS"
#: The transformers versions whose internals the bridge was written and tested against.
SUPPORTED_RANGE = "4.57.x, or 5.17 up to and including 5.24"
_SUPPORTED_5X = (17, 24)
_FLASH_NAMES = ("flash_attention_2", "flash_attention_3")
_TRUE = {"1", "true", "yes", "on"}

_MISSING = object()
_lock = threading.RLock()


@dataclass
class _Patch:
    owner: Any
    name: str
    previous: Any  # the owner's own attribute (``_MISSING`` when it was inherited)

    def restore(self) -> None:
        if self.previous is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.previous)


@dataclass
class _State:
    version: str
    flavor: str  # "4.57" (mask formatters take cache_position) or "5" (q_length / q_offset)
    patches: list[_Patch] = field(default_factory=list)
    # (registry global mapping, name) -> what was there before the bridge registered the name
    saved_entries: dict[tuple[int, str], tuple[dict, Any]] = field(default_factory=dict)
    # name asked for -> name registered in transformers (differs for the FlashAttention fallback)
    routes: dict[str, str] = field(default_factory=dict)
    flash_kernels: set[str] = field(default_factory=set)


_state: _State | None = None
_announced_kernels = False


# --------------------------------------------------------------------------------------------
# version check


def _installed_transformers_version() -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python < 3.8
        return None
    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def _flavor_for(version_text: str | None) -> str:
    """``"4.57"`` or ``"5"`` for a supported version.

    Raises:
        UnsupportedTransformersVersionError: transformers is missing or outside the range.
    """
    from packaging.version import InvalidVersion, Version

    fix = "pip install 'transformers>=5.17,<5.25'  (or 'transformers==4.57.*')"
    if version_text is None:
        raise UnsupportedTransformersVersionError(
            f"The transformers bridge needs transformers ({SUPPORTED_RANGE}), which is not installed. "
            f"Install it: {fix}"
        )
    try:
        release = Version(version_text).release
    except InvalidVersion:
        release = ()
    if release[:2] == (4, 57):
        return "4.57"
    if len(release) >= 2 and release[0] == 5 and _SUPPORTED_5X[0] <= release[1] <= _SUPPORTED_5X[1]:
        return "5"
    raise UnsupportedTransformersVersionError(
        f"transformers {version_text} is installed, but the kernel_loader transformers bridge supports "
        f"transformers {SUPPORTED_RANGE} only: it wraps PreTrainedModel._check_and_adjust_attn_implementation "
        f"and set_attn_implementation, whose behaviour changes between releases. Install a supported "
        f"version ({fix}), or call enable(allow_unsupported=True) to try it on this version at your own risk."
    )


# --------------------------------------------------------------------------------------------
# transformers' mask functions, described for kernel_loader's formatters


class _MaskDescriber:
    """Labels transformers' mask functions with kernel_loader's ``mask_kind`` / ``mask_params``.

    kernel_loader's formatters read those labels to refuse patterns a backend cannot express
    (FlashAttention knows causal, sliding window, padding and packed sequences, nothing else).
    transformers builds its patterns from closures made by a handful of factories
    (``and_masks``, ``sliding_window_overlay``, ...); each is recognised by its code object, which
    is exact for the installed version, and its parameters are read from the closure. The
    labelled wrapper evaluates transformers' own function, so the mask values never change.
    """

    def __init__(self, masking_utils: Any) -> None:
        import torch

        self._plain: dict[int, str] = {}
        for attr, kind in (("causal_mask_function", "causal"), ("bidirectional_mask_function", "bidirectional")):
            fn = getattr(masking_utils, attr, None)
            if fn is not None:
                self._plain[id(fn)] = kind
        one = torch.ones(1, 1, dtype=torch.bool)
        zero = torch.zeros(1, dtype=torch.long)
        probe = getattr(masking_utils, "causal_mask_function")
        # factory name -> (probe arguments, kind, how the closure's variables map to params)
        factories: dict[str, tuple[tuple, str, Callable[[dict], dict]]] = {
            "and_masks": ((probe,), "and", lambda v: {"parts": tuple(v["mask_functions"])}),
            "or_masks": ((probe,), "or", lambda v: {"parts": tuple(v["mask_functions"])}),
            "sliding_window_overlay": ((1,), "sliding_window", lambda v: {"window": v["sliding_window"]}),
            "sliding_window_bidirectional_overlay": (
                (1,),
                "sliding_window_bidirectional",
                lambda v: {"window": v["sliding_window"]},
            ),
            "chunked_overlay": ((1, zero), "chunked", lambda v: {"chunk_size": v["chunk_size"]}),
            "_legacy_chunked_overlay": ((1,), "chunked", lambda v: {"chunk_size": v["chunk_size"]}),
            "padding_mask_function": ((one,), "padding", lambda v: {"padding_mask": v["padding_mask"]}),
            "packed_sequence_mask_function": (
                (one,),
                "packed_sequence",
                lambda v: {"packed_sequence_mask": v["packed_sequence_mask"]},
            ),
            "remap_positions_for_packed_sequence": ((probe, one), "remap", lambda v: {"parts": (v["mask_function"],)}),
            "add_offsets_to_mask_function": ((probe, 0, 0), "offset", lambda v: {"parts": (v["mask_function"],)}),
        }
        self._closures: dict[Any, tuple[str, Callable[[dict], dict]]] = {}
        for name, (args, kind, params) in factories.items():
            factory = getattr(masking_utils, name, None)
            if factory is None:
                continue
            try:
                code = factory(*args).__code__
            except Exception:  # a factory whose signature changed: leave its masks unlabelled
                logger.debug("transformers.masking_utils.%s could not be probed", name, exc_info=True)
                continue
            self._closures[code] = (kind, params)

    def describe(self, fn: Any) -> Any:
        """``fn`` wrapped with labels, or ``fn`` itself when it is not one of transformers' own."""
        if fn is None or hasattr(fn, "mask_kind"):
            return fn
        kind = self._plain.get(id(fn))
        params: dict[str, Any] = {}
        if kind is None:
            code = getattr(fn, "__code__", None)
            entry = self._closures.get(code) if code is not None else None
            if entry is None or not fn.__closure__:
                return fn  # a user's own predicate: formatters treat it as "custom"
            kind, to_params = entry
            variables = dict(zip(code.co_freevars, (cell.cell_contents for cell in fn.__closure__)))
            try:
                params = to_params(variables)
            except KeyError:
                return fn
            if "parts" in params:
                params["parts"] = tuple(self.describe(part) for part in params["parts"])

        def labelled(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
            return fn(batch_idx, head_idx, q_idx, kv_idx)

        labelled.mask_kind = kind  # type: ignore[attr-defined]
        labelled.mask_params = params  # type: ignore[attr-defined]
        return labelled


def _adapt_mask_formatter(formatter: Callable[..., Any], describer: _MaskDescriber, flavor: str) -> Callable[..., Any]:
    """kernel_loader's formatter, callable the way this transformers version calls mask formatters.

    transformers 5.x passes ``q_length`` / ``q_offset`` (the signature kernel_loader uses);
    4.57 passes ``cache_position`` (the absolute positions of the queries) instead.
    """

    @functools.wraps(formatter)
    def mask_formatter(*args: Any, **kwargs: Any) -> Any:
        if "mask_function" in kwargs:
            kwargs["mask_function"] = describer.describe(kwargs["mask_function"])
        if flavor == "4.57" and "cache_position" in kwargs:
            cache_position = kwargs.pop("cache_position")
            q_length = int(cache_position.shape[0])
            kwargs["q_length"] = q_length
            kwargs["q_offset"] = int(cache_position[0]) if q_length else 0
        return formatter(*args, **kwargs)

    mask_formatter.__kernel_loader_formatter__ = formatter  # type: ignore[attr-defined]
    return mask_formatter


# --------------------------------------------------------------------------------------------
# routing: which names the bridge handles, and what they become


def _split_wrapper(name: str) -> tuple[str | None, str]:
    if "|" in name:
        wrapper, base = name.split("|", 1)
        return wrapper, base
    return None, name


def _flash_package_usable(name: str) -> bool:
    """transformers' own verdict on the ``flash_attn`` / ``flash_attn_interface`` package."""
    from transformers.utils import import_utils

    check = import_utils.is_flash_attn_2_available if name.endswith("2") else import_utils.is_flash_attn_3_available
    try:
        return bool(check())
    except Exception:
        return False


def _supports_flash(model: Any) -> bool:
    return bool(getattr(model, "_supports_flash_attn", False) or getattr(model, "_supports_flash_attn_2", False))


def _transformers_registries() -> tuple[Any, Any]:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS


def _put(state: _State, registry: Any, name: str, value: Callable[..., Any]) -> None:
    mapping = registry._global_mapping
    key = (id(mapping), name)
    if key not in state.saved_entries:
        state.saved_entries[key] = (mapping, mapping.get(name, _MISSING))
    # Class-level registration, as transformers' own ``register`` does: every instance sees it.
    mapping[name] = value


def _register_in_transformers(state: _State, name: str, attention: Callable[..., Any], mask: Callable[..., Any]) -> None:
    import transformers.masking_utils as masking_utils

    attn_registry, mask_registry = _transformers_registries()
    describer = _describer(masking_utils)
    _put(state, attn_registry, name, attention)
    _put(state, mask_registry, name, _adapt_mask_formatter(mask, describer, state.flavor))


@functools.lru_cache(maxsize=4)
def _describer(masking_utils: Any) -> _MaskDescriber:
    return _MaskDescriber(masking_utils)


def _is_flash_formatter(mask: Callable[..., Any]) -> bool:
    from kernel_loader.attention import mask_formatters

    return mask is mask_formatters.flash_attention_mask


def _load_kernel_backend(state: _State, name: str, trust: bool) -> str:
    """Load ``name`` (a kernel id) through kernel_loader and register it in transformers.

    Raises:
        InvalidKernelRefError: ``name`` looks like a kernel id but is malformed.
        KernelNotFoundError, NoCompatibleVariantError, UntrustedKernelError, UnusableKernelError,
        ...: the kernel cannot be had or used (see the loader's errors).
    """
    from kernel_loader.refs import KernelRef

    KernelRef.parse(name)  # a clear error for a malformed id before anything is fetched
    attention, mask = _kernel_loader_backend(name, trust)
    _register_in_transformers(state, name, attention, mask)
    if _is_flash_formatter(mask):
        state.flash_kernels.add(name)
    state.routes[name] = name
    return name


def _kernel_loader_backend(name: str, trust: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """kernel_loader's attention function and mask formatter for ``name`` (loaded if need be)."""
    from kernel_loader.attention import ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS
    from kernel_loader.attention import kernel_backends

    if name not in ALL_ATTENTION_FUNCTIONS:
        # transformers' allow_all_kernels=True is the user's consent to run code from any org.
        kernel_backends.register_kernel_backend(name, **({"trust_remote_code": True} if trust else {}))
    return ALL_ATTENTION_FUNCTIONS[name], ALL_MASK_ATTENTION_FUNCTIONS[name]


def _flash_fallback(state: _State, requested: str, trust: bool) -> str | None:
    """Resolve ``flash_attention_2`` / ``flash_attention_3`` (package unusable) to a kernel.

    Walks kernel_loader's fallback chain (Hub kernel, then the shipped copy) and returns the
    kernel id now registered in transformers -- what the model's config will hold, as when the
    ``kernels`` package provides transformers' fallback. None when the chain picked the
    FlashAttention package itself (transformers then uses it natively).

    Raises:
        KernelNotFoundError: no option of the chain is usable here (the message holds every reason).
    """
    from kernel_loader.attention import fallback
    from kernel_loader.attention.flash import make_flash_attention
    from kernel_loader.attention.mask_formatters import flash_attention_mask

    wrapper, base = _split_wrapper(requested)
    module = fallback.flash_chain_kernel(base)
    resolution = getattr(module, "__kernel_resolution__", None)
    repo_id = getattr(resolution, "repo_id", None)
    if repo_id is None:
        return None  # the flash_attn / flash_attn_interface package: transformers' own path
    if wrapper is None:
        name = repo_id
        attention, mask = make_flash_attention(module, name), flash_attention_mask
    else:
        name = f"{wrapper}|{repo_id}"
        attention, mask = _kernel_loader_backend(name, trust)
    _register_in_transformers(state, name, attention, mask)
    state.flash_kernels.add(name)
    if state.routes.get(requested) != name:
        # kernel_loader's fallback chain already warned about its choice; this records the name.
        logger.info(
            "attn_implementation=%r: the %s package is not usable here, so transformers will use %s (source: %s) "
            "through kernel_loader. `kernel-loader explain %s` shows the whole fallback chain.",
            requested,
            "flash_attn" if base.endswith("2") else "flash_attn_interface",
            name,
            getattr(resolution, "source", "?"),
            base,
        )
    state.routes[requested] = name
    return name


def _route(state: _State, model: Any, requested: Any, trust: bool) -> str | None:
    """The name to use instead of ``requested`` when the bridge handles it; None otherwise.

    ``model`` is None when the name is meant for a sub-config whose model is not known yet; the
    model's own check runs when it is built.

    Raises:
        ValueError: ``model`` does not support FlashAttention and the kernel is a FlashAttention
            kernel (transformers' own rule).
        KernelLoaderError: the kernel cannot be loaded (see the loader's errors).
    """
    if not isinstance(requested, str):
        return None
    from kernel_loader.refs import looks_like_kernel_ref

    wrapper, base = _split_wrapper(requested)
    compatible = getattr(model, "_compatible_flash_implementations", None) if model is not None else None
    if compatible and "flash" in base and base not in compatible:
        # transformers 5.x rule: a model that lists the FlashAttention kernels it works with gets
        # the first of them instead of another flash implementation.
        logger.warning("%s works with %s only; using %s instead of %s.", type(model).__name__, compatible, compatible[0], base)
        base = compatible[0]
        requested = base if wrapper is None else f"{wrapper}|{base}"
        trust = True  # listed by the model's authors, as transformers treats it
    if base in _FLASH_NAMES:
        if _flash_package_usable(base):
            return None  # the real package is there: transformers uses it natively
        if model is not None and not _supports_flash(model):
            return None  # transformers raises its own, precise error for this model
        return _flash_fallback(state, requested, trust)
    if not looks_like_kernel_ref(requested):
        return None
    name = _load_kernel_backend(state, requested, trust)
    if model is not None and name in state.flash_kernels and not _supports_flash(model):
        raise ValueError(
            f"{type(model).__name__} does not support FlashAttention, so it cannot use the FlashAttention kernel "
            f"{requested!r}. Use attn_implementation='sdpa' or 'eager' for this model."
        )
    return name


def _route_subconfigs(state: _State, config: Any, trust: bool, seen: set[int] | None = None) -> None:
    """Resolve kernel ids held by sub-configs (per-backbone dict form) before sub-models use them.

    Sub-models that are ``PreTrainedModel``s run the wrapped check themselves; this also covers
    backbones built as plain modules, whose name transformers never checks.
    """
    seen = set() if seen is None else seen
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is None or id(sub) in seen:
            continue
        seen.add(id(sub))
        routed = _route(state, None, getattr(sub, "_attn_implementation", None), trust)
        if routed is not None:
            sub._attn_implementation_internal = routed
        _route_subconfigs(state, sub, trust, seen)


def _rewrite_request(state: _State, request: Any, trust: bool, top: bool = True) -> Any:
    """The ``set_attn_implementation`` argument with every sub-config's kernel id registered.

    Dict values for sub-configs are replaced by the name the bridge registered (transformers
    checks them against its registry without loading anything); the top-level value is left to
    the wrapped check, which knows the model.
    """
    if isinstance(request, Mapping):
        rewritten = {}
        for key, value in request.items():
            if key == "" and top:
                rewritten[key] = value
            else:
                rewritten[key] = _rewrite_request(state, value, trust, top=False)
        return rewritten
    if top:
        return request
    routed = _route(state, None, request, trust)
    return request if routed is None else routed


# --------------------------------------------------------------------------------------------
# the two wrapped methods


def _argument(args: tuple, kwargs: dict, position: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def _wrap_check(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _check_and_adjust_attn_implementation(self: Any, attn_implementation: Any = None, *args: Any, **kwargs: Any) -> Any:
        state = _state
        if state is None:  # disabled while a model was being built in another thread
            return original(self, attn_implementation, *args, **kwargs)
        is_init_check = bool(_argument(args, kwargs, 0, "is_init_check", False))
        trust = bool(_argument(args, kwargs, 1, "allow_all_kernels", False))
        with _lock:
            routed = _route(state, self, attn_implementation, trust)
            if is_init_check:
                _route_subconfigs(state, self.config, trust)
        if routed is not None:
            return routed
        return original(self, attn_implementation, *args, **kwargs)

    _check_and_adjust_attn_implementation.__kernel_loader_bridge__ = True  # type: ignore[attr-defined]
    return _check_and_adjust_attn_implementation


def _wrap_set(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def set_attn_implementation(self: Any, attn_implementation: Any, *args: Any, **kwargs: Any) -> Any:
        state = _state
        if state is not None:
            trust = bool(_argument(args, kwargs, 0, "allow_all_kernels", False))
            with _lock:
                attn_implementation = _rewrite_request(state, attn_implementation, trust)
        return original(self, attn_implementation, *args, **kwargs)

    set_attn_implementation.__kernel_loader_bridge__ = True  # type: ignore[attr-defined]
    return set_attn_implementation


def _patch(state: _State, owner: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(owner, name, None)
    if original is None or not callable(original):
        raise UnsupportedTransformersVersionError(
            f"transformers {state.version} has no {owner.__name__}.{name}; the kernel_loader bridge supports "
            f"transformers {SUPPORTED_RANGE}."
        )
    previous = owner.__dict__.get(name, _MISSING)
    state.patches.append(_Patch(owner, name, previous))
    setattr(owner, name, wrap(original))


# --------------------------------------------------------------------------------------------
# public API


def enable(*, allow_unsupported: bool = False, install_flash_attn: bool = False) -> None:
    """Route transformers' kernel ids and FlashAttention fallback through kernel_loader.

    Idempotent. Models built (or switched with ``set_attn_implementation``) while enabled get
    kernel_loader's attention functions; models built before are not touched.

    Args:
        allow_unsupported: try the hook on a transformers version outside ``SUPPORTED_RANGE``
            instead of raising.
        install_flash_attn: also make ``import flash_attn`` / ``flash_attn_interface`` work on
            kernel_loader's kernels (:func:`kernel_loader.install_flash_attn`; process-wide, stays
            after :func:`disable`), for model code that imports flash-attn itself.

    Raises:
        UnsupportedTransformersVersionError: transformers is not installed, or its version is
            outside ``SUPPORTED_RANGE`` (and ``allow_unsupported`` is False), or the methods the
            bridge wraps are missing.
    """
    global _state, _announced_kernels
    if install_flash_attn:
        from kernel_loader.flash_attn_compat import install_flash_attn as install_stand_in

        install_stand_in()
    with _lock:
        if _state is not None:
            return
        version_text = _installed_transformers_version()
        try:
            flavor = _flavor_for(version_text)
        except UnsupportedTransformersVersionError:
            if not allow_unsupported or version_text is None:
                raise
            flavor = "5" if version_text.startswith("5") else "4.57"
            logger.warning("transformers %s is outside %s; the bridge is enabled anyway.", version_text, SUPPORTED_RANGE)
        from transformers import modeling_utils

        state = _State(version=version_text or "?", flavor=flavor)
        model_class = modeling_utils.PreTrainedModel
        try:
            _patch(state, model_class, "_check_and_adjust_attn_implementation", _wrap_check)
            _patch(state, model_class, "set_attn_implementation", _wrap_set)
        except Exception:
            for patch in reversed(state.patches):
                patch.restore()
            raise
        _state = state
        if not _announced_kernels and _kernels_installed():
            _announced_kernels = True
            logger.warning(
                "The `kernels` package is installed; while kernel_loader's transformers bridge is enabled, kernel "
                "ids in attn_implementation and the FlashAttention fallback are loaded by kernel_loader instead. "
                "Call kernel_loader.integrations.transformers.disable() to hand them back to `kernels`."
            )


def disable() -> None:
    """Undo :func:`enable`: restore transformers' methods and registries exactly as they were.

    Names the bridge registered in transformers' ``ALL_ATTENTION_FUNCTIONS`` /
    ``ALL_MASK_ATTENTION_FUNCTIONS`` are removed (or set back to what they replaced), so a model
    still configured with one of them must be switched (``set_attn_implementation``) before its
    next forward pass. Idempotent; raises nothing.
    """
    global _state
    with _lock:
        state = _state
        if state is None:
            return
        _state = None
        for patch in reversed(state.patches):
            patch.restore()
        for (_, name), (mapping, previous) in state.saved_entries.items():
            if previous is _MISSING:
                mapping.pop(name, None)
            else:
                mapping[name] = previous


def is_enabled() -> bool:
    """Whether the bridge is currently active."""
    return _state is not None


def registered_names() -> dict[str, str]:
    """While enabled: each name asked for -> the name registered in transformers for it."""
    state = _state
    return dict(state.routes) if state is not None else {}


def _kernels_installed() -> bool:
    try:
        return importlib.util.find_spec("kernels") is not None
    except (ImportError, ValueError):
        return False


def _env_switch_on() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip().lower() in _TRUE


if _env_switch_on():
    enable()
