"""Integrity on every load: completion records, lock hashes of both types, the ctime-keyed memo,
and `kernel-loader verify` over a whole cache."""

import hashlib
import json
import os

import pytest

import kernel_loader
from kernel_loader import cli, hashing, integrity, loader
from kernel_loader.errors import KernelIntegrityError, LockfileError
from test_importer import SHA, kcache, make_linked_cache, toy_files  # noqa: F401 (fixture)

SO_BYTES = bytes(range(256)) * 64  # stands in for a compiled extension (stored in LFS on the Hub)


def write_record(folder, sha, variant, variants=None):
    """A completion record in the shared format, for a cache built by make_linked_cache."""
    root = folder / "snapshots" / sha
    files = {}
    for path in sorted((root / "build" / variant).rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            files[path.relative_to(root).as_posix()] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    record = integrity.record_path(folder, sha, variant)
    record.parent.mkdir(parents=True, exist_ok=True)
    repo_id = "/".join(folder.name.split("--", 2)[1:])  # models--org--name: a record names its own repo
    record.write_text(json.dumps({"format": 1, "repo_id": repo_id, "sha": sha, "variant": variant, "files": files,
                                  "variants": variants or [variant], "refs": {"main": sha}}))
    return record


def flip_one_byte_keep_mtime(path):
    """Rewrite one byte of the file behind ``path`` and put its mtime back (ctime moves regardless)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    data = bytearray(open(real, "rb").read())
    data[len(data) // 2] ^= 0x01
    with open(real, "r+b") as fh:
        fh.write(data)
    os.utime(real, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(real).st_mtime_ns == st.st_mtime_ns and os.stat(real).st_size == st.st_size


def _variant(value=1):
    files = toy_files(value)
    files["toy/_ops.so"] = SO_BYTES
    return files


@pytest.mark.parametrize("target", ["toy/_impl.py", "toy/_ops.so"])
def test_a_flipped_byte_with_its_mtime_restored_is_caught_after_a_remembered_check(kcache, tmp_path, target):
    folder = make_linked_cache(kcache, "kernels-community/rec", SHA, {"torch-universal": _variant()})
    record = integrity.read_record(write_record(folder, SHA, "torch-universal"))
    snapshot = folder / "snapshots" / SHA
    memo = integrity.default_memo_dir()
    integrity.verify_files(snapshot, record.files, memo_dir=memo)  # hashes and remembers
    flip_one_byte_keep_mtime(snapshot / "build/torch-universal" / target)
    with pytest.raises(KernelIntegrityError, match=f"changed: build/torch-universal/{target}"):
        kernel_loader.get_kernel("kernels-community/rec", SHA)


def test_a_warm_check_reads_no_file_and_stays_out_of_the_cache(kcache, monkeypatch):
    folder = make_linked_cache(kcache, "kernels-community/warm", SHA, {"torch-universal": _variant(4)})
    write_record(folder, SHA, "torch-universal")
    before = sorted(p.relative_to(kcache) for p in kcache.rglob("*"))
    assert kernel_loader.get_kernel("kernels-community/warm", SHA).answer() == 4
    assert sorted(p.relative_to(kcache) for p in kcache.rglob("*")) == before  # nothing written into the cache
    assert list(integrity.default_memo_dir().glob("*.json"))

    def no_hashing(*args):
        raise AssertionError("a remembered check hashed a file")

    monkeypatch.setattr(integrity, "_digests", no_hashing)
    record = integrity.read_record(integrity.record_path(folder, SHA, "torch-universal"))
    integrity.verify_files(folder / "snapshots" / SHA, record.files, memo_dir=integrity.default_memo_dir())


def test_missing_and_unexpected_files_are_named(kcache):
    folder = make_linked_cache(kcache, "kernels-community/names", SHA, {"torch-universal": _variant()})
    write_record(folder, SHA, "torch-universal")
    variant = folder / "snapshots" / SHA / "build/torch-universal"
    (variant / "toy" / "late.py").unlink()
    (variant / "toy" / "extra.py").write_text("EVIL = 1\n")
    with pytest.raises(KernelIntegrityError) as info:
        kernel_loader.get_kernel("kernels-community/names", SHA)
    text = str(info.value)
    assert "missing: build/torch-universal/toy/late.py" in text
    assert "unexpected: build/torch-universal/toy/extra.py" in text and "kernel-loader verify" in text


def test_an_unreadable_record_stops_the_load(kcache):
    folder = make_linked_cache(kcache, "kernels-community/badrec", SHA, {"torch-universal": _variant()})
    write_record(folder, SHA, "torch-universal").write_text('{"format": 1, "files": {"a": {"size": 1}}}')
    with pytest.raises(KernelIntegrityError, match="without a sha256"):
        kernel_loader.get_kernel("kernels-community/badrec", SHA)


def test_verify_checks_the_whole_cache_without_a_lock(kcache, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no kernels.lock here or above
    good = make_linked_cache(kcache, "kernels-community/good", SHA, {"torch-universal": _variant()})
    bad = make_linked_cache(kcache, "kernels-community/bad", SHA, {"torch-universal": _variant()})
    make_linked_cache(kcache, "kernels-community/norecord", SHA, {"torch-universal": _variant()}, record=False)
    write_record(good, SHA, "torch-universal")
    write_record(bad, SHA, "torch-universal")
    flip_one_byte_keep_mtime(bad / "snapshots" / SHA / "build/torch-universal/toy/_ops.so")
    assert cli.main(["verify", "--json"]) == cli.EXIT_INTEGRITY
    rows = {r["repo_id"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert rows["kernels-community/good"]["status"] == "ok"
    assert rows["kernels-community/norecord"]["status"] == "unrecorded"
    assert rows["kernels-community/bad"]["status"] == "MISMATCH"
    assert "changed: build/torch-universal/toy/_ops.so" in rows["kernels-community/bad"]["detail"]


# -- lock hash types ----------------------------------------------------------------------------------


def kernels_git_lfs_concat(listing):
    """The `kernels` package's lock hash, as its lockfile.py computed it from the Hub's listing:
    sha256 over the byte-sorted (path in variant as UTF-8, bytes of the LFS sha256 or git blob id)."""
    m = hashlib.sha256()
    for name, oid in sorted((path.encode("utf-8"), oid) for path, oid in listing.items()):
        m.update(name)
        m.update(bytes.fromhex(oid))
    return f"sha256-{m.hexdigest()}"


def _listing(variant_files):
    out = {}
    for rel, text in variant_files.items():
        data = text.encode() if isinstance(text, str) else text
        out[rel] = hashlib.sha256(data).hexdigest() if rel.endswith(".so") else (
            hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())
    return out


def test_git_lfs_concat_checks_linked_and_plain_files(kcache, tmp_path):
    files = _variant()
    folder = make_linked_cache(kcache, "kernels-community/lfs", SHA, {"torch-universal": files})
    variant = folder / "snapshots" / SHA / "build/torch-universal"
    entry = {"hash": kernels_git_lfs_concat(_listing(files)), "hash_type": "git_lfs_concat"}
    memo = tmp_path / "memo"
    assert integrity.verify_lock_variant(variant, entry, "k", memo_dir=memo) == "verified"
    assert integrity.verify_lock_variant(variant, entry, "k", memo_dir=memo) == "remembered"
    plain = tmp_path / "plain"  # the same files copied without links (a local or copied tree)
    for rel, text in files.items():
        (plain / rel).parent.mkdir(parents=True, exist_ok=True)
        (plain / rel).write_bytes(text.encode() if isinstance(text, str) else text)
    assert integrity.verify_lock_variant(plain, entry, "k", memo_dir=memo) == "verified"
    flip_one_byte_keep_mtime(variant / "toy/_ops.so")
    with pytest.raises(KernelIntegrityError, match="git_lfs_concat: expected sha256-"):
        integrity.verify_lock_variant(variant, entry, "k", memo_dir=memo)


def test_an_unknown_hash_type_is_a_lockfile_error_not_a_tamper_alarm(tmp_path):
    (tmp_path / "v").mkdir()
    with pytest.raises(LockfileError, match="hash_type 'blake3_tree'.*known: sha256_files, git_lfs_concat"):
        integrity.verify_lock_variant(tmp_path / "v", {"hash": "sha256-00", "hash_type": "blake3_tree"}, "k",
                                      memo_dir=tmp_path / "memo")


def test_an_edited_sha256_files_lock_is_a_lockfile_error(tmp_path):
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "a.py").write_text("A = 1\n")
    _, files = hashing.hash_folder(tmp_path / "v")
    entry = {"hash": "sha256-" + "0" * 64, "hash_type": hashing.HASH_TYPE, "files": files}
    with pytest.raises(LockfileError, match="do not add up"):
        integrity.verify_lock_variant(tmp_path / "v", entry, "k", memo_dir=tmp_path / "memo")


# -- a mirror listing unsafe names ---------------------------------------------------------------


@pytest.mark.parametrize("variant", ["..", "../../outside", "x/../../.."])
def test_a_mirror_listing_an_unsafe_name_is_a_documented_error(tmp_path, monkeypatch, variant):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    from kernel_loader.errors import UnsafeRepoContentError
    from kernel_loader.sources import hub

    # Variant names come from the mirror's listing; huggingface_hub refuses these before any request.
    with pytest.raises(UnsafeRepoContentError, match="would land outside the cache"):
        hub.read_metadata("kernels-community/x", "model", "main", variant, tmp_path / "cache", hub.HubSettings.from_env())
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("metadata.json"))
