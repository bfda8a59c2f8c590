"""Every exception kernel_loader raises, under one base class.

Messages are written for the person at the terminal: what went wrong, what was looked at, and
the command or setting that fixes it. Each class carries the ``kernel-loader`` exit code it maps
to (``exit_code``); :data:`EXIT_CODES` is the table docs/cli.md prints.
"""

from __future__ import annotations


class KernelLoaderError(Exception):
    """Base class of every error raised by kernel_loader."""

    exit_code: int = 1


class UsageError(KernelLoaderError, ValueError):
    """The command line is malformed: an unknown verb or flag, a missing or ill-typed argument."""

    exit_code = 2


class InvalidArgumentError(KernelLoaderError, ValueError):
    """An argument other than the kernel id is invalid (``version``, ``backend``, ``--machine``, a path)."""

    exit_code = 2


class InvalidKernelRefError(KernelLoaderError, ValueError):
    """A kernel id does not have one of the accepted forms."""

    exit_code = 2


class KernelNotFoundError(KernelLoaderError, LookupError):
    """No source (local override, cache, Hub, shipped copy) has the requested repo or revision."""

    exit_code = 3


class KernelFunctionNotFoundError(KernelNotFoundError, AttributeError):
    """The kernel loaded but has no attribute named by the id's ``:function`` part."""


class OfflineKernelMissingError(KernelNotFoundError):
    """Offline (HF_HUB_OFFLINE, local_files_only, or a lock) and the kernel is not in the cache."""


class NoCompatibleVariantError(KernelLoaderError):
    """The repo exists but none of its build variants fits this machine.

    ``decisions`` holds one record per variant with the reason it was rejected.
    """

    exit_code = 4

    def __init__(self, message: str, decisions: list | None = None) -> None:
        super().__init__(message)
        self.decisions = list(decisions or [])


class KernelIntegrityError(KernelLoaderError):
    """Files on disk do not match their recorded digests, or a path leads outside its snapshot."""

    exit_code = 5


class UnsafeRepoContentError(KernelIntegrityError):
    """The Hub or a mirror listed a file name that would land outside the cache (``..``, absolute)."""

    exit_code = 5


class KernelMetadataError(KernelLoaderError):
    """A variant's ``metadata.json`` is too large, not JSON, too deeply nested or has a bad field."""

    exit_code = 5


class UntrustedKernelError(KernelLoaderError):
    """The kernel's org is not trusted; kernels are code and are not imported without consent."""

    exit_code = 6


class MissingDependencyError(KernelLoaderError):
    """The kernel declares Python dependencies that are not installed."""

    exit_code = 7


class KernelImportError(KernelLoaderError, ImportError):
    """The kernel's Python package failed to import."""


class LockfileError(KernelLoaderError):
    """A lock file or pyproject dependency table is missing, unreadable or malformed."""

    exit_code = 2


class UnusableKernelError(KernelLoaderError):
    """A kernel loaded but exports nothing the caller can use (e.g. no attention entry point)."""


class UnknownAttentionBackendError(KernelLoaderError, KeyError):
    """An attention implementation name is neither registered nor a kernel id."""

    def __str__(self) -> str:  # KeyError would otherwise print the message's repr
        return str(self.args[0]) if self.args else ""


class UnsupportedAttentionOptionError(KernelLoaderError, ValueError):
    """An attention backend was asked for an option or mask it cannot honour (e.g. softcap on sdpa)."""


class UnsupportedTransformersVersionError(KernelLoaderError, ImportError):
    """The installed transformers is missing or outside the range the transformers bridge supports."""


class CacheError(KernelLoaderError, OSError):
    """The kernel cache folder cannot be used: not a folder, unreadable, or not writable."""

    exit_code = 8


class CacheNotWritableError(CacheError, PermissionError):
    """A download was needed but the kernel cache is read-only (e.g. a shared cluster cache)."""


class InternalError(KernelLoaderError):
    """A bug in kernel_loader: an unexpected exception, reported by the CLI instead of a traceback."""

    exit_code = 70


#: exit code -> (error classes, meaning), the table of docs/cli.md; 0 is success.
EXIT_CODES: dict[int, tuple[tuple[str, ...], str]] = {
    0: ((), "success"),
    1: (("KernelLoaderError", "KernelImportError", "UnusableKernelError", "UnknownAttentionBackendError",
         "UnsupportedAttentionOptionError", "UnsupportedTransformersVersionError"),
        "any other kernel_loader error (the kernel failed to import, exports nothing usable, ...)"),
    2: (("UsageError", "InvalidKernelRefError", "InvalidArgumentError", "LockfileError", "SettingError"),
        "bad usage: a malformed id, argument, flag, lock file, pyproject table or setting"),
    3: (("KernelNotFoundError", "OfflineKernelMissingError", "KernelFunctionNotFoundError", "KernelDownloadError"),
        "the repo or revision is not found (or not cached while offline / the Hub is unreachable), "
        "or a download broke off"),
    4: (("NoCompatibleVariantError",), "no build variant fits this machine"),
    5: (("KernelIntegrityError", "UnsafeRepoContentError", "KernelMetadataError"),
        "the kernel's files cannot be used as they are: they differ from the completion record or the lock, "
        "a path leads outside the snapshot, the mirror lists unsafe file names, or metadata.json is malformed"),
    6: (("UntrustedKernelError",), "the kernel's org is not trusted"),
    7: (("MissingDependencyError",), "the kernel needs Python packages that are not installed"),
    8: (("CacheError", "CacheNotWritableError", "CacheFullError", "CacheLockError"),
        "the cache folder is not a folder, unreadable, read-only, full, or its download lock cannot be taken"),
    70: (("InternalError",), "a bug in kernel_loader (please report it with the command line)"),
    130: ((), "interrupted (Ctrl-C)"),
}


class SettingError(KernelLoaderError, ValueError):
    """An environment variable read by kernel_loader holds a value it cannot use."""

    exit_code = 2


class KernelDownloadError(KernelLoaderError):
    """A download started but did not complete: the server died or stalled, or a file arrived
    truncated or with the wrong digest. Nothing half-done is ever used; the next call cleans up
    and downloads again."""

    exit_code = 3


class CacheFullError(KernelDownloadError):
    """The disk holding the kernel cache ran out of space during a download."""

    exit_code = 8


class CacheLockError(KernelLoaderError):
    """The per-variant download lock in the cache could not be taken: another process held it past
    ``KERNEL_LOADER_LOCK_TIMEOUT``, or the cache's filesystem has no working file locks."""

    exit_code = 8
