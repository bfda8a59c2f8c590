"""Fuzzing every text kernel_loader reads from others: kernel ids, variant names, metadata.json,
both lock formats, ``[tool.kernels.dependencies]`` and ``LOCAL_KERNELS``.

Each target asserts three things for every input: only the documented exceptions escape, no file
is opened or listed outside the fuzz folder (an audit hook on ``open``/``os.listdir``/``os.scandir``
watches each call), and reading metadata imports nothing (the hook's ``import`` event). The normal
suite runs a small budget; ``pytest -m fuzz tests/test_fuzz.py`` runs the long one and writes
``bench/results/fuzz.{md,json}``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_loader import deps, integrity, lockfile, metadata, variants
from kernel_loader.errors import (
    InvalidKernelRefError,
    KernelIntegrityError,
    KernelMetadataError,
    LockfileError,
)
from kernel_loader.machine import Machine
from kernel_loader.refs import KernelRef
from kernel_loader.sources import local

ROOT = Path(__file__).resolve().parents[1]
SMALL = 60  # examples per target in the normal suite (a few seconds in all)
LONG = int(os.environ.get("KERNEL_LOADER_FUZZ_EXAMPLES", "17000"))  # per target with -m fuzz: 6 targets, >100k inputs

FUZZ_DIR = Path(tempfile.mkdtemp(prefix="kl-fuzz-"))
VARIANT = FUZZ_DIR / "variant"
(VARIANT / "pkg").mkdir(parents=True, exist_ok=True)
(VARIANT / "pkg" / "__init__.py").write_text("X = 1\n")
(VARIANT / "metadata.json").write_text('{"name": "pkg"}')
MACHINES = [
    Machine("2.13", True, "cpu", None, "x86_64", "linux"),
    Machine("2.8", True, "cuda", "12.8", "x86_64", "linux", (9, 0)),
    Machine("2.7", False, "rocm", "6.3", "x86_64", "linux", None, "gfx942"),
]


class Watch:
    """Audit-hook record of the file accesses and imports made inside ``with watch(kind):``."""

    def __init__(self) -> None:
        self.active: str | None = None
        self.allowed: tuple[str, ...] = (str(FUZZ_DIR),)
        self.outside: list[tuple[str, str]] = []
        self.imports: list[tuple[str, str]] = []
        self.counts: dict[str, int] = {}
        self.failures: dict[str, int] = {}

    def hook(self, event: str, args: tuple) -> None:
        if self.active is None:
            return
        if event in ("open", "os.listdir", "os.scandir"):
            path = args[0] if args else None
            if isinstance(path, int) or path is None:  # an fd already open, or the cwd default
                return
            text = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path)
            if not os.path.abspath(text).startswith(self.allowed):
                self.outside.append((self.active, text))
        elif event == "import" and self.active == "metadata.json":
            # only metadata must import nothing; elsewhere the stdlib may load a module lazily
            # (Path.expanduser("~user") imports pwd)
            self.imports.append((self.active, str(args[0])))

    def __call__(self, kind: str) -> "Watch":
        self.active = kind
        self.counts[kind] = self.counts.get(kind, 0) + 1
        return self

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc) -> None:
        self.active = None


watch = Watch()
sys.addaudithook(watch.hook)  # audit hooks cannot be removed; it does nothing outside `with watch(...)`


def _guard(kind: str, call, allowed: tuple[type[BaseException], ...]) -> None:
    """Run ``call`` under the watch; only ``allowed`` exceptions may escape, and none of the watched events."""
    before_outside, before_imports = len(watch.outside), len(watch.imports)
    try:
        with watch(kind):
            call()
    except allowed:
        pass
    except Exception as exc:  # an undocumented exception: count it and fail the example
        watch.failures[kind] = watch.failures.get(kind, 0) + 1
        raise AssertionError(f"{kind}: undocumented {type(exc).__name__}: {exc}") from exc
    assert len(watch.outside) == before_outside, f"{kind} touched files outside the fuzz folder: {watch.outside[-3:]}"
    assert len(watch.imports) == before_imports, f"{kind} imported modules: {watch.imports[-3:]}"


# -- strategies ---------------------------------------------------------------------------------

ID_CHARS = st.sampled_from(list("abcxyz019-_./@:=~ \\\t\n\x00é") + ["..", "--", "/", "@v1", ":fn", "version="])
ids = st.one_of(st.text(max_size=80), st.lists(ID_CHARS, max_size=30).map("".join),
                st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}/[a-z0-9][a-z0-9._-]{0,20}(@[A-Za-z0-9._/-]{1,12})?(:[a-z_]{1,8})?", fullmatch=True))
VARIANT_PARTS = ["torch", "29", "213", "-cxx11", "-cxx98", "-cu", "128", "130", "-rocm", "63", "-xpu", "-metal", "-cpu",
                 "-x86_64", "-aarch64", "-linux", "-darwin", "-windows", "torch-universal", "torch-cuda", "-stable-abi",
                 "..", "/", "-", "9", ""]
variant_names = st.lists(st.one_of(st.text(max_size=40), st.lists(st.sampled_from(VARIANT_PARTS), max_size=10).map("".join)), max_size=8)
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=20))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                          max_leaves=20)
META_KEYS = ["name", "id", "version", "license", "python-depends", "backend", "type", "archs"]
metadata_objects = st.dictionaries(st.sampled_from(META_KEYS) | st.text(max_size=8), json_value | st.lists(st.text(max_size=20), max_size=3), max_size=6)
metadata_bytes = st.one_of(
    metadata_objects.map(lambda o: json.dumps(o).encode()),
    st.binary(max_size=200),
    st.integers(0, 5000).map(lambda n: b'{"x":' + b"[" * n + b"]" * n + b"}"),
    st.text(max_size=200).map(str.encode),
)
SHA = "a" * 40
lock_variant = st.dictionaries(st.sampled_from(["hash", "hash_type", "files"]) | st.text(max_size=5),
                               st.sampled_from(["sha256-" + "0" * 64, "git_lfs_concat", "sha256_files", "blake3"]) | json_value,
                               max_size=4)
ours_entry = st.fixed_dictionaries({"repo_id": ids | json_value, "sha": st.just(SHA) | json_value},
                                   optional={"variants": st.dictionaries(variant_names.map(lambda n: n[0] if n else "torch-universal"), lock_variant, max_size=3) | json_value,
                                             "version": json_value, "revision": json_value})
kernels_entry = st.fixed_dictionaries({"dependency": st.fixed_dictionaries({"repo-id": ids | json_value}, optional={"version": json_value, "revision": json_value}) | json_value,
                                       "lock": st.fixed_dictionaries({"commit": st.just(SHA) | json_value}) | json_value})
lock_texts = st.one_of(st.lists(ours_entry | kernels_entry, max_size=3).map(json.dumps), json_value.map(json.dumps), st.text(max_size=100))
toml_values = st.one_of(st.integers(), st.booleans(), st.text(max_size=12).map(json.dumps), st.just('{revision = "main"}'),
                        st.just("{version = 2}"), st.just("1.5"), st.just("[1, 2]"), st.text(max_size=12))
pyprojects = st.one_of(
    st.sampled_from(["tool = 1", "[tool]\nkernels = 'x'", "[tool.kernels]\ndependencies = [1]", "[tool.kernels.dependencies]"]),
    st.lists(st.tuples(ids, toml_values), max_size=4).map(
        lambda rows: "[tool.kernels.dependencies]\n" + "".join(f"{json.dumps(k)} = {v}\n" for k, v in rows)),
    st.text(max_size=120),
)
local_kernels = st.one_of(st.text(max_size=80), st.lists(st.tuples(ids, st.text(max_size=20)), max_size=4).map(
    lambda rows: st_join(rows)))


def st_join(rows: list[tuple[str, str]]) -> str:
    return ",".join(f"{k}={v}" for k, v in rows)


# -- the checks ---------------------------------------------------------------------------------


def check_id(text: str) -> None:
    _guard("kernel ids", lambda: KernelRef.parse(text), (InvalidKernelRefError,))


def check_variants(names: list[str]) -> None:
    def call() -> None:
        for machine in MACHINES:
            variants.select_variant(names, machine, None)
            variants.rank_variants(names, machine)

    _guard("variant names", call, ())


def check_metadata(raw: bytes) -> None:
    def call() -> None:
        meta = metadata.parse_metadata(raw, "metadata.json")
        record = meta.to_json()
        for machine in MACHINES:
            variants.arch_rejection(record, machine)
        # installed distributions live on sys.path: the dependency check may look there, and
        # nowhere else, and must import nothing
        watch.allowed = (str(FUZZ_DIR), *map(str, filter(None, sys.path)))
        try:
            deps.missing_dependencies(record)
        finally:
            watch.allowed = (str(FUZZ_DIR),)

    _guard("metadata.json", call, (KernelMetadataError,))


def check_lock(text: str) -> None:
    path = FUZZ_DIR / "kernels.lock"
    path.write_text(text)

    def call() -> None:
        for entry in lockfile.read_lock(path):
            for expected in entry.variants.values():
                try:
                    integrity.verify_lock_variant(VARIANT, expected, entry.repo_id, memo_dir=FUZZ_DIR / "memo")
                except (KernelIntegrityError, LockfileError):
                    pass

    _guard("lock files", call, (LockfileError,))


def check_pyproject(text: str) -> None:
    path = FUZZ_DIR / "pyproject.toml"
    path.write_text(text)
    _guard("[tool.kernels.dependencies]", lambda: lockfile.read_dependencies(path), (LockfileError,))


def check_local_kernels(text: str) -> None:
    _guard("LOCAL_KERNELS", lambda: local.parse_local_kernels(text), (ValueError,))


TARGETS = [
    ("kernel ids", ids, check_id),
    ("variant names", variant_names, check_variants),
    ("metadata.json", metadata_bytes, check_metadata),
    ("lock files", lock_texts, check_lock),
    ("[tool.kernels.dependencies]", pyprojects, check_pyproject),
    ("LOCAL_KERNELS", local_kernels, check_local_kernels),
]


def _make(strategy, check, examples: int):
    @settings(max_examples=examples, deadline=None, database=None, derandomize=examples == SMALL,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(value) -> None:
        check(value)

    return run


@pytest.mark.parametrize("name, strategy, check", TARGETS, ids=[t[0] for t in TARGETS])
def test_small_budget(name, strategy, check):
    _make(strategy, check, SMALL)()


def test_found_by_fuzzing_an_unknown_users_home_in_local_kernels():
    with pytest.raises(ValueError, match="home folder that does not exist"):
        local.parse_local_kernels("a/b=~surely-no-such-user-here/k")


_started = time.perf_counter()


@pytest.mark.fuzz
@pytest.mark.parametrize("name, strategy, check", TARGETS, ids=[t[0] for t in TARGETS])
def test_long_run(name, strategy, check):
    _make(strategy, check, LONG)()


@pytest.mark.fuzz
def test_long_run_report():
    """Writes bench/results/fuzz.{md,json} from the counts of the long run above."""
    elapsed = time.perf_counter() - _started
    total = sum(watch.counts.values())
    assert total >= 100_000 or LONG < 17000, f"only {total} inputs"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    import hypothesis

    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m pytest -m fuzz tests/test_fuzz.py",
        "commit": commit,
        "versions": {"python": sys.version.split()[0], "hypothesis": hypothesis.__version__},
        "inputs": dict(watch.counts),
        "total_inputs": total,
        "seconds": round(elapsed, 1),
        "undocumented_exceptions": sum(watch.failures.values()),
        "file_accesses_outside": len(watch.outside),
        "imports_caused": len(watch.imports),
    }
    out = ROOT / "bench" / "results"
    (out / "fuzz.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = "\n".join(f"| {k} | {v} |" for k, v in watch.counts.items())
    (out / "fuzz.md").write_text(
        f"# Fuzzing the inputs kernel_loader reads from others, {result['date']}\n\n"
        f"`{result['command']}` at commit {commit}; python {result['versions']['python']}, hypothesis "
        f"{result['versions']['hypothesis']}; {total} inputs in {elapsed:.0f} s.\n\n"
        "| input | examples |\n|---|---|\n" + rows + "\n\n"
        f"Undocumented exceptions: {result['undocumented_exceptions']}. File opens/listings outside the fuzz folder: "
        f"{result['file_accesses_outside']} (the dependency check may read the folders on sys.path, where installed "
        f"distributions live). Imports caused: {result['imports_caused']}.\n\n"
        "Found and fixed by this fuzzer: a LOCAL_KERNELS path `~0` (a user that does not exist) raised "
        "RuntimeError from Path.expanduser; it is now a ValueError naming the entry.\n\n"
        "Documented exceptions: InvalidKernelRefError (ids), KernelMetadataError (metadata.json), LockfileError and "
        "KernelIntegrityError (locks), LockfileError (pyproject), ValueError (LOCAL_KERNELS); variant names raise nothing.\n"
    )
    assert result["undocumented_exceptions"] == 0 and not watch.outside and not watch.imports
