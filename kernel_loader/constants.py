"""Every environment variable kernel_loader reads, in one place.

Each value is read when the function is called (not at import time) so that tests, notebooks and
launch scripts can change the environment after ``import kernel_loader``.
"""

from __future__ import annotations

import os
from pathlib import Path

from kernel_loader.errors import SettingError

#: Organisations whose kernels load without ``trust_remote_code=True``.
DEFAULT_TRUSTED_ORGS: frozenset[str] = frozenset({"kernels-community"})

#: The public Hugging Face Hub, used when HF_ENDPOINT is not set.
DEFAULT_ENDPOINT = "https://huggingface.co"

_TRUE = {"1", "true", "yes", "on"}


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def hf_endpoint() -> str:
    """The Hub (or mirror) URL: ``HF_ENDPOINT``, else the public Hub."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hf_token() -> str | None:
    """``HF_TOKEN`` (or the legacy ``HUGGING_FACE_HUB_TOKEN``); None lets huggingface_hub decide."""
    return os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None


def transformers_switch() -> bool:
    """``KERNEL_LOADER_TRANSFORMERS=1``: enable the transformers bridge when it is first imported."""
    return _flag("KERNEL_LOADER_TRANSFORMERS")


def hf_offline() -> bool:
    """``HF_HUB_OFFLINE=1``: never talk to the Hub, use the cache (and shipped copies) only."""
    return _flag("HF_HUB_OFFLINE")


def cache_dir() -> Path:
    """Where kernel repos are cached.

    ``KERNEL_LOADER_CACHE`` wins; otherwise the Hugging Face cache (``HF_HUB_CACHE``, else
    ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), so kernels already fetched by other
    tools are reused.
    """
    explicit = os.environ.get("KERNEL_LOADER_CACHE") or os.environ.get("HF_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    hf_home = os.environ.get("HF_HOME")
    if hf_home:
        return Path(hf_home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def state_dir() -> Path:
    """A user-writable folder for small bookkeeping files (e.g. lock verification results).

    ``KERNEL_LOADER_STATE_DIR``, else ``$XDG_STATE_HOME/kernel_loader``, else
    ``~/.local/state/kernel_loader``. Kept apart from the cache because the cache may be a shared
    read-only filesystem.
    """
    explicit = os.environ.get("KERNEL_LOADER_STATE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "state"
    return base / "kernel_loader"


def local_kernels() -> str | None:
    """``LOCAL_KERNELS``: ``org/a=/path,org/b=/path`` (or ``:``-separated) local overrides."""
    value = os.environ.get("LOCAL_KERNELS")
    return value if value and value.strip() else None


def no_bundled() -> bool:
    """``KERNEL_LOADER_NO_BUNDLED=1``: never fall back to the kernel repos shipped with the package."""
    return _flag("KERNEL_LOADER_NO_BUNDLED")


def trusted_orgs() -> frozenset[str]:
    """Trusted organisations: the defaults plus ``KERNEL_LOADER_TRUSTED_ORGS=org1,org2``."""
    extra = os.environ.get("KERNEL_LOADER_TRUSTED_ORGS", "")
    return DEFAULT_TRUSTED_ORGS | {o.strip() for o in extra.split(",") if o.strip()}


def backend_override() -> str | None:
    """``KERNEL_LOADER_BACKEND``: force a backend (``cpu``, ``cuda``, ...) for variant selection."""
    value = os.environ.get("KERNEL_LOADER_BACKEND", "").strip().lower()
    return value or None


def cuda_visible_devices() -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as set (None when unset), to tell which GPU CUDA calls device 0."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def cuda_device_order() -> str | None:
    """``CUDA_DEVICE_ORDER`` (``PCI_BUS_ID`` makes CUDA number GPUs as the driver does)."""
    return os.environ.get("CUDA_DEVICE_ORDER")


#: Seconds to wait for a Hub connection to open (``KERNEL_LOADER_CONNECT_TIMEOUT``).
DEFAULT_CONNECT_TIMEOUT = 5.0
#: Seconds a Hub connection may stay silent before the call fails (``KERNEL_LOADER_READ_TIMEOUT``).
DEFAULT_READ_TIMEOUT = 10.0
#: How many times a failed Hub call is tried again (``KERNEL_LOADER_RETRIES``).
DEFAULT_RETRIES = 2
#: Seconds a process waits for another one to finish downloading the same variant
#: (``KERNEL_LOADER_LOCK_TIMEOUT``); long enough for a large build on a slow mirror.
DEFAULT_LOCK_TIMEOUT = 600.0


def _number(name: str, default: float, minimum: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not a number; unset it or give one, e.g. {name}={default:g}") from None
    if value < minimum:
        raise SettingError(f"{name}={raw!r} must be at least {minimum:g}; unset it for the default {default:g}")
    return value


def connect_timeout() -> float:
    """``KERNEL_LOADER_CONNECT_TIMEOUT`` (seconds, default 5): opening a connection to the Hub.

    Raises:
        SettingError: the variable is set to something that is not a positive number.
    """
    return _number("KERNEL_LOADER_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT, 0.01)


def read_timeout() -> float:
    """``KERNEL_LOADER_READ_TIMEOUT`` (seconds, default 10): the longest silence of a Hub answer.

    Raises:
        SettingError: the variable is set to something that is not a positive number.
    """
    return _number("KERNEL_LOADER_READ_TIMEOUT", DEFAULT_READ_TIMEOUT, 0.01)


def retries() -> int:
    """``KERNEL_LOADER_RETRIES`` (default 2): extra tries of a Hub call that failed in transit.

    Raises:
        SettingError: the variable is set to something that is not a whole number >= 0.
    """
    return int(_number("KERNEL_LOADER_RETRIES", DEFAULT_RETRIES, 0))


def lock_timeout() -> float:
    """``KERNEL_LOADER_LOCK_TIMEOUT`` (seconds, default 600): waiting for another process's download.

    Raises:
        SettingError: the variable is set to something that is not a positive number.
    """
    return _number("KERNEL_LOADER_LOCK_TIMEOUT", DEFAULT_LOCK_TIMEOUT, 0.0)


#: Seconds a kernel import may run before a warning names it (``KERNEL_LOADER_IMPORT_WARN_S``).
DEFAULT_IMPORT_WARN_SECONDS = 30.0


def import_warn_seconds() -> float:
    """``KERNEL_LOADER_IMPORT_WARN_S``: after this many seconds a still-running kernel import is logged.

    A value that is not a positive number falls back to the default (30 s).
    """
    try:
        value = float(os.environ.get("KERNEL_LOADER_IMPORT_WARN_S", ""))
    except ValueError:
        return DEFAULT_IMPORT_WARN_SECONDS
    return value if value > 0 else DEFAULT_IMPORT_WARN_SECONDS
