"""``kernel-loader``: download, lock, explain/variants, verify, cache ls/prune, doctor.

Exit codes: 0 success; 1 other kernel_loader error; 2 bad usage or invalid id; 3 not found /
not in the cache; 4 no compatible variant; 5 integrity failure (files differ from the lock);
6 untrusted org; 7 missing Python dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from kernel_loader import errors

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_NO_VARIANT, EXIT_INTEGRITY, EXIT_UNTRUSTED, EXIT_DEPS = range(8)
ATTENTION_BACKENDS = ("flash_attention_2", "flash_attention_3")


def _exit_code(exc: BaseException) -> int:
    for cls, code in (
        (errors.InvalidKernelRefError, EXIT_USAGE),
        (errors.KernelNotFoundError, EXIT_NOT_FOUND),
        (errors.NoCompatibleVariantError, EXIT_NO_VARIANT),
        (errors.KernelIntegrityError, EXIT_INTEGRITY),
        (errors.UntrustedKernelError, EXIT_UNTRUSTED),
        (errors.MissingDependencyError, EXIT_DEPS),
        (errors.LockfileError, EXIT_USAGE),
    ):
        if isinstance(exc, cls):
            return code
    return EXIT_ERROR


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


# -- download -------------------------------------------------------------------------------------


def _download_ref(text: str, version: int | None, all_variants: bool, trust: bool) -> dict:
    from kernel_loader.loader import resolve_kernel
    from kernel_loader.refs import KernelRef
    from kernel_loader.resolver import Request, _pick_ref
    from kernel_loader.sources import hub
    from kernel_loader import cache, trust as trustmod

    ref = KernelRef.parse(text)
    if not all_variants:
        res = resolve_kernel(str(ref), version=version, trust_remote_code=trust)
        if res.source == "bundled":
            raise errors.OfflineKernelMissingError(
                f"Could not download {text}: {res.notes[-1]}. Check HF_ENDPOINT / the network, then retry."
            )
        return {"repo_id": ref.repo_id, "source": res.source, "sha": res.sha, "variants": [res.variant], "path": str(res.path)}
    trustmod.check_trust(ref.repo_id, trust)
    try:
        remote = hub.remote_repo(ref.repo_id)
    except hub.HubUnreachable as exc:
        raise errors.OfflineKernelMissingError(f"Cannot download {text}: the Hub is unreachable ({exc}).") from None
    except hub.HubRepoMissing as exc:
        raise errors.KernelNotFoundError(f"Cannot download {text}: {exc}.") from None
    ref_name, sha = _pick_ref(Request(ref, version=version), remote.versions(), {**remote.tags, **remote.branches}, "on the Hub")
    variants = hub.list_variants(ref.repo_id, remote.repo_type, sha)
    if not variants:
        raise errors.KernelNotFoundError(f"{text}: revision {ref_name} has no build/ variants.")
    snapshot = hub.download_variants(ref.repo_id, remote.repo_type, ref_name, variants, cache.cache_root())
    return {"repo_id": ref.repo_id, "source": "hub", "sha": snapshot.name, "variants": variants, "path": str(snapshot)}


def _download_lock(lock_path: str, all_variants: bool, trust_remote_code: bool = False) -> list[dict]:
    from kernel_loader import cache, integrity, lockfile, trust
    from kernel_loader.machine import detect_machine
    from kernel_loader.sources import hub
    from kernel_loader.variants import select_variant

    results = []
    entries = lockfile.read_lock(lock_path)
    for entry in entries:  # a lock entry is not consent: every org is checked before anything is fetched
        trust.check_trust(entry.repo_id, trust_remote_code)
    for entry in entries:
        try:
            remote = hub.remote_repo(entry.repo_id)
        except hub.HubUnreachable as exc:
            raise errors.OfflineKernelMissingError(f"Cannot download {entry.repo_id}: the Hub is unreachable ({exc}).") from None
        except hub.HubRepoMissing as exc:
            raise errors.KernelNotFoundError(f"Cannot download {entry.repo_id}: {exc}.") from None
        names = list(entry.variants) or hub.list_variants(entry.repo_id, remote.repo_type, entry.sha)
        if all_variants:
            wanted = names
        else:
            root = cache.cache_root()
            chosen, decisions = select_variant(
                names, detect_machine(), lambda v: hub.read_metadata(entry.repo_id, remote.repo_type, entry.sha, v, root)
            )
            if chosen is None:
                raise errors.NoCompatibleVariantError(
                    f"No locked variant of {entry.repo_id} fits this machine:\n" + "\n".join(d.line() for d in decisions),
                    decisions,
                )
            wanted = [chosen]
        snapshot = hub.download_variants(entry.repo_id, remote.repo_type, entry.sha, wanted, cache.cache_root())
        for variant in wanted:
            if variant in entry.variants and entry.variants[variant].get("hash"):
                integrity.verify_lock_variant(
                    snapshot / "build" / variant, entry.variants[variant], f"{entry.repo_id} {variant}",
                    memo_dir=integrity.default_memo_dir(), use_memo=False,
                )
        results.append({"repo_id": entry.repo_id, "source": "hub", "sha": entry.sha, "variants": wanted, "path": str(snapshot)})
    return results


def cmd_download(args: argparse.Namespace) -> int:
    if not args.ids and not args.lock:
        print("kernel-loader download: give kernel ids (org/name[@rev]) or --lock kernels.lock", file=sys.stderr)
        return EXIT_USAGE
    results = []
    if args.lock:
        results += _download_lock(args.lock, args.all_variants, args.trust_remote_code)
    for text in args.ids:
        results.append(_download_ref(text, args.version, args.all_variants, args.trust_remote_code))
    if args.json:
        _print_json(results)
    else:
        for r in results:
            sha = (r["sha"] or "")[:12]
            print(f"{r['repo_id']}@{sha} ({r['source']}): {', '.join(r['variants'])} -> {r['path']}")
    return EXIT_OK


# -- lock -------------------------------------------------------------------------------------------


def cmd_lock(args: argparse.Namespace) -> int:
    from kernel_loader import lockfile, trust

    project = Path(args.project)
    pyproject = project / "pyproject.toml" if project.is_dir() else project
    deps = lockfile.read_dependencies(pyproject)
    entries = []
    for repo_id, spec in deps.items():
        trust.check_trust(repo_id, args.trust_remote_code)
        entries.append(lockfile.lock_entry_from_hub(repo_id, spec))
    out = Path(args.output) if args.output else pyproject.parent / lockfile.LOCK_NAME
    lockfile.write_lock(entries, out, args.format)
    if args.json:
        _print_json({"lockfile": str(out), "kernels": [e.to_json() for e in entries]})
    else:
        for e in entries:
            print(f"locked {e.repo_id}@{e.sha[:12]} ({len(e.variants)} variants)")
        print(f"wrote {out}")
    return EXIT_OK


# -- explain / variants -------------------------------------------------------------------------


def _machine_from_args(args: argparse.Namespace):
    if not getattr(args, "machine", None):
        return None
    from kernel_loader.machine import Machine

    data = json.loads(Path(args.machine).read_text()) if os.path.exists(args.machine) else json.loads(args.machine)
    if data.get("gpu_capability") is not None:
        data["gpu_capability"] = tuple(data["gpu_capability"])
    return Machine(**data)


def cmd_explain(args: argparse.Namespace) -> int:
    if args.name in ATTENTION_BACKENDS:
        from kernel_loader.attention.fallback import explain_chain  # built by the attention layer

        print(explain_chain(args.name))
        return EXIT_OK
    from kernel_loader.loader import resolve_kernel

    try:
        res = resolve_kernel(
            args.name,
            args.revision,
            version=args.version,
            backend=args.backend,
            trust_remote_code=args.trust_remote_code,
            download=False,
            machine=_machine_from_args(args),
        )
    except errors.NoCompatibleVariantError as exc:
        if args.json:
            _print_json({"error": str(exc), "decisions": [d.to_json() for d in exc.decisions]})
        else:
            print(str(exc))
        return EXIT_NO_VARIANT
    if args.json:
        _print_json(res.to_json() if args.command == "explain" else [d.to_json() for d in res.decisions])
    elif args.command == "variants":
        for d in res.decisions:
            print(d.line())
    else:
        print(res.explain())
    return EXIT_OK


# -- verify -----------------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from kernel_loader import integrity, lockfile

    path = Path(args.lock) if args.lock else lockfile.find_lockfile()
    entries = lockfile.read_lock(path) if path is not None else []
    rows = integrity.verify_cache(None, entries, memo_dir=integrity.default_memo_dir())
    statuses = {r["status"] for r in rows}
    code = EXIT_INTEGRITY if "MISMATCH" in statuses else EXIT_NOT_FOUND if "missing" in statuses else EXIT_OK
    if args.json:
        _print_json({"lockfile": str(path) if path is not None else None, "results": rows})
    else:
        for r in rows:
            print(f"{r['status']:8} {r['repo_id']}@{r['sha'][:12]} {r['variant'] or '(not in cache)'}")
            if r["status"] == "MISMATCH":
                print(f"         {r['detail']}")
        if code == EXIT_NOT_FOUND:
            print(f"some locked kernels are not cached: `kernel-loader download --lock {path}`")
    return code


# -- cache --------------------------------------------------------------------------------------------


def cmd_cache(args: argparse.Namespace) -> int:
    from kernel_loader import cache, lockfile

    if args.cache_command == "ls":
        repos = cache.list_cached()
        if args.json:
            _print_json({"cache": str(cache.cache_root()), "repos": [r.to_json() for r in repos]})
            return EXIT_OK
        print(f"cache: {cache.cache_root()}")
        for r in repos:
            print(f"{r.repo_id} ({r.repo_type}, {r.size_bytes / 1e6:.1f} MB)")
            names = {sha: [n for n, s in r.refs.items() if s == sha] for sha in r.snapshots}
            for sha, variants in r.snapshots.items():
                print(f"  {sha[:12]} [{', '.join(names[sha]) or 'no ref'}]: {', '.join(variants)}")
        if not repos:
            print("  (no kernels)")
        return EXIT_OK
    keep = set()
    locks = list(args.keep_lock or [])
    if not locks and lockfile.find_lockfile() is not None:
        locks.append(str(lockfile.find_lockfile()))  # never prune what the project's lock pins
    for lock in locks:
        keep |= {e.sha for e in lockfile.read_lock(lock)}
        if not args.json:
            print(f"keeping the shas pinned in {lock}")
    removed = cache.prune(keep_shas=keep, dry_run=args.dry_run)
    if args.json:
        _print_json({"removed": [str(p) for p in removed], "dry_run": args.dry_run})
    else:
        verb = "would remove" if args.dry_run else "removed"
        for p in removed:
            print(f"{verb} {p}")
        print(f"{verb} {len(removed)} item(s)")
    return EXIT_OK


# -- doctor -------------------------------------------------------------------------------------------


def _endpoint_reachable(endpoint: str, timeout: float = 2.0) -> str:
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout)
        return "reachable"
    except urllib.error.HTTPError as exc:
        return f"reachable (HTTP {exc.code})"
    except (urllib.error.URLError, OSError) as exc:
        return f"unreachable ({getattr(exc, 'reason', exc)})"


def cmd_doctor(args: argparse.Namespace) -> int:
    from kernel_loader import cache, constants
    from kernel_loader.machine import detect_machine
    from kernel_loader.sources import bundled

    machine = detect_machine()
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    root = cache.cache_root()
    from importlib import metadata

    from kernel_loader import __version__

    versions = {"kernel_loader": __version__}
    for dist in ("torch", "huggingface_hub", "transformers", "kernels"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    report = {
        "machine": machine.to_json(),
        "versions": versions,
        "triton": triton_version,
        "cache": {"path": str(root), "exists": root.is_dir(), "writable": os.access(root, os.W_OK) if root.is_dir() else None},
        "endpoint": constants.hf_endpoint(),
        "offline": constants.hf_offline(),
        "endpoint_status": "not checked (offline)" if constants.hf_offline() else _endpoint_reachable(constants.hf_endpoint()),
        "local_kernels": constants.local_kernels(),
        "shipped": bundled.bundled_repo_ids(),
        "shipped_disabled": constants.no_bundled(),
        "trusted_orgs": sorted(constants.trusted_orgs()),
        "state_dir": str(constants.state_dir()),
    }
    if args.json:
        _print_json(report)
        return EXIT_OK
    print(f"machine:   {machine.describe()}")
    print("versions:  " + ", ".join(f"{k} {v}" for k, v in versions.items() if v))
    print(f"triton:    {triton_version or 'not installed'}")
    c = report["cache"]
    print(f"cache:     {c['path']} ({'missing' if not c['exists'] else 'writable' if c['writable'] else 'read-only'})")
    print(f"endpoint:  {report['endpoint']} ({report['endpoint_status']})")
    print(f"offline:   {'yes (HF_HUB_OFFLINE)' if report['offline'] else 'no'}")
    print(f"local:     {report['local_kernels'] or '-'}")
    print(f"shipped:   {', '.join(report['shipped']) or '-'}{' (disabled)' if report['shipped_disabled'] else ''}")
    print(f"trusted:   {', '.join(report['trusted_orgs'])}")
    return EXIT_OK


# -- parser -------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``kernel-loader`` argument parser."""
    parser = argparse.ArgumentParser(prog="kernel-loader", description="Fetch, check and explain kernels from the Hub.")
    parser.add_argument("--cache-dir", help="kernel cache folder (default: KERNEL_LOADER_CACHE, else the HF cache)")
    # Every verb also accepts --cache-dir after it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", dest="sub_cache_dir", metavar="CACHE_DIR", help="kernel cache folder")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("download", parents=[common], help="fetch kernels into the cache (ids or --lock)")
    p.add_argument("ids", nargs="*", help="kernel ids: org/name[@revision]")
    p.add_argument("--lock", help="download every kernel pinned in this lock file")
    p.add_argument("--version", type=int, help="version N (branch vN) for the ids")
    p.add_argument("--all-variants", action="store_true", help="every build variant, not just this machine's")
    p.add_argument("--trust-remote-code", action="store_true", help="allow kernels from orgs outside the trusted list")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_download)

    p = sub.add_parser("lock", parents=[common], help="write kernels.lock from [tool.kernels.dependencies] in pyproject.toml")
    p.add_argument("project", nargs="?", default=".", help="project folder or pyproject.toml (default: .)")
    p.add_argument("--output", "-o", help="lock file path (default: kernels.lock next to pyproject.toml)")
    p.add_argument("--format", choices=("kernel_loader", "kernels"), default="kernel_loader",
                   help="kernel_loader (with content hashes, default) or kernels (the `kernels` 0.17 format)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow kernels from orgs outside the trusted list")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_lock)

    for name, help_text in (
        ("explain", "how a kernel id resolves here: source, sha, variant, and why others were rejected"),
        ("variants", "every build variant of a kernel and whether it fits this machine"),
    ):
        p = sub.add_parser(name, parents=[common], help=help_text)
        p.add_argument("name", help="kernel id (org/name[@rev]) or flash_attention_2 / flash_attention_3")
        p.add_argument("--revision")
        p.add_argument("--version", type=int)
        p.add_argument("--backend", help="restrict to a backend (cpu or this machine's)")
        p.add_argument("--machine", help="judge for another machine: JSON text or file (fields of Machine)")
        p.add_argument("--trust-remote-code", action="store_true", help="allow kernels from orgs outside the trusted list")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=cmd_explain)

    p = sub.add_parser("verify", parents=[common], help="re-hash every cached kernel (against the lock or the download record)")
    p.add_argument("--lock", help="lock file (default: the nearest kernels.lock, if any)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("cache", parents=[common], help="list or prune the kernel cache")
    csub = p.add_subparsers(dest="cache_command", required=True)
    q = csub.add_parser("ls", parents=[common], help="cached kernel repos, revisions and variants")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q = csub.add_parser("prune", parents=[common], help="remove snapshots superseded by newer downloads (locked shas are kept)")
    q.add_argument("--keep-lock", action="append",
                   help="keep the shas pinned in this lock file (repeatable; default: the nearest kernels.lock)")
    q.add_argument("--dry-run", action="store_true")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_cache)

    p = sub.add_parser("doctor", parents=[common], help="torch / backend / GPU / triton / cache / endpoint summary")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    cache_dir = getattr(args, "sub_cache_dir", None) or args.cache_dir
    if cache_dir:
        os.environ["KERNEL_LOADER_CACHE"] = str(Path(cache_dir).expanduser())
    try:
        return args.func(args)
    except errors.KernelLoaderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return _exit_code(exc)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
