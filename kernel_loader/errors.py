"""Every exception kernel_loader raises, under one base class.

Messages are written for the person at the terminal: what went wrong, what was looked at, and
the command or setting that fixes it.
"""

from __future__ import annotations


class KernelLoaderError(Exception):
    """Base class of every error raised by kernel_loader."""


class InvalidKernelRefError(KernelLoaderError, ValueError):
    """A kernel id does not have one of the accepted forms."""


class KernelNotFoundError(KernelLoaderError, LookupError):
    """No source (local override, cache, Hub, shipped copy) has the requested repo or revision."""


class OfflineKernelMissingError(KernelNotFoundError):
    """Offline (HF_HUB_OFFLINE, local_files_only, or a lock) and the kernel is not in the cache."""


class NoCompatibleVariantError(KernelLoaderError):
    """The repo exists but none of its build variants fits this machine.

    ``decisions`` holds one record per variant with the reason it was rejected.
    """

    def __init__(self, message: str, decisions: list | None = None) -> None:
        super().__init__(message)
        self.decisions = list(decisions or [])


class KernelIntegrityError(KernelLoaderError):
    """Files on disk do not match their recorded digests, or a path leads outside its snapshot."""


class UnsafeRepoContentError(KernelIntegrityError):
    """The Hub or a mirror listed a file name that would land outside the cache (``..``, absolute)."""


class KernelMetadataError(KernelLoaderError):
    """A variant's ``metadata.json`` is too large, not JSON, too deeply nested or has a bad field."""


class UntrustedKernelError(KernelLoaderError):
    """The kernel's org is not trusted; kernels are code and are not imported without consent."""


class MissingDependencyError(KernelLoaderError):
    """The kernel declares Python dependencies that are not installed."""


class KernelImportError(KernelLoaderError, ImportError):
    """The kernel's Python package failed to import."""


class LockfileError(KernelLoaderError):
    """A lock file or pyproject dependency table is missing, unreadable or malformed."""


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


class CacheNotWritableError(KernelLoaderError, PermissionError):
    """A download was needed but the kernel cache is read-only (e.g. a shared cluster cache)."""
