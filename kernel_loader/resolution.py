"""The record of one kernel resolution: what was asked, where it came from, and why.

A :class:`Resolution` travels with every loaded module (``module.__kernel_resolution__``) and
inside every error about a kernel, so ``kernel-loader explain`` and error messages can tell the
whole story: source, revision, sha, chosen variant, and every rejected variant with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

SOURCES = ("local", "cache", "hub", "bundled")


class VariantDecision(NamedTuple):
    """One build variant judged against a machine (an immutable tuple).

    ``rank`` orders accepted variants (0 = preferred); it is None for rejected ones.
    """

    variant: str
    accepted: bool
    reason: str
    rank: int | None = None

    def line(self) -> str:
        """``"  ✓ [0] name: reason"`` / ``"  ✗ name: reason"``."""
        if self.accepted:
            return f"  ok  [{self.rank}] {self.variant}: {self.reason}"
        return f"  no      {self.variant}: {self.reason}"

    def to_json(self) -> dict:
        return {"variant": self.variant, "accepted": self.accepted, "reason": self.reason, "rank": self.rank}


@dataclass
class Resolution:
    """How a kernel id became a folder on disk (and, once imported, a module).

    ``source`` is one of :data:`SOURCES`; ``revision`` the revision asked for (None: latest
    version); ``version`` the ``vN`` asked for; ``sha`` the resolved commit (or, for local and
    shipped repos, a content hash); ``variant`` the chosen build variant; ``path`` its folder.
    """

    requested: str
    source: str
    repo_id: str
    revision: str | None
    sha: str | None
    variant: str | None
    path: Path | None
    decisions: list[VariantDecision] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    version: int | None = None
    resolved_revision: str | None = None
    machine: Any = None
    module_name: str | None = None
    lockfile: str | None = None
    #: why a fallback route was taken (Hub unreachable or not asked, shipped copy); None otherwise
    fallback: str | None = None
    #: variants this resolution downloaded and published (empty: nothing was fetched)
    fetched: list[str] = field(default_factory=list)
    #: the Hub repo type (``kernel`` or ``model``) for Hub and cache sources
    repo_type: str | None = None

    @property
    def rejected(self) -> list[VariantDecision]:
        """The variants that cannot run here, with their reasons."""
        return [d for d in self.decisions if not d.accepted]

    def explain(self) -> str:
        """The whole story, for people: asked → source → revision/sha → variants → notes."""
        lines = [f"kernel {self.requested}"]
        asked = []
        if self.version is not None:
            asked.append(f"version {self.version}")
        if self.revision is not None:
            asked.append(f"revision {self.revision}")
        lines.append(f"  asked:    {', '.join(asked) if asked else 'latest version'}")
        lines.append(f"  source:   {self.source}")
        if self.resolved_revision and self.resolved_revision != self.revision:
            lines.append(f"  revision: {self.resolved_revision}")
        lines.append(f"  sha:      {self.sha or 'unknown'}")
        if self.machine is not None:
            describe = getattr(self.machine, "describe", None)
            lines.append(f"  machine:  {describe() if describe else self.machine}")
        lines.append(f"  variant:  {self.variant or 'none compatible'}")
        if self.path is not None:
            lines.append(f"  path:     {self.path}")
        if self.module_name:
            lines.append(f"  module:   {self.module_name}")
        if self.lockfile:
            lines.append(f"  lock:     {self.lockfile}")
        if self.decisions:
            lines.append("  variants (ok = usable here, [rank] 0 = preferred):")
            lines.extend("  " + d.line() for d in self.decisions)
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """A JSON-ready dict of every field (paths as strings)."""
        machine = self.machine.to_json() if hasattr(self.machine, "to_json") else self.machine
        return {
            "requested": self.requested,
            "source": self.source,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "version": self.version,
            "resolved_revision": self.resolved_revision,
            "sha": self.sha,
            "variant": self.variant,
            "path": str(self.path) if self.path is not None else None,
            "module_name": self.module_name,
            "lockfile": self.lockfile,
            "fallback": self.fallback,
            "fetched": list(self.fetched),
            "repo_type": self.repo_type,
            "machine": machine,
            "decisions": [d.to_json() for d in self.decisions],
            "notes": list(self.notes),
        }
