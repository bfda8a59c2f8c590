"""``kernel-loader``: download, lock, explain/variants, info, versions, verify, cache, doctor.

Exit codes are the ``exit_code`` of each error class (``kernel_loader.errors.EXIT_CODES``, the
table in docs/cli.md). No input ends in a traceback: argparse errors become
:class:`~kernel_loader.errors.UsageError`, anything unexpected becomes a one-line
:class:`~kernel_loader.errors.InternalError`.

This module imports almost nothing at the top and no verb imports torch: ``kernel-loader``
answers in a fraction of a second (the machine is described from torch's installed files, see
``machine.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

from kernel_loader import errors

EXIT_OK = 0
EXIT_ERROR = errors.KernelLoaderError.exit_code
EXIT_USAGE = errors.UsageError.exit_code
EXIT_NOT_FOUND = errors.KernelNotFoundError.exit_code
EXIT_NO_VARIANT = errors.NoCompatibleVariantError.exit_code
EXIT_INTEGRITY = errors.KernelIntegrityError.exit_code
EXIT_UNTRUSTED = errors.UntrustedKernelError.exit_code
EXIT_DEPS = errors.MissingDependencyError.exit_code
EXIT_CACHE = errors.CacheError.exit_code
EXIT_INTERNAL = errors.InternalError.exit_code
EXIT_INTERRUPTED = 130
ATTENTION_BACKENDS = ("flash_attention_2", "flash_attention_3")


def _exit_code(exc: BaseException) -> int:
    return getattr(exc, "exit_code", EXIT_ERROR) if isinstance(exc, errors.KernelLoaderError) else EXIT_INTERNAL


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def _error_json(exc: BaseException, text: str) -> dict:
    return {"type": type(exc).__name__, "exit_code": _exit_code(exc), "message": text}


# -- messages -----------------------------------------------------------------------------------


def _tidy(text: str, args: argparse.Namespace | None, target: str | None = None) -> str:
    """A message as the CLI prints it: no advice to run the command being run, offline made fixable.

    ``target`` is the id the running verb works on. Library messages advise commands in general
    terms; at the terminal, "see `kernel-loader explain X`" printed by `explain X` leads nowhere,
    and under HF_HUB_OFFLINE=1 "fetch it with `kernel-loader download X`" only works once the
    variable is unset.
    """
    from kernel_loader import constants

    verb = getattr(args, "command", None)
    repo = target.split("|")[-1].split("@")[0].split(":")[0] if target else None
    if verb == "explain" and repo:
        cmd = rf"kernel-loader explain {re.escape(repo)}(?:@\S*?)?"
        text = re.sub(rf"\s*\(see `{cmd}`\)", "", text)
        text = re.sub(rf",? or see `{cmd}`", "", text)
        text = re.sub(rf"\s*See `{cmd}`[^.\n]*\.?", "", text)
    if constants.hf_offline():
        text = re.sub(r"`kernel-loader (download|lock)\b", r"`env -u HF_HUB_OFFLINE kernel-loader \1", text)
        if "HF_HUB_OFFLINE" in text and "-u HF_HUB_OFFLINE" not in text and "unset HF_HUB_OFFLINE" not in text:
            text += "\nHF_HUB_OFFLINE=1 keeps kernel-loader off the Hub: unset it (`unset HF_HUB_OFFLINE`) to download."
    return text.strip()


def _warning_formatter(args: argparse.Namespace | None, target: str | None) -> Callable[..., str]:
    """``warnings.formatwarning`` for the CLI: one tidy line, no Python source line."""

    def format_warning(message, category, filename, lineno, line=None) -> str:
        return f"warning: {' '.join(_tidy(str(message), args, target).split())}\n"

    return format_warning


class _ErrorReported(Exception):
    """A verb already printed its per-id errors; carries the exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _each(
    args: argparse.Namespace,
    ids: Iterable[str],
    one: Callable[[str], Any],
    show: Callable[[Any], None],
    listed: bool = False,
    done: list | None = None,
) -> int:
    """Run ``one`` on every id, report each result or error; the exit code of the first failure.

    With ``--json`` the output is the one result (one id, unless ``listed``) or a list with one
    entry per id, after the rows in ``done`` (results the verb already has).
    """
    ids = list(ids)
    rows, code = list(done or []), EXIT_OK
    for text in ids:
        try:
            result = one(text)
        except errors.KernelLoaderError as exc:
            code = code or _exit_code(exc)
            message = _tidy(str(exc), args, text)
            if args.json:
                row = {"id": text, "error": _error_json(exc, message)}
                if isinstance(exc, errors.NoCompatibleVariantError):
                    row["decisions"] = [d.to_json() for d in exc.decisions]
                rows.append(row)
            elif getattr(exc, "explained", False):
                print(message)  # "no build fits, and why" is the answer explain was asked for
            else:
                print(f"error: {message}", file=sys.stderr)
            continue
        if args.json:
            rows.append(result)
        else:
            show(result)
    if args.json:
        single = len(ids) == 1 and not listed
        _print_json(rows[0] if single else rows)
        if single and code:
            raise _ErrorReported(code)
    return code


# -- argument types -----------------------------------------------------------------------------


def _version_arg(text: str) -> int:
    if not text.isdigit() or len(text) > 9:
        raise argparse.ArgumentTypeError(f"expected a non-negative whole number (the N of branch vN), got {text!r}")
    return int(text)


def _parse_id(text: str):
    from kernel_loader.refs import KernelRef

    return KernelRef.parse(text)


def _cache_dir(args: argparse.Namespace) -> Path | None:
    return Path(args.cache_dir).expanduser() if getattr(args, "cache_dir", None) else None


def _check_cache_dir(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise errors.CacheError(f"--cache-dir {path} is a file, not a folder; give a folder (it is created if missing).")


# -- download -------------------------------------------------------------------------------------


def _downloaded(res, what: str, cache_dir: Path | None, version: int | None = None) -> dict:
    """One result row; a resolution that did not come from the Hub or the cache means nothing was fetched."""
    if res.source == "bundled":
        from kernel_loader import constants

        again = f"kernel-loader download {what}" + (f" --version {version}" if version is not None else "")
        check = f" Run it with the Hub allowed: `{again}`" if constants.hf_offline() else " Check HF_ENDPOINT and the network, then retry."
        raise errors.OfflineKernelMissingError(f"Could not download {what}: {res.fallback or res.notes[-1]}.{check}")
    path = res.path
    if len(res.fetched) > 1 or res.variant is None:  # --all-variants: the snapshot holding them
        from kernel_loader import cache

        path = cache.find_snapshot(res.repo_id, res.sha, cache_dir).path
    variants = res.fetched or [res.variant]
    return {"repo_id": res.repo_id, "source": res.source, "sha": res.sha, "variants": variants, "path": str(path)}


def _download_ref(text: str, version: int | None, all_variants: bool, trust: bool, cache_dir: Path | None) -> dict:
    from kernel_loader.refs import KernelRef
    from kernel_loader.resolver import Request, resolve

    req = Request(KernelRef.parse(text), version=version, trust_remote_code=trust, all_variants=all_variants, cache_dir=cache_dir)
    return _downloaded(resolve(req), text, cache_dir, version)


def _check_lock_trust(lock_path: str, trust_remote_code: bool) -> None:
    """Every org a lock names must be trusted: a lock entry pins a sha, it is not consent.

    Raises:
        LockfileError: the lock file is missing or malformed.
        UntrustedKernelError: an entry's org is not trusted and ``trust_remote_code`` is False.
    """
    from kernel_loader import lockfile, trust

    for entry in lockfile.read_lock(lock_path):
        trust.check_trust(entry.repo_id, trust_remote_code)


def _download_lock(lock_path: str, all_variants: bool, trust_remote_code: bool, cache_dir: Path | None) -> list[dict]:
    from kernel_loader import cache, integrity, locking, lockfile
    from kernel_loader.resolver import resolve

    results = []
    for entry in lockfile.read_lock(lock_path):
        req = locking.locked_request(
            entry, Path(lock_path), all_variants=all_variants, cache_dir=cache_dir, trust_remote_code=trust_remote_code
        )
        res = resolve(req)
        results.append(_downloaded(res, f"{entry.repo_id}@{entry.sha[:12]}", cache_dir))
        # The resolver checked the chosen variant against the lock; every other one fetched now is
        # re-hashed here, so nothing downloaded for this lock goes unchecked.
        for variant in res.fetched:
            expected = entry.variants.get(variant)
            if variant != res.variant and expected and expected.get("hash"):
                snapshot = cache.find_snapshot(entry.repo_id, entry.sha, cache_dir)
                assert snapshot is not None
                integrity.verify_lock_variant(
                    snapshot.build_dir / variant, expected, f"{entry.repo_id}@{entry.sha[:12]} variant {variant}",
                    memo_dir=integrity.default_memo_dir(), use_memo=False,
                )
    return results


def _show_download(r: dict) -> None:
    sha = (r["sha"] or "")[:12]
    print(f"{r['repo_id']}@{sha} ({r['source']}): {', '.join(r['variants'])} -> {r['path']}")


def cmd_download(args: argparse.Namespace) -> int:
    from kernel_loader import cache

    if not args.ids and not args.lock:
        raise errors.UsageError("download: give kernel ids (org/name[@rev]) or --lock kernels.lock; see `kernel-loader download --help`.")
    refs = [_parse_id(text) for text in args.ids]  # every id checked before anything is fetched
    if args.lock:  # every locked org is checked before anything is removed or fetched
        _check_lock_trust(args.lock, args.trust_remote_code)
    if args.force:
        # --force: drop the cached copy first so a damaged or partial snapshot is fetched afresh.
        targets = [(r.repo_id, r.revision or _cached_default_revision(r.repo_id, args.version, _cache_dir(args))) for r in refs]
        if args.lock:
            from kernel_loader import lockfile

            targets += [(e.repo_id, e.sha) for e in lockfile.read_lock(args.lock)]
        for repo_id, revision in targets:
            if revision is not None:
                cache.remove(repo_id, revision, _cache_dir(args), keep_refs=True)
    # download never settles for the shipped copy (it says so in its error), so the warning
    # that the shipped copy is in use would only repeat the reason
    warnings.filterwarnings("ignore", message="Using the copy of .* shipped with kernel_loader")
    locked = _download_lock(args.lock, args.all_variants, args.trust_remote_code, _cache_dir(args)) if args.lock else []
    if not args.json:
        for r in locked:
            _show_download(r)
    fetch = lambda t: _download_ref(t, args.version, args.all_variants, args.trust_remote_code, _cache_dir(args))  # noqa: E731
    return _each(args, args.ids, fetch, _show_download, listed=True, done=locked)


def _cached_default_revision(repo_id: str, version: int | None, cache_dir: Path | None) -> str | None:
    """The cached ref an id without ``@rev`` means (``vN``, else the highest ``vN``, else ``main``)."""
    from kernel_loader import cache

    versions = cache.cached_versions(repo_id, cache_dir)
    if version is not None:
        return f"v{version}" if version in versions else None
    if versions:
        return f"v{max(versions)}"
    return "main" if "main" in cache.cached_refs(repo_id, cache_dir) else None


# -- lock -------------------------------------------------------------------------------------------


def cmd_lock(args: argparse.Namespace) -> int:
    from kernel_loader import locking, lockfile

    project = Path(args.project).expanduser()
    pyproject = project / "pyproject.toml" if project.is_dir() else project
    out = Path(args.output).expanduser() if args.output else pyproject.parent / lockfile.LOCK_NAME
    if out.is_dir():
        raise errors.InvalidArgumentError(f"--output {out} is a folder; give a file path, e.g. {out / lockfile.LOCK_NAME}.")
    if not out.parent.is_dir():
        raise errors.InvalidArgumentError(f"--output {out}: the folder {out.parent} does not exist; create it first (`mkdir -p {out.parent}`).")
    deps = lockfile.read_dependencies(pyproject)
    entries = [
        locking.lock_entry(repo_id, spec, cache_dir=_cache_dir(args), trust_remote_code=args.trust_remote_code)
        for repo_id, spec in deps.items()
    ]
    try:
        lockfile.write_lock(entries, out, args.format)
    except OSError as exc:
        raise errors.InvalidArgumentError(f"Cannot write the lock file {out}: {exc.strerror or exc}.") from None
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
    from kernel_loader.machine import BACKENDS, Machine

    fields = list(Machine.__dataclass_fields__)
    text = args.machine
    source = "--machine"
    if not text.lstrip().startswith(("{", "[", '"')):
        try:
            text = Path(text).expanduser().read_text()
            source = f"--machine {args.machine}"
        except (OSError, RuntimeError, ValueError) as exc:
            raise errors.InvalidArgumentError(f"--machine {args.machine!r} is neither JSON text nor a readable file ({exc}).") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise errors.InvalidArgumentError(f"{source} is not valid JSON ({exc}).") from None
    if not isinstance(data, dict):
        raise errors.InvalidArgumentError(f"{source} must be a JSON object with the fields {', '.join(fields)}.")
    unknown = sorted(set(data) - set(fields))
    missing = [f for f in ("torch_version", "backend", "cpu_arch", "os") if f not in data]
    if unknown or missing:
        what = "; ".join(x for x in (unknown and f"unknown fields {', '.join(unknown)}", missing and f"missing {', '.join(missing)}") if x)
        raise errors.InvalidArgumentError(f"{source}: {what}. Fields: {', '.join(fields)}.")
    if data["backend"] not in BACKENDS:
        raise errors.InvalidArgumentError(f"{source}: backend {data['backend']!r} is not one of {', '.join(BACKENDS)}.")
    cap = data.get("gpu_capability")
    if cap is not None:
        if not (isinstance(cap, list) and len(cap) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in cap)):
            raise errors.InvalidArgumentError(f"{source}: gpu_capability must be [major, minor], got {cap!r}.")
        data["gpu_capability"] = tuple(cap)
    for name in ("torch_version", "backend_version", "gpu_arch", "gpu_name"):
        if data.get(name) is not None and not isinstance(data[name], str):
            raise errors.InvalidArgumentError(f"{source}: {name} must be a string (e.g. \"2.8\") or null.")
    for name in ("cpu_arch", "os"):
        if not isinstance(data[name], str):
            raise errors.InvalidArgumentError(f"{source}: {name} must be a string.")
    if data.get("cxx11_abi") is not None and not isinstance(data["cxx11_abi"], bool):
        raise errors.InvalidArgumentError(f"{source}: cxx11_abi must be true, false or null.")
    return Machine(**{"cxx11_abi": None, "backend_version": None, **data})


def _offline_listing(res, cache_dir: Path | None) -> list[str] | None:
    """Every variant of the resolved revision as the completion records list them; None if unknown."""
    from kernel_loader import cache, integrity

    if res.source != "cache" or not res.sha:
        return None
    names: set[str] = set()
    for repo_type in cache.REPO_TYPES:
        folder = cache.repo_folder(res.repo_id, repo_type, cache_dir) / "kernel-loader" / res.sha
        for record in sorted(folder.glob("*.json")) if folder.is_dir() else ():
            try:
                names |= set(integrity.read_record(record).variants)
            except errors.KernelIntegrityError:
                continue
    return sorted(names) or None


def _whole_story(res, backend: str | None, cache_dir: Path | None) -> None:
    """Add the revision's variants that are not in the cache (offline explain) to ``res.decisions``."""
    from kernel_loader.resolution import VariantDecision
    from kernel_loader.variants import rank_variants

    if res.source != "cache":
        return
    listing = _offline_listing(res, cache_dir)
    if listing is None:
        res.notes.append("the Hub was not asked and no completion record lists the revision's builds: the full "
                         "variant listing of this revision is unknown")
        return
    have = {d.variant for d in res.decisions}
    for d in rank_variants([v for v in listing if v not in have], res.machine, backend):
        reason = f"fits ({d.reason}) but is not in the cache" if d.accepted else d.reason
        res.decisions.append(VariantDecision(d.variant, False, reason, None))
    res.notes.append(f"variant listing of {res.sha[:12]} from the record written at download ({len(listing)} variants)")


def _explain_one(args: argparse.Namespace, name: str):
    from kernel_loader.loader import resolve_kernel

    if name in ATTENTION_BACKENDS:
        from kernel_loader.attention.fallback import explain_chain  # built by the attention layer

        from kernel_loader.flash_attn_compat import describe as describe_stand_in

        return ("chain", explain_chain(name, cache_dir=_cache_dir(args)) + "\n" + describe_stand_in(name))
    try:
        res = resolve_kernel(
            name,
            args.revision,
            version=args.version,
            backend=args.backend,
            trust_remote_code=args.trust_remote_code,
            download=False,
            machine=_machine_from_args(args),
            cache_dir=_cache_dir(args),
        )
    except errors.NoCompatibleVariantError as exc:
        exc.explained = True  # type: ignore[attr-defined]
        raise
    _whole_story(res, args.backend, _cache_dir(args))
    return ("res", res)


def cmd_explain(args: argparse.Namespace) -> int:
    explain = args.command == "explain"
    if args.backend is not None:
        from kernel_loader.refs import check_backend

        check_backend(args.backend)
    _machine_from_args(args)  # a bad --machine is reported once, not per id

    def one(name: str):
        kind, value = _explain_one(args, name)
        if not args.json:
            return (kind, value)
        if kind == "chain":
            return {"id": name, "chain": value}
        if explain:
            return value.to_json()
        decisions = [d.to_json() for d in value.decisions]
        return decisions if len(args.ids) == 1 else {"id": name, "decisions": decisions}

    def show(item) -> None:
        kind, value = item
        if kind == "chain":
            print(value)
        elif explain:
            print(value.explain())
        else:
            if len(args.ids) > 1:
                print(f"{value.repo_id}@{(value.sha or '?')[:12]} ({value.source}):")
            for d in value.decisions:
                print(d.line())
        if len(args.ids) > 1:
            print()

    return _each(args, args.ids, one, show)


# -- info / versions -----------------------------------------------------------------------------


def _metadata_summary(build: dict[str, dict | None]) -> dict:
    """What every variant's metadata.json says about the kernel, merged (first value wins)."""
    from kernel_loader.variants import parse_variant

    info: dict[str, Any] = {}
    depends: set[str] = set()
    for meta in build.values():
        if not isinstance(meta, dict):
            continue
        for key in ("name", "version", "license", "upstream", "source"):
            value = meta.get(key)
            if key not in info and isinstance(value, (str, int)) and not isinstance(value, bool):
                info[key] = value
        deps = meta.get("python-depends") or meta.get("python_depends") or []
        if isinstance(deps, list):
            depends |= {d for d in deps if isinstance(d, str)}
    backends = set()
    for name, meta in build.items():
        declared = meta.get("backend") if isinstance(meta, dict) else None
        backend = parse_variant(name).backend or (declared.get("type") if isinstance(declared, dict) else None)
        if isinstance(backend, str) and backend:
            backends.add("any" if backend == "universal" else backend)
    return {**{k: info.get(k) for k in ("name", "version", "license", "upstream", "source")},
            "python_depends": sorted(depends), "backends": sorted(backends), "builds": sorted(build)}


def _readable_metadata(variant_dir: Path) -> dict | None:
    """A variant's metadata for ``info``; a malformed file says nothing (info describes, it never fails on it)."""
    from kernel_loader import metadata

    try:
        return metadata.variant_metadata(variant_dir)
    except errors.KernelMetadataError:
        return None


def _info(args: argparse.Namespace, text: str) -> dict:
    from kernel_loader import constants

    try:
        path = Path(text).expanduser()
    except RuntimeError:
        raise errors.InvalidArgumentError(f"{text!r} names an unknown user's home folder.") from None
    if path.is_dir() or text.startswith((".", "/", "~")):
        from kernel_loader.sources import local

        if not path.is_dir():
            raise errors.KernelNotFoundError(f"{text}: no such folder.")
        build_dir, single = local.build_folder(path, text)
        names = [single] if single else local.list_variants(build_dir)
        build = {n: _readable_metadata(build_dir / n) for n in names}
        return {"path": str(path.resolve()), **_metadata_summary(build)}
    ref = _parse_id(text)
    if args.revision is not None and args.version is not None:
        raise errors.InvalidArgumentError("info: give --revision or --version, not both.")
    ref = ref.with_revision(args.revision) if args.revision else ref
    if constants.hf_offline():
        return _info_cached(ref, args)
    from kernel_loader.resolver import Request, resolve

    # The resolver picks the revision and sha and lists every build; nothing is downloaded or
    # imported (info only reads metadata.json, so the org needs no trust).
    res = resolve(Request(ref, version=args.version, download=False, all_variants=True, shipped=False,
                          trust_remote_code=True, cache_dir=_cache_dir(args)))
    if res.source != "hub":  # the Hub did not answer: what the cache has
        return _info_cached(ref, args)
    names = [d.variant for d in res.decisions]
    build = _hub_metadata(ref.repo_id, res.repo_type, res.sha, names)
    return {"repo_id": ref.repo_id, "revision": res.resolved_revision, "sha": res.sha, "origin": "hub", **_metadata_summary(build)}

def _remote_repo(repo_id: str):
    """The repo's refs on the Hub, its failures as our errors (info and versions)."""
    from kernel_loader.sources import hub

    try:
        return hub.remote_repo(repo_id, hub.HubSettings.from_env())
    except hub.HubUnreachable as exc:
        raise errors.OfflineKernelMissingError(
            f"{repo_id}: {exc.summary}; `kernel-loader cache ls` shows what is cached."
        ) from None
    except hub.HubRepoMissing as exc:
        raise errors.KernelNotFoundError(f"{repo_id}: {exc.summary}. Check the id (and HF_ENDPOINT).") from None


def _hub_metadata(repo_id: str, repo_type: str, sha: str, names: list[str]) -> dict[str, dict | None]:
    """Each variant's metadata.json, read straight from the Hub: info writes nothing into the cache."""
    from kernel_loader.sources import hub

    settings = hub.HubSettings.from_env()
    build: dict[str, dict | None] = {}
    for n in names:
        try:
            build[n] = hub.fetch_metadata(repo_id, repo_type, sha, n, settings)
        except errors.KernelMetadataError:  # as for a local folder: info describes, it never fails on it
            build[n] = None
    return build


def _info_cached(ref, args: argparse.Namespace) -> dict:
    from kernel_loader import cache

    revision = ref.revision or _cached_default_revision(ref.repo_id, args.version, _cache_dir(args))
    snapshot = cache.find_snapshot(ref.repo_id, revision, _cache_dir(args)) if revision else None
    if snapshot is None:
        raise errors.OfflineKernelMissingError(
            f"{ref.repo_id}{'@' + revision if revision else ''} is not in the cache {cache.cache_root(_cache_dir(args))} "
            f"and the Hub is not used. Fetch it with `kernel-loader download {ref}`."
        )
    build = {n: _readable_metadata(snapshot.build_dir / n) for n in snapshot.variants()}
    return {"repo_id": ref.repo_id, "revision": revision, "sha": snapshot.sha, "origin": "cache", **_metadata_summary(build)}


def _show_info(info: dict) -> None:
    def show(v: Any) -> str:
        return "-" if v in (None, [], "") else ", ".join(v) if isinstance(v, list) else str(v)

    if "path" in info:
        print(f"path:       {info['path']}")
    else:
        print(f"repo:       {info['repo_id']}  ({info['origin']})")
        print(f"revision:   {info['revision']} ({info['sha'][:12]})")
    for key in ("name", "version", "license", "upstream"):
        print(f"{key + ':':11} {show(info.get(key))}")
    print(f"backends:   {show(info['backends'])}")
    print(f"builds:     {show(info['builds'])}")
    print(f"deps:       {show(info['python_depends'])}")


def cmd_info(args: argparse.Namespace) -> int:
    return _each(args, args.ids, lambda t: _info(args, t), _show_info)


def _versions(args: argparse.Namespace, text: str) -> dict:
    from kernel_loader import cache, constants
    from kernel_loader.machine import detect_machine
    from kernel_loader.variants import rank_variants

    ref = _parse_id(text)
    if ref.revision is not None:
        raise errors.InvalidArgumentError(f"versions: give org/name without '@{ref.revision}'; it lists every vN branch.")
    machine = detect_machine()
    rows = []
    if constants.hf_offline():
        source = "cache"
        for number, sha in sorted(cache.cached_versions(ref.repo_id, _cache_dir(args)).items()):
            snapshot = cache.find_snapshot(ref.repo_id, sha, _cache_dir(args))
            names = snapshot.variants() if snapshot else []
            rows.append((number, sha, names))
    else:
        from kernel_loader.sources import hub

        source = "hub"
        remote = _remote_repo(ref.repo_id)
        settings = hub.HubSettings.from_env()
        for number, sha in sorted(remote.versions().items()):
            rows.append((number, sha, hub.list_variants(ref.repo_id, remote.repo_type, sha, settings)))
    versions = []
    for number, sha, names in rows:
        usable = [d.variant for d in rank_variants(names, machine) if d.accepted]
        versions.append({"version": number, "branch": f"v{number}", "sha": sha, "variants": sorted(names),
                         "usable_here": usable})
    return {"repo_id": ref.repo_id, "source": source, "machine": machine.describe(), "versions": versions}


def _show_versions(data: dict) -> None:
    print(f"{data['repo_id']} ({data['source']}; this machine: {data['machine']})")
    if not data["versions"]:
        print("  no vN branches: the repo is used at main (or a tag / sha)")
    for v in data["versions"]:
        fit = f"usable here: {v['usable_here'][0]}" if v["usable_here"] else "no build for this machine"
        print(f"  {v['branch']:5} {v['sha'][:12]}  {len(v['variants'])} builds, {fit}")


def cmd_versions(args: argparse.Namespace) -> int:
    return _each(args, args.ids, lambda t: _versions(args, t), _show_versions)


# -- verify -----------------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from kernel_loader import integrity, lockfile

    path = Path(args.lock).expanduser() if args.lock else lockfile.find_lockfile()
    entries = lockfile.read_lock(path) if path is not None else []
    rows = integrity.verify_cache(_cache_dir(args), entries, memo_dir=integrity.default_memo_dir())
    statuses = {r["status"] for r in rows}
    code = (EXIT_INTEGRITY if statuses & {"MISMATCH", "unlocked"} else EXIT_NOT_FOUND if "missing" in statuses
            else EXIT_OK)
    if args.json:
        _print_json({"lockfile": str(path) if path is not None else None, "results": rows})
        if code:
            raise _ErrorReported(code)
        return code
    for r in rows:
        print(f"{r['status']:8} {r['repo_id']}@{r['sha'][:12]} {r['variant'] or '(not in cache)'}")
        if r["status"] != "ok":
            print("         " + r["detail"].replace("\n", "\n         "))
    if "missing" in statuses:
        print(f"some locked kernels are not cached: `kernel-loader download --lock {path}`")
    return code


# -- cache --------------------------------------------------------------------------------------------


def _cache_ls(args: argparse.Namespace) -> int:
    from kernel_loader import cache

    repos = cache.list_cached(_cache_dir(args))
    root = cache.cache_root(_cache_dir(args))
    if args.json:
        _print_json({"cache": str(root), "repos": [r.to_json() for r in repos]})
        return EXIT_OK
    print(f"cache: {root}")
    for r in repos:
        print(f"{r.repo_id} ({r.repo_type}, {r.size_bytes / 1e6:.1f} MB)")
        names = {sha: [n for n, s in r.refs.items() if s == sha] for sha in r.snapshots}
        for sha, variants in r.snapshots.items():
            print(f"  {sha[:12]} [{', '.join(names[sha]) or 'no ref'}]: {', '.join(variants) or 'no complete variant'}")
    if not repos:
        print("  (no kernels)")
    return EXIT_OK


def _cache_prune(args: argparse.Namespace) -> int:
    from kernel_loader import cache, lockfile

    keep = set()
    locks = list(args.keep_lock or [])
    if not locks and lockfile.find_lockfile() is not None:
        locks.append(str(lockfile.find_lockfile()))  # never prune what the project's lock pins
    for lock in locks:
        keep |= {e.sha for e in lockfile.read_lock(lock)}
        if not args.json:
            print(f"keeping the shas pinned in {lock}")
    removed = cache.prune(_cache_dir(args), keep_shas=keep, dry_run=args.dry_run)
    if args.json:
        _print_json({"removed": [str(p) for p in removed], "dry_run": args.dry_run})
        return EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    for p in removed:
        print(f"{verb} {p}")
    print(f"{verb} {len(removed)} item(s)")
    return EXIT_OK


def _cache_rm(args: argparse.Namespace) -> int:
    from kernel_loader import cache

    def one(text: str) -> dict:
        ref = _parse_id(text)
        removed = cache.remove(ref.repo_id, ref.revision, _cache_dir(args))
        if not removed:
            what = f"{ref.repo_id}@{ref.revision}" if ref.revision else ref.repo_id
            raise errors.KernelNotFoundError(f"{what} is not in the cache {cache.cache_root(_cache_dir(args))}; `kernel-loader cache ls` lists what is.")
        return {"id": text, "removed": [str(p) for p in removed]}

    def show(r: dict) -> None:
        for p in r["removed"]:
            print(f"removed {p}")

    return _each(args, args.ids, one, show, listed=True)


def cmd_cache(args: argparse.Namespace) -> int:
    return {"ls": _cache_ls, "prune": _cache_prune, "rm": _cache_rm}[args.cache_command](args)


# -- doctor -------------------------------------------------------------------------------------------


def _endpoint_reachable(endpoint: str, timeout: float = 2.0) -> str:
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout)
        return "reachable"
    except urllib.error.HTTPError as exc:
        return f"reachable (HTTP {exc.code})"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"unreachable ({getattr(exc, 'reason', exc)})"


def cmd_doctor(args: argparse.Namespace) -> int:
    import os
    from importlib import metadata

    from kernel_loader import __version__, cache, constants
    from kernel_loader.machine import detect_machine
    from kernel_loader.sources import bundled

    machine = detect_machine()
    root = cache.cache_root(_cache_dir(args))
    versions = {"kernel_loader": __version__}
    for dist in ("torch", "triton", "huggingface_hub", "transformers", "kernels"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    try:
        local_kernels = constants.local_kernels()
        if local_kernels:
            from kernel_loader.sources import local

            local.parse_local_kernels(local_kernels)
        local_status = local_kernels or "-"
    except ValueError as exc:
        local_status = f"invalid: {exc}"
    report = {
        "machine": machine.to_json(),
        "versions": versions,
        "triton": versions["triton"],
        "cache": {"path": str(root), "exists": root.is_dir(), "writable": os.access(root, os.W_OK) if root.is_dir() else None},
        "endpoint": constants.hf_endpoint(),
        "offline": constants.hf_offline(),
        "endpoint_status": "not checked (offline)" if constants.hf_offline() else _endpoint_reachable(constants.hf_endpoint()),
        "local_kernels": local_status,
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
    c = report["cache"]
    print(f"cache:     {c['path']} ({'missing' if not c['exists'] else 'writable' if c['writable'] else 'read-only'})")
    print(f"endpoint:  {report['endpoint']} ({report['endpoint_status']})")
    print(f"offline:   {'yes (HF_HUB_OFFLINE; `unset HF_HUB_OFFLINE` to use the Hub)' if report['offline'] else 'no'}")
    print(f"local:     {report['local_kernels']}")
    print(f"shipped:   {', '.join(report['shipped']) or '-'}{' (disabled)' if report['shipped_disabled'] else ''}")
    print(f"trusted:   {', '.join(report['trusted_orgs'])}")
    return EXIT_OK


# -- parser -------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes are :class:`UsageError` (exit 2, one line, JSON with --json)."""

    def error(self, message: str):  # type: ignore[override]
        raise errors.UsageError(f"{self.prog}: {message}. See `{self.prog} --help`.")


def _global_flags() -> argparse.ArgumentParser:
    # Added to the root parser and every verb and sub-verb: SUPPRESS leaves a flag unset where it
    # is not given, so `--json cache ls` and `cache ls --json` mean the same.
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--cache-dir", default=argparse.SUPPRESS, metavar="DIR",
                       help="kernel cache folder (default: KERNEL_LOADER_CACHE, else the Hugging Face cache)")
    flags.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                       help="machine-readable output (errors too)")
    return flags


def build_parser() -> argparse.ArgumentParser:
    """The ``kernel-loader`` argument parser."""
    from kernel_loader import __version__

    flags = _global_flags()
    parser = _Parser(prog="kernel-loader", description="Fetch, check and explain kernels from the Hub.", parents=[flags])
    parser.add_argument("--version", action="version", version=f"kernel-loader {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="VERB", parser_class=_Parser)
    trust_help = "allow kernels from orgs outside the trusted list"

    p = sub.add_parser("download", parents=[flags], help="fetch kernels into the cache (ids or --lock)")
    p.add_argument("ids", nargs="*", metavar="ID", help="kernel ids: org/name[@revision]")
    p.add_argument("--lock", help="download every kernel pinned in this lock file")
    p.add_argument("--version", type=_version_arg, help="version N (branch vN) for the ids")
    p.add_argument("--all-variants", action="store_true", help="every build variant, not just this machine's")
    p.add_argument("--force", action="store_true", help="remove the cached copy first (repairs a damaged or partial snapshot)")
    p.add_argument("--trust-remote-code", action="store_true", help=trust_help)
    p.set_defaults(func=cmd_download)

    p = sub.add_parser("lock", parents=[flags], help="write kernels.lock from [tool.kernels.dependencies] in pyproject.toml")
    p.add_argument("project", nargs="?", default=".", help="project folder or pyproject.toml (default: .)")
    p.add_argument("--output", "-o", help="lock file path (default: kernels.lock next to pyproject.toml)")
    p.add_argument("--format", choices=("kernel_loader", "kernels"), default="kernel_loader",
                   help="kernel_loader (with content hashes, default) or kernels (the `kernels` 0.17 format)")
    p.add_argument("--trust-remote-code", action="store_true", help=trust_help)
    p.set_defaults(func=cmd_lock)

    for name, help_text in (
        ("explain", "how kernel ids resolve here: source, sha, variant, and why others were rejected"),
        ("variants", "every build variant of kernels and whether each fits this machine"),
    ):
        p = sub.add_parser(name, parents=[flags], help=help_text)
        p.add_argument("ids", nargs="+", metavar="ID", help="kernel ids (org/name[@rev]) or flash_attention_2 / flash_attention_3")
        p.add_argument("--revision")
        p.add_argument("--version", type=_version_arg, help="version N (branch vN)")
        p.add_argument("--backend", help="restrict to a backend (cpu or this machine's)")
        p.add_argument("--machine", help="judge for another machine: JSON text or a file (fields of Machine)")
        p.add_argument("--trust-remote-code", action="store_true", help=trust_help)
        p.set_defaults(func=cmd_explain)

    p = sub.add_parser("info", parents=[flags], help="name, version, license, upstream, backends, builds and Python deps")
    p.add_argument("ids", nargs="+", metavar="ID", help="org/name[@rev], or a local kernel folder")
    p.add_argument("--revision")
    p.add_argument("--version", type=_version_arg, help="version N (branch vN)")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("versions", parents=[flags], help="the vN branches of kernels and which have a build for this machine")
    p.add_argument("ids", nargs="+", metavar="ID", help="org/name")
    p.set_defaults(func=cmd_versions)

    p = sub.add_parser("verify", parents=[flags], help="re-hash every cached kernel (against the lock or the download record)")
    p.add_argument("--lock", help="lock file (default: the nearest kernels.lock, if any)")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("cache", parents=[flags], help="list, prune or remove cached kernels")
    csub = p.add_subparsers(dest="cache_command", required=True, metavar="SUBVERB", parser_class=_Parser)
    csub.add_parser("ls", parents=[flags], help="cached kernel repos, revisions and variants")
    q = csub.add_parser("prune", parents=[flags], help="remove snapshots superseded by newer downloads (locked shas are kept)")
    q.add_argument("--keep-lock", action="append",
                   help="keep the shas pinned in this lock file (repeatable; default: the nearest kernels.lock)")
    q.add_argument("--dry-run", action="store_true", help="list exactly what prune would remove, remove nothing")
    q = csub.add_parser("rm", parents=[flags], help="remove a cached kernel (org/name) or one revision (org/name@rev)")
    q.add_argument("ids", nargs="+", metavar="ID", help="org/name[@rev]")
    p.set_defaults(func=cmd_cache)

    p = sub.add_parser("doctor", parents=[flags], help="torch / backend / GPU / triton / cache / endpoint summary")
    p.set_defaults(func=cmd_doctor)

    from kernel_loader import warmup  # the verb lives with its code (kernel_loader/warmup.py)

    warmup.add_cli(sub, flags)
    return parser


def _run(args: argparse.Namespace) -> int:
    cache_dir = _cache_dir(args)
    if cache_dir is not None:
        _check_cache_dir(cache_dir)
    return args.func(args)  # each verb passes _cache_dir(args) on to the library


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the table in docs/cli.md)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    old_formatwarning = warnings.formatwarning
    warnings.formatwarning = _warning_formatter(None, None)
    try:
        with warnings.catch_warnings():  # a verb's filters end with it (main may run in-process)
            return _main(argv, as_json)
    finally:
        warnings.formatwarning = old_formatwarning


def _main(argv: list[str], as_json: bool) -> int:
    args: argparse.Namespace | None = None
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:  # --help / --version
            return int(exc.code or 0) if isinstance(exc.code, int) or exc.code is None else EXIT_USAGE
        args.json = getattr(args, "json", False)
        ids = getattr(args, "ids", None) or [None]
        warnings.formatwarning = _warning_formatter(args, ids[0] if len(ids) == 1 else None)
        return _run(args)
    except _ErrorReported as exc:
        return exc.code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # the CLI's promise: one line, no traceback
        if not isinstance(exc, errors.KernelLoaderError):
            exc = errors.InternalError(
                f"unexpected {type(exc).__name__}: {exc}. This is a bug in kernel_loader; please report it with the command line."
            )
        message = str(exc) if isinstance(exc, errors.InternalError) else _tidy(str(exc), args)
        if as_json:
            _print_json({"error": _error_json(exc, message)})
        else:
            print(f"error: {message}", file=sys.stderr)
        return _exit_code(exc)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
