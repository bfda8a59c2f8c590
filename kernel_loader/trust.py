"""Who may run code on this machine: kernels are code, so unknown orgs need consent."""

from __future__ import annotations

from kernel_loader import constants
from kernel_loader.errors import UntrustedKernelError


def is_trusted(repo_id: str, trust_remote_code: bool = False) -> bool:
    """Whether ``repo_id`` may be imported: its org is trusted or the caller opted in."""
    return trust_remote_code or repo_id.split("/", 1)[0] in constants.trusted_orgs()


def check_trust(repo_id: str, trust_remote_code: bool = False) -> None:
    """Refuse kernels from orgs that are not trusted (checked before anything is downloaded).

    Trusted: ``kernels-community``, the orgs in ``KERNEL_LOADER_TRUSTED_ORGS``, or anything with
    ``trust_remote_code=True``. Shipped repos and local folders are trusted by their callers.

    Raises:
        UntrustedKernelError: the org is not trusted and ``trust_remote_code`` is False.
    """
    if is_trusted(repo_id, trust_remote_code):
        return
    org = repo_id.split("/", 1)[0]
    trusted = ", ".join(sorted(constants.trusted_orgs()))
    raise UntrustedKernelError(
        f"Kernel {repo_id} is from org {org!r}, which is not trusted (trusted: {trusted}). Kernels are "
        f"code that runs in your process. If you trust it, pass trust_remote_code=True (CLI: --trust-remote-code) or set "
        f"KERNEL_LOADER_TRUSTED_ORGS={org}."
    )
