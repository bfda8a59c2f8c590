import subprocess

import pytest

from kernel_loader import hashing


def test_digest_kinds_and_bytecode_ignored(tmp_path):
    folder = tmp_path / "v"
    (folder / "pkg" / "__pycache__").mkdir(parents=True)
    (folder / "pkg" / "__init__.py").write_text("x = 1\n")
    (folder / "pkg" / "__pycache__" / "junk.cpython-311.pyc").write_bytes(b"ignored")
    (folder / "metadata.json").write_text("{}")
    whole, files = hashing.hash_folder(folder, {"pkg/__init__.py": "git-sha1:whatever"})
    oid = subprocess.run(["git", "hash-object", str(folder / "pkg" / "__init__.py")], capture_output=True, text=True)
    assert files["pkg/__init__.py"] == "git-sha1:" + oid.stdout.strip()  # same id git (and the Hub) report
    assert files["metadata.json"].startswith("sha256:") and set(files) == {"pkg/__init__.py", "metadata.json"}
    assert whole == hashing.combine(files) and whole.startswith("sha256-")
    with pytest.raises(ValueError):
        hashing.file_digest(folder / "metadata.json", "md5")


def test_hash_changes_with_content(tmp_path):
    folder = tmp_path / "v"
    folder.mkdir()
    (folder / "a.py").write_text("a = 1\n")
    h1 = hashing.hash_folder(folder)[0]
    (folder / "a.py").write_text("a = 22\n")
    assert hashing.hash_folder(folder)[0] != h1
    (folder / "b.py").write_text("")
    assert "b.py" in hashing.hash_folder(folder)[1]
