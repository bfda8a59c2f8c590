"""A real Hub-compatible server on loopback for the test suite (pytest plugin, loaded by conftest).

Every Hub test in this project talks HTTP to olah 0.5.4 (a Hugging Face Hub mirror) running in
offline mode on 127.0.0.1 and serving plain git repositories that the tests build in a temp
folder. Nothing mocks huggingface_hub's HTTP layer, and nothing leaves the machine.

Fixtures
--------
``hub_server`` (session scope) -> :class:`HubServer`
    Started once per session (about 0.5 s), stopped by PID at the end. Methods:

    * ``endpoint`` -- ``"http://127.0.0.1:PORT"`` (stays the same across ``stop()``/``start()``).
    * ``add_repo(repo_id, files, branch="main", message=...) -> sha`` -- create a repo whose first
      commit holds ``files``: a ``dict`` of ``"path/in/repo" -> bytes | str | Path`` or a ``Path``
      to a folder copied as the whole tree (symlinks are copied as the files they point to).
      Raises ``ValueError`` if the repo already exists (use ``commit``).
    * ``commit(repo_id, files=None, branch="main", message=..., delete=()) -> sha`` -- add/replace
      files on an existing branch; a ``None`` value in ``files`` or a path in ``delete`` removes
      that file or folder (``delete=["."]`` empties the tree first). Visible at once, no restart.
    * ``create_branch(repo_id, name, from_rev="main") -> sha``, ``delete_branch(repo_id, name)``,
      ``tag(repo_id, name, rev="main") -> sha`` (lightweight tag). Names containing ``/`` are
      refused with ``ValueError``: olah cannot serve them.
    * ``add_shipped_repo(repo_id, versions=(1,), *, serve_as=None) -> sha`` -- serve
      ``kernel_repos/<org>/<name>/`` as a repo with ``main`` and one ``vN`` branch per version, all
      on one commit. Idempotent per session: a second call returns the same sha. Pass
      ``serve_as="other-org/name"`` to get a separate copy you may commit to; never commit to the
      shared ``kernels-community/...`` copy, other test modules use it.
    * ``new_repo_id(name="repo", org="test-org") -> "org/name-N"`` -- a repo id unused in this
      session (the server is shared by every test, so use it for repos you create or mutate).
    * ``repo_path(repo_id) -> Path`` (the git working tree), ``rev_parse(repo_id, rev) -> sha``.
    * ``stop()`` / ``start()`` / ``running`` -- while stopped the port refuses connections, which
      is how a test proves that an offline load makes no network call. ``offline()`` is a context
      manager that stops the server and starts it again on exit.

``hub_env`` (function scope) -> :class:`HubEnv`
    Points the process at the server and at fresh, empty caches, through ``monkeypatch``:
    ``HF_ENDPOINT`` = the server, ``KERNEL_LOADER_CACHE`` = ``hub_env.cache_dir``,
    ``HF_HOME`` = ``hub_env.hf_home`` (so the HF cache is ``hf_home / "hub"``),
    ``KERNEL_LOADER_STATE_DIR`` = a temp folder; unsets ``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``,
    ``HF_HUB_CACHE``, ``HF_TOKEN``, ``LOCAL_KERNELS``, ``KERNEL_LOADER_TRUSTED_ORGS`` and
    ``KERNEL_LOADER_NO_BUNDLED``. It restarts the server if an earlier test left it stopped.

    huggingface_hub reads these variables once, at import; ``hub_env`` therefore also patches
    ``huggingface_hub.constants`` (ENDPOINT, HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, the URL
    template, and 0.x's copy of it in ``file_download``), the endpoint of the module-level
    ``huggingface_hub.model_info``-style API object, and drops huggingface_hub's cached HTTP
    sessions before and after the test. To go offline
    inside a test call ``hub_env.set_offline()``: a bare ``monkeypatch.setenv("HF_HUB_OFFLINE", "1")``
    is not seen by an already-imported huggingface_hub. Code under test that reads ``os.environ``
    at call time sees the variables as well.

olah quirks the tests must expect
---------------------------------
* Always pass ``revision=`` to ``model_info``.
* A missing repo, file or revision answers 401 -> ``RepositoryNotFoundError``, not 404
  (but ``HEAD`` of a missing file at a commit sha answers 404 -> ``EntryNotFoundError``).
* ``GET`` of a missing file answers 500 and olah then drops that keep-alive connection: the next
  request on the pooled connection fails with "connection reset by peer". Client code must retry
  once on a fresh connection (kernel_loader.sources.hub does) rather than call the Hub unreachable.
* ``/api/kernels/...`` answers 401 (by branch) or 404 (by sha): only repo type ``model`` is served.
* Branch names with ``/`` fail; symlinks in a git repo would be served as their target's path
  text (``add_repo`` copies folders with symlinks resolved to avoid that).

Finding olah: ``KERNEL_LOADER_OLAH`` (path to ``olah-cli`` or to a venv holding it), else
``<repo>/.venv-olah/bin/olah-cli``, else ``olah-cli`` on PATH. If none exists the fixture fails
(it never skips) and says how to create it: ``bash tests/run.sh`` or
``python3 -m venv .venv-olah && .venv-olah/bin/pip install olah==0.5.4``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
KERNEL_REPOS = REPO_ROOT / "kernel_repos"
OLAH_ENV_VAR = "KERNEL_LOADER_OLAH"
OLAH_VERSION = "0.5.4"
SEED_REPO = "hub-server/seed"
READY_TIMEOUT_S = 60.0  # first start in a fresh venv compiles olah's .pyc files

FileSpec = Mapping[str, "bytes | str | Path | None"]

# Git runs with no user/system config so a developer's hooks, signing or excludes cannot change
# what the tests serve, and nothing is written to the global config.
_GIT_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_TERMINAL_PROMPT": "0",
}
_GIT_IDENTITY = (
    "-c", "user.name=kernel-loader tests",
    "-c", "user.email=tests@kernel-loader.invalid",
    "-c", "commit.gpgsign=false",
    "-c", "core.autocrlf=false",
)
_COPY_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".git")


def find_olah() -> Path:
    """Return the olah-cli executable to run.

    Raises:
        FileNotFoundError: none of ``$KERNEL_LOADER_OLAH``, ``.venv-olah`` or PATH has olah-cli;
            the message gives the command that installs it.
    """
    bindir = "Scripts" if sys.platform == "win32" else "bin"
    exe = "olah-cli.exe" if sys.platform == "win32" else "olah-cli"
    configured = os.environ.get(OLAH_ENV_VAR)
    if configured:
        path = Path(configured)
        if path.is_dir():
            path = path / bindir / exe
        if path.is_file():
            return path
        raise FileNotFoundError(
            f"{OLAH_ENV_VAR}={configured!r} does not name an olah-cli executable or a venv "
            f"holding one. Unset it, or point it at e.g. {REPO_ROOT / '.venv-olah' / bindir / exe}."
        )
    venv_cli = REPO_ROOT / ".venv-olah" / bindir / exe
    if venv_cli.is_file():
        return venv_cli
    on_path = shutil.which("olah-cli")
    if on_path:
        return Path(on_path)
    raise FileNotFoundError(
        "The Hub tests need olah (a Hub-compatible server) and found none: not in "
        f"${OLAH_ENV_VAR}, not at {venv_cli}, not on PATH. Create it with `bash tests/run.sh`, or:\n"
        f"  python3 -m venv {REPO_ROOT / '.venv-olah'} && "
        f"{REPO_ROOT / '.venv-olah' / bindir / 'pip'} install olah=={OLAH_VERSION}"
    )


def reset_hub_sessions() -> None:
    """Drop huggingface_hub's cached HTTP sessions, if it is imported.

    Its sessions pool keep-alive connections and, in 0.x, bake in HF_HUB_OFFLINE when created:
    after a server restart or an offline switch a fresh session must be made.
    """
    hub = sys.modules.get("huggingface_hub")
    if hub is None:
        return
    if hasattr(hub, "close_session"):  # huggingface_hub >= 1 (httpx)
        hub.close_session()
    else:  # huggingface_hub 0.x (requests)
        from huggingface_hub.utils import reset_sessions

        reset_sessions()


def _toml_str(value: object) -> str:
    # A JSON string is a valid TOML basic string (Windows backslashes included).
    return json.dumps(str(value))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check_repo_id(repo_id: str) -> tuple[str, str]:
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") or p.startswith("-") for p in parts):
        raise ValueError(f"repo id must look like 'org/name', got {repo_id!r}")
    return parts[0], parts[1]


def _check_ref_name(kind: str, name: str) -> None:
    if not name or "/" in name or name.startswith("-") or any(c.isspace() for c in name):
        raise ValueError(
            f"{kind} name {name!r} cannot be served: olah fails on names with '/', and names must "
            "not be empty, start with '-' or hold whitespace"
        )


def _check_file_path(path: str) -> Path:
    pure = Path(path)
    if pure.is_absolute() or not path or ".." in pure.parts or ".git" in pure.parts:
        raise ValueError(f"file path inside a repo must be relative and stay inside it, got {path!r}")
    return pure


class HubServer:
    """olah serving the git repos under ``root/repos`` on 127.0.0.1 (see the module docstring)."""

    def __init__(self, root: Path, olah_cli: Path) -> None:
        self.root = root
        self.repos_dir = root / "repos"
        self.olah_cli = olah_cli
        self.port = _free_port()
        self.log_dir = root / "logs"
        self.output_path = root / "olah.out"
        self._proc: subprocess.Popen[bytes] | None = None
        self._shipped: dict[str, str] = {}
        self._ids = itertools.count(1)
        for d in (self.repos_dir, root / "olah-cache", self.log_dir):
            d.mkdir(parents=True, exist_ok=True)

    # -- server lifecycle ---------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """Base URL to use as ``HF_ENDPOINT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the olah process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def _write_config(self) -> Path:
        config = self.root / "configs.toml"
        netloc = f"127.0.0.1:{self.port}"
        # offline = true: olah must never forward a miss to huggingface.co.
        config.write_text(
            "[basic]\n"
            'host = "127.0.0.1"\n'
            f"port = {self.port}\n"
            f"repos-path = {_toml_str(self.root / 'olah-cache')}\n"
            f'mirror-netloc = "{netloc}"\n'
            f'mirror-lfs-netloc = "{netloc}"\n'
            f"mirrors-path = [{_toml_str(self.repos_dir)}]\n"
            "\n[accessibility]\n"
            "offline = true\n",
            encoding="utf-8",
        )
        return config

    def _answers(self, path: str) -> int | None:
        # ProxyHandler({}): a proxy in the environment must not intercept loopback traffic.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(self.endpoint + path, timeout=2) as response:
                return response.status
        except urllib.error.HTTPError as err:
            return err.code
        except (urllib.error.URLError, OSError):
            return None

    def _output_tail(self, chars: int = 3000) -> str:
        try:
            return self.output_path.read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return "(no output)"

    def start(self) -> None:
        """Start olah (no-op if running) and wait until it serves the seed repo.

        Raises:
            RuntimeError: olah exited or did not answer within the timeout; the message holds
                the tail of its output.
        """
        if self.running:
            return
        if not (self.repos_dir / "models" / SEED_REPO).exists():
            self.add_repo(SEED_REPO, {"README.md": "seed repo: the fixture polls it to know olah is up\n"})
        config = self._write_config()
        env = dict(os.environ)
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
        with open(self.output_path, "ab") as out:
            self._proc = subprocess.Popen(
                [str(self.olah_cli), "-c", str(config), "--log-path", str(self.log_dir)],
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise RuntimeError(
                    f"olah ({self.olah_cli}) exited with code {code} before serving "
                    f"{self.endpoint}; its output ({self.output_path}):\n{self._output_tail()}"
                )
            if self._answers(f"/api/models/{SEED_REPO}/refs") == 200:
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"olah did not answer {self.endpoint}/api/models/{SEED_REPO}/refs within "
            f"{READY_TIMEOUT_S:.0f} s; its output ({self.output_path}):\n{self._output_tail()}"
        )

    def stop(self) -> None:
        """Stop olah by PID (terminate, wait, kill); afterwards the port refuses connections."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        # huggingface_hub keeps pooled keep-alive connections; drop them so the first request
        # after a restart does not land on a dead socket.
        reset_hub_sessions()

    @contextlib.contextmanager
    def offline(self) -> Iterator[None]:
        """Stop the server for the duration of the block and start it again afterwards."""
        self.stop()
        try:
            yield
        finally:
            self.start()

    # -- repositories -------------------------------------------------------------------------

    def repo_path(self, repo_id: str) -> Path:
        """The git working tree serving ``repo_id`` (it may not exist yet)."""
        org, name = _check_repo_id(repo_id)
        return self.repos_dir / "models" / org / name

    def new_repo_id(self, name: str = "repo", org: str = "test-org") -> str:
        """A repo id not used by any repo of this session."""
        while True:
            repo_id = f"{org}/{name}-{next(self._ids)}"
            if not self.repo_path(repo_id).exists():
                return repo_id

    def _git(self, repo_id: str, *args: str) -> str:
        path = self.repo_path(repo_id)
        result = subprocess.run(
            ["git", *_GIT_IDENTITY, *args],
            cwd=path,
            env={**os.environ, **_GIT_ENV},
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"git {' '.join(args)} failed in {path} (exit {result.returncode}):\n"
                f"{result.stderr.strip()}"
            )
        return result.stdout.strip()

    def rev_parse(self, repo_id: str, rev: str) -> str:
        """The commit sha that ``rev`` (branch, tag or sha) names in ``repo_id``.

        Raises:
            RuntimeError: the revision does not exist.
        """
        return self._git(repo_id, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")

    def _require_repo(self, repo_id: str) -> None:
        if not (self.repo_path(repo_id) / ".git").is_dir():
            raise ValueError(f"no repo {repo_id!r} on the test server; create it with add_repo()")

    def _write_files(self, repo_id: str, files: FileSpec | Path | None, delete: tuple[str, ...]) -> None:
        worktree = self.repo_path(repo_id)
        removals = list(delete)
        if isinstance(files, Mapping):
            removals += [p for p, content in files.items() if content is None]
        for rel in removals:
            if rel != ".":
                _check_file_path(rel)
            self._git(repo_id, "rm", "-r", "-q", "--ignore-unmatch", "--", rel)
        if files is None:
            return
        if isinstance(files, Path):
            if not files.is_dir():
                raise ValueError(f"files must be a mapping or a folder; {files} is not a folder")
            shutil.copytree(files, worktree, dirs_exist_ok=True, ignore=_COPY_IGNORE)
            return
        for rel, content in files.items():
            if content is None:
                continue
            target = worktree / _check_file_path(rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, Path):
                shutil.copyfile(content, target)
            elif isinstance(content, str):
                target.write_bytes(content.encode("utf-8"))
            else:
                target.write_bytes(bytes(content))

    def _commit_all(self, repo_id: str, message: str) -> str:
        # -f: the temp repo has no .gitignore, but be sure nothing (e.g. build/) is left out.
        self._git(repo_id, "add", "-A", "-f")
        self._git(repo_id, "commit", "-q", "--allow-empty", "--no-verify", "-m", message)
        return self._git(repo_id, "rev-parse", "HEAD")

    def add_repo(
        self,
        repo_id: str,
        files: FileSpec | Path,
        branch: str = "main",
        message: str = "initial commit",
    ) -> str:
        """Create ``repo_id`` with one commit on ``branch`` holding ``files``; return its sha.

        Raises:
            ValueError: the repo already exists, or a name or path is not servable.
        """
        _check_ref_name("branch", branch)
        path = self.repo_path(repo_id)
        if path.exists():
            raise ValueError(f"repo {repo_id!r} already exists on the test server; use commit()")
        path.mkdir(parents=True)
        self._git(repo_id, "init", "-q", f"--initial-branch={branch}")
        self._write_files(repo_id, files, ())
        return self._commit_all(repo_id, message)

    def commit(
        self,
        repo_id: str,
        files: FileSpec | Path | None = None,
        branch: str = "main",
        message: str = "update files",
        delete: tuple[str, ...] | list[str] = (),
    ) -> str:
        """Commit ``files`` (added or replaced; ``None`` values delete) and ``delete`` to ``branch``.

        Returns the new commit sha; the server shows it at once.

        Raises:
            ValueError: the repo or branch does not exist, or a path leaves the repo.
        """
        self._require_repo(repo_id)
        if not self._git(repo_id, "branch", "--list", branch):
            raise ValueError(f"repo {repo_id!r} has no branch {branch!r}; use create_branch() first")
        self._git(repo_id, "checkout", "-q", "-f", branch)
        self._write_files(repo_id, files, tuple(delete))
        return self._commit_all(repo_id, message)

    def create_branch(self, repo_id: str, name: str, from_rev: str = "main") -> str:
        """Create branch ``name`` at ``from_rev``; return the sha it points to.

        Raises:
            ValueError: the name contains '/' (olah cannot serve it) or the repo is missing.
            RuntimeError: git refused (branch exists, unknown ``from_rev``).
        """
        _check_ref_name("branch", name)
        self._require_repo(repo_id)
        self._git(repo_id, "branch", name, from_rev)
        return self.rev_parse(repo_id, name)

    def delete_branch(self, repo_id: str, name: str) -> None:
        """Delete branch ``name`` (the server stops answering for it at once)."""
        self._require_repo(repo_id)
        if self._git(repo_id, "rev-parse", "--abbrev-ref", "HEAD") == name:
            self._git(repo_id, "checkout", "-q", "--detach")
        self._git(repo_id, "branch", "-D", name)

    def tag(self, repo_id: str, name: str, rev: str = "main") -> str:
        """Create the lightweight tag ``name`` at ``rev``; return the tagged sha.

        Raises:
            ValueError: the name contains '/' or the repo is missing.
            RuntimeError: git refused (tag exists, unknown ``rev``).
        """
        _check_ref_name("tag", name)
        self._require_repo(repo_id)
        self._git(repo_id, "tag", name, rev)
        return self.rev_parse(repo_id, name)

    def add_shipped_repo(
        self, repo_id: str, versions: tuple[int, ...] | list[int] = (1,), *, serve_as: str | None = None
    ) -> str:
        """Serve ``kernel_repos/<repo_id>/`` as ``serve_as or repo_id`` with ``main`` + ``vN`` branches.

        All branches point at one commit; returns its sha. Calling it again for the same target
        returns the same sha (adding any missing ``vN`` branch).

        Raises:
            FileNotFoundError: ``kernel_repos/`` has no such repo (the message lists what it has).
        """
        org, name = _check_repo_id(repo_id)
        source = KERNEL_REPOS / org / name
        if not source.is_dir():
            shipped = sorted(f"{p.parent.name}/{p.name}" for p in KERNEL_REPOS.glob("*/*") if p.is_dir())
            raise FileNotFoundError(
                f"no shipped kernel repo {repo_id!r} at {source}; kernel_repos/ holds: {shipped or 'nothing'}"
            )
        target = serve_as or repo_id
        if target in self._shipped:
            sha = self._shipped[target]
        else:
            sha = self.add_repo(target, source, message=f"shipped copy of {repo_id}")
            self._shipped[target] = sha
        for version in versions:
            branch = f"v{int(version)}"
            if not self._git(target, "branch", "--list", branch):
                self.create_branch(target, branch, sha)
        return sha


@dataclass
class HubEnv:
    """What ``hub_env`` set up for one test (see the module docstring)."""

    server: HubServer
    endpoint: str
    cache_dir: Path
    hf_home: Path
    monkeypatch: pytest.MonkeyPatch

    @property
    def hf_cache(self) -> Path:
        """The huggingface_hub cache folder (``HF_HOME/hub``)."""
        return self.hf_home / "hub"

    def set_offline(self, offline: bool = True) -> None:
        """Set or clear ``HF_HUB_OFFLINE`` both in the environment and in huggingface_hub."""
        if offline:
            self.monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        else:
            self.monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        import huggingface_hub.constants as hf_constants

        self.monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", offline)
        reset_hub_sessions()


@pytest.fixture(scope="session")
def hub_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    """A running olah server on 127.0.0.1 for the whole session (see the module docstring)."""
    try:
        olah_cli = find_olah()
    except FileNotFoundError as err:
        pytest.fail(str(err), pytrace=False)
    root = tmp_path_factory.mktemp("hub")
    server = HubServer(root, olah_cli)
    for attempt in range(3):
        try:
            server.start()
            break
        except RuntimeError:
            # Another process may have taken the free port between probe and bind.
            if attempt == 2:
                raise
            server.port = _free_port()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def hub_env(hub_server: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubEnv]:
    """Environment pointing at ``hub_server`` with fresh caches (see the module docstring)."""
    if not hub_server.running:
        hub_server.start()
    cache_dir = tmp_path / "kernel-cache"
    hf_home = tmp_path / "hf-home"
    cache_dir.mkdir()
    hf_home.mkdir()
    monkeypatch.setenv("HF_ENDPOINT", hub_server.endpoint)
    monkeypatch.setenv("KERNEL_LOADER_CACHE", str(cache_dir))
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("KERNEL_LOADER_STATE_DIR", str(tmp_path / "kernel-loader-state"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    for name in (
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "LOCAL_KERNELS",
        "KERNEL_LOADER_TRUSTED_ORGS",
        "KERNEL_LOADER_NO_BUNDLED",
    ):
        monkeypatch.delenv(name, raising=False)

    # huggingface_hub copied the variables into module globals when it was first imported.
    import huggingface_hub.constants as hf_constants
    import huggingface_hub.hf_api as hf_api

    import huggingface_hub.file_download as hf_file_download

    url_template = hub_server.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(hf_constants, "ENDPOINT", hub_server.endpoint)
    monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE", url_template)
    if hasattr(hf_file_download, "HUGGINGFACE_CO_URL_TEMPLATE"):
        # huggingface_hub 0.x builds download URLs from its own import-time copy.
        monkeypatch.setattr(hf_file_download, "HUGGINGFACE_CO_URL_TEMPLATE", url_template)
    monkeypatch.setattr(hf_constants, "HF_HOME", str(hf_home))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_api.api, "endpoint", hub_server.endpoint)
    reset_hub_sessions()
    yield HubEnv(hub_server, hub_server.endpoint, cache_dir, hf_home, monkeypatch)
    # Restore the variables before dropping sessions, so no later test inherits an offline one.
    monkeypatch.undo()
    reset_hub_sessions()
