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

How it hooks in. Every version in the supported range (4.57.x, 5.17 to 5.25) decides a model's
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

The package by job: ``routing`` (names -> backends, registered in transformers), ``mask_labels``
(re-labelling transformers' mask closures for kernel_loader's formatters), ``patching`` (the two
wrapped methods); this module holds the switch (:func:`enable` / :func:`disable`) and the version
check.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import threading

from kernel_loader.errors import UnsupportedTransformersVersionError
from kernel_loader.integrations.transformers.patching import patch_method, wrap_check, wrap_set
from kernel_loader.integrations.transformers.routing import BridgeState, restore_registries

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
SUPPORTED_RANGE = "4.57.x, or 5.17 up to and including 5.25"
_SUPPORTED_5X = (17, 25)

_lock = threading.RLock()


_state: BridgeState | None = None
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

    fix = f"pip install 'transformers>=5.{_SUPPORTED_5X[0]},<5.{_SUPPORTED_5X[1] + 1}'  (or 'transformers==4.57.*')"
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

        state = BridgeState(version=version_text or "?", flavor=flavor)
        model_class = modeling_utils.PreTrainedModel
        check = functools.partial(wrap_check, current=_current, lock=_lock)
        setter = functools.partial(wrap_set, current=_current, lock=_lock)
        try:
            patch_method(state, model_class, "_check_and_adjust_attn_implementation", check, SUPPORTED_RANGE)
            patch_method(state, model_class, "set_attn_implementation", setter, SUPPORTED_RANGE)
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
        restore_registries(state)


def is_enabled() -> bool:
    """Whether the bridge is currently active."""
    return _state is not None


def registered_names() -> dict[str, str]:
    """While enabled: each name asked for -> the name registered in transformers for it."""
    state = _state
    return dict(state.routes) if state is not None else {}


def _current() -> BridgeState | None:
    return _state


def _kernels_installed() -> bool:
    try:
        return importlib.util.find_spec("kernels") is not None
    except (ImportError, ValueError):
        return False


def _env_switch_on() -> bool:
    from kernel_loader import constants

    return constants.transformers_switch()


if _env_switch_on():
    enable()
