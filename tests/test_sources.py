"""The sources: LOCAL_KERNELS parsing, the shipped repos, and the Hub client against olah."""

from pathlib import Path

import pytest

from kernel_loader import cache, hashing, publish
from kernel_loader.sources import bundled, hub, local
from test_loader import kernel_files


def test_local_kernels_forms():
    assert local.parse_local_kernels("a/b=/x,c/d=/y") == {"a/b": Path("/x"), "c/d": Path("/y")}
    assert local.parse_local_kernels("a/b=/x:c/d=/y") == {"a/b": Path("/x"), "c/d": Path("/y")}
    assert local.parse_local_kernels(r"a/b=C:\x\y") == {"a/b": Path(r"C:\x\y")}
    with pytest.raises(ValueError, match="empty path"):
        local.parse_local_kernels("a/b=,c/d=/y")


def test_shipped_repos_are_found_in_the_checkout(monkeypatch):
    monkeypatch.delenv("KERNEL_LOADER_NO_BUNDLED", raising=False)
    assert "kernels-community/flash-attn2" in bundled.bundled_repo_ids()
    root = bundled.bundled_repo("kernels-community/flash-attn2")
    assert root is not None and (root / "build" / "torch-universal" / "metadata.json").is_file()
    assert bundled.bundled_version(root / "build" / "torch-universal") == 1
    assert bundled.bundled_repo("kernels-community/not-shipped") is None
    monkeypatch.setenv("KERNEL_LOADER_NO_BUNDLED", "1")
    assert bundled.bundled_repo("kernels-community/flash-attn2") is None


def test_hub_client_against_olah(hub_env, hub_server, tmp_path):
    repo_id = hub_server.new_repo_id("client", org="kernels-community")
    files = {f"build/torch-universal/{k}": v for k, v in kernel_files(1, "client").items()}
    sha = hub_server.add_repo(repo_id, files)
    hub_server.create_branch(repo_id, "v3", sha)
    settings = hub.HubSettings.from_env()
    remote = hub.remote_repo(repo_id, settings)
    assert remote.repo_type == "model"  # olah answers 401/404 for repo type kernel
    assert remote.branches["main"] == sha and remote.versions() == {3: sha}
    assert hub.list_variants(repo_id, "model", sha, settings) == ["torch-universal"]
    assert hub.commit_exists(repo_id, "model", sha, settings) and not hub.commit_exists(repo_id, "model", "0" * 40, settings)
    assert hub.read_metadata(repo_id, "model", sha, "torch-universal", hub_env.cache_dir, settings)["name"] == "client"
    assert hub.read_metadata(repo_id, "model", sha, "no-such-variant", hub_env.cache_dir, settings) is None
    # the lock's digests from the listing equal those computed from downloaded files
    digests = hub.variant_file_digests(repo_id, "model", sha, "torch-universal", settings)
    listing = hub.list_files(repo_id, "model", sha, settings)
    job = publish.VariantFetch(repo_id, "model", sha, "torch-universal", listing, ["torch-universal"], {"v3": sha})
    snapshot = publish.publish_variant(job, hub_env.cache_dir, settings, lock_timeout=5)
    assert snapshot.name == sha
    assert hashing.hash_folder(snapshot / "build" / "torch-universal", digests) == (hashing.combine(digests), digests)
    assert cache.cached_versions(repo_id, hub_env.cache_dir) == {3: sha}
    with pytest.raises(hub.HubRepoMissing):
        hub.remote_repo("kernels-community/never-created", settings)
    with hub_server.offline():
        with pytest.raises(hub.HubUnreachable):
            hub.remote_repo(repo_id, settings)
    hub_env.set_offline()
    with pytest.raises(hub.HubUnreachable, match="HF_HUB_OFFLINE"):
        hub.remote_repo(repo_id, hub.HubSettings.from_env())


# -- the Hub answers as JSON, read by hub.py itself ----------------------------------------------


class _Scripted:
    """A loopback HTTP server answering each path with a scripted (status, headers, body)."""

    def __init__(self, answers: dict):
        import http.server
        import threading

        self.answers, self.asked = answers, []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's spelling)
                outer.asked.append(self.path)
                status, headers, body = outer.answers.get(self.path.split("?")[0], (404, {}, b"{}"))
                body = body.replace(b"ENDPOINT", outer.endpoint.encode())
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value.replace("ENDPOINT", outer.endpoint))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _settings(endpoint: str) -> hub.HubSettings:
    return hub.HubSettings(endpoint, None, connect_timeout=2, read_timeout=2, retries=0)


def test_a_listing_of_several_pages_is_read_to_the_end():
    import json

    tree = "/api/models/org/paged/tree/" + "a" * 40 + "/build"
    first = [
        {"type": "directory", "path": "build/v1", "oid": "d" * 40, "size": 0},
        {"type": "file", "path": "build/v1/x/__init__.py", "oid": "1" * 40, "size": 10},
        {"type": "file", "path": "build/v1/x/__pycache__/y.pyc", "oid": "2" * 40, "size": 5},
    ]
    second = [{"type": "file", "path": "build/v1/x/lib.so", "oid": "3" * 40, "size": 134,
               "lfs": {"oid": "f" * 64, "size": 9000, "pointerSize": 134}}]
    answers = {
        tree: (200, {"Link": f'<ENDPOINT{tree}-page2>; rel="next"'}, json.dumps(first).encode()),
        tree + "-page2": (200, {}, json.dumps(second).encode()),
    }
    with _Scripted(answers) as server:
        files = hub.list_files("org/paged", "model", "a" * 40, _settings(server.endpoint))
    assert files == [
        hub.RemoteFile("build/v1/x/__init__.py", 10, None, "1" * 40),
        hub.RemoteFile("build/v1/x/lib.so", 9000, "f" * 64, "3" * 40),  # LFS: the real size and sha256
    ]
    assert [p.split("?")[0] for p in server.asked] == [tree, tree + "-page2"]


@pytest.mark.parametrize("body", [b"", b"<html>proxy login</html>", b'{"branches": 5, "tags": []}', b"[1, 2]"])
def test_a_mirror_answering_something_else_than_the_hub_api_is_unreachable_not_a_traceback(body):
    answers = {f"/api/{t}s/org/odd/refs": (200, {}, body) for t in ("kernel", "model")}
    with _Scripted(answers) as server:
        with pytest.raises(hub.HubUnreachable) as info:
            hub.remote_repo("org/odd", _settings(server.endpoint))
    message = str(info.value)
    assert server.endpoint in message and "the refs of org/odd" in message and "not what the Hub API returns" in message


def test_explanation_metadata_is_read_without_writing_and_an_absent_file_costs_no_request(hub_env, hub_server):
    repo_id = hub_server.new_repo_id("readonly-meta", org="kernels-community")
    files = {f"build/torch-universal/{k}": v for k, v in kernel_files(1, "meta").items()}
    files["build/torch-cpu-no-meta/x/__init__.py"] = "VALUE = 2\n"
    sha = hub_server.add_repo(repo_id, files)
    settings = hub.HubSettings.from_env()
    assert hub.fetch_metadata(repo_id, "model", sha, "torch-universal", settings)["name"] == "meta"
    assert not hub_env.cache_dir.exists() or not any(hub_env.cache_dir.rglob("*"))
    assert not (hub_env.hf_home / "hub").exists()
    with hub_server.offline():  # the listing already says this variant has no metadata.json
        assert hub.fetch_metadata(repo_id, "model", sha, "torch-cpu-no-meta", settings) is None


# -- failures said in words ----------------------------------------------------------------------

LIBRARY_CLASS_NAME = r"[A-Z][a-zA-Z]+(Error|Exception)\b"


def _said_once(text: str, part: str) -> bool:
    """``part`` is named at most once outside the `commands` a message advises."""
    import re

    return re.sub(r"`[^`]*`", "", text).count(part) <= 1


def _message_of(fn, error: type) -> str:
    with pytest.raises(error) as info:
        fn()
    return str(info.value)


def test_hub_failures_are_said_in_words_with_the_id_once(hub_env, hub_server, monkeypatch, tmp_path, caplog):
    import re
    import socket

    import kernel_loader
    from kernel_loader.errors import KernelDownloadError, KernelNotFoundError, OfflineKernelMissingError

    monkeypatch.setenv("KERNEL_LOADER_NO_BUNDLED", "1")
    repo_id = hub_server.new_repo_id("words", org="kernels-community")
    sha = hub_server.add_repo(repo_id, {f"build/torch-universal/{k}": v for k, v in kernel_files(1, "words").items()})
    missing_repo = "kernels-community/never-made-words"
    messages = {
        "missing repo": (_message_of(lambda: kernel_loader.get_kernel(missing_repo), KernelNotFoundError), missing_repo),
        "missing revision": (_message_of(lambda: kernel_loader.get_kernel(repo_id, revision="no-such-branch"), KernelNotFoundError),
                             "no-such-branch"),
        "missing commit": (_message_of(lambda: kernel_loader.get_kernel(f"{repo_id}@{'0' * 40}"), KernelNotFoundError), "0" * 40),
    }
    job = publish.VariantFetch(repo_id, "model", sha, "torch-universal",
                               [hub.RemoteFile("build/torch-universal/words/gone.py", 10, None, "1" * 40)], ["torch-universal"], {})
    with pytest.raises(KernelDownloadError) as missing_file:
        publish.publish_variant(job, tmp_path / "cache", hub.HubSettings.from_env(), lock_timeout=5)
    messages["missing file"] = (str(missing_file.value), "gone.py")
    with socket.socket() as free:  # a port nothing listens on
        free.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{free.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", dead)
    monkeypatch.setenv("KERNEL_LOADER_RETRIES", "1")
    caplog.clear()
    with caplog.at_level("WARNING", logger="kernel_loader"):
        messages["dead endpoint"] = (_message_of(lambda: kernel_loader.get_kernel(repo_id), OfflineKernelMissingError), dead)
    retry_logs = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]

    for case, (text, named) in messages.items():
        assert not re.search(LIBRARY_CLASS_NAME, text), (case, text)
        assert _said_once(text, repo_id if case != "missing repo" else missing_repo) and _said_once(text, named), (case, text)
    assert "HTTP 4" in messages["missing repo"][0] and "HF_TOKEN" in messages["missing repo"][0]
    assert "Known: main" in messages["missing revision"][0] and "Known refs: main" in messages["missing commit"][0]
    assert "HTTP 404" in messages["missing file"][0] and "gone.py is listed but cannot be fetched" in messages["missing file"][0]
    assert "unreachable: the connection was refused" in messages["dead endpoint"][0] and "HF_ENDPOINT" in messages["dead endpoint"][0]
    assert retry_logs and all(not re.search(LIBRARY_CLASS_NAME, m) and "the connection was refused" in m for m in retry_logs)
