"""Every input gets an answer, never a traceback: each failure is a documented error class with
its exit code (errors.EXIT_CODES, the table in docs/cli.md), JSON with --json, and every command
a message advises is one that works when run as printed."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_loader import cli, errors, loader
from test_loader import fresh_memo, two_variant_files  # noqa: F401 (fixture)

SHA = "a" * 40
BIN = Path(sys.executable).parent
KNOWN_CODES = set(errors.EXIT_CODES)


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    assert code in KNOWN_CODES and code != cli.EXIT_INTERNAL, (code, out.err)
    return code, out.out, out.err


def shell(*argv, env=None, cwd=None):
    """Run the installed console script, as a user would."""
    proc = subprocess.run([str(BIN / "kernel-loader"), *argv], capture_output=True, text=True, timeout=300,
                          env=env or os.environ.copy(), cwd=cwd)
    assert "Traceback" not in proc.stderr + proc.stdout
    return proc


def advice(text: str) -> list[str]:
    """The commands a message tells the user to run next."""
    return re.findall(r"`((?:env -u HF_HUB_OFFLINE )?kernel-loader [^`]+)`", text)


def run_advice(command: str, env=None) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    env = dict(env or os.environ)
    if argv[:3] == ["env", "-u", "HF_HUB_OFFLINE"]:
        env.pop("HF_HUB_OFFLINE", None)
        argv = argv[3:]
    assert argv[0] == "kernel-loader"
    return shell(*argv[1:], env=env)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("KERNEL_LOADER_CACHE", str(cache))
    monkeypatch.setenv("KERNEL_LOADER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    monkeypatch.chdir(tmp_path)
    return cache


def write_lock(path: Path, entries) -> Path:
    path.write_text(json.dumps(entries))
    return path


BAD_LOCKS = {
    "variants value not an object": [{"repo_id": "kernels-community/x", "sha": SHA, "variants": {"torch-universal": "abc"}}],
    "variants a string": [{"repo_id": "kernels-community/x", "sha": SHA, "variants": "torch-universal"}],
    "dependency a string": [{"dependency": "kernels-community/x", "lock": {"commit": SHA}}],
    "lock a list": [{"dependency": {"repo-id": "kernels-community/x"}, "lock": [SHA]}],
}


@pytest.mark.parametrize("case", sorted(BAD_LOCKS))
def test_a_malformed_lock_file_is_a_lockfile_error_everywhere(case, offline_cache, tmp_path, capsys):
    lock = write_lock(tmp_path / "kernels.lock", BAD_LOCKS[case])
    for argv in (["verify", "--lock", str(lock)], ["download", "--lock", str(lock)],
                 ["cache", "prune", "--keep-lock", str(lock)]):
        code, _, err = run(capsys, *argv)
        assert code == errors.LockfileError.exit_code == 2 and str(lock) in err, (argv, err)
    with pytest.raises(errors.LockfileError, match="entry 0"):
        loader.load_kernel("kernels-community/x", lockfile=lock)


def test_a_lock_variant_name_with_thousands_of_digits(offline_cache, tmp_path, capsys):
    from kernel_loader.variants import parse_variant

    name = "torch2" + "9" * 5000 + "-cxx11-cu" + "1" * 5000 + "-x86_64-linux"
    assert parse_variant(name).kind == "unknown"
    lock = write_lock(tmp_path / "kernels.lock", [{"repo_id": "kernels-community/x", "sha": SHA, "variants": {name: {}}}])
    with pytest.raises(errors.KernelLoaderError):
        loader.load_kernel("kernels-community/x", lockfile=lock)
    code, _, _ = run(capsys, "verify", "--lock", str(lock))
    assert code == errors.KernelNotFoundError.exit_code


def test_pyproject_with_a_malformed_tool_table(tmp_path, capsys):
    for text in ("[tool]\nkernels = 1\n", "tool = 3\n", "[tool.kernels]\ndependencies = 'x'\n"):
        (tmp_path / "pyproject.toml").write_text(text)
        code, _, err = run(capsys, "lock", str(tmp_path))
        assert code == 2 and "[tool.kernels.dependencies]" in err


def test_lock_output_into_a_missing_folder_or_onto_a_folder(tmp_path, capsys):
    (tmp_path / "pyproject.toml").write_text('[tool.kernels.dependencies]\n"kernels-community/x" = 1\n')
    code, _, err = run(capsys, "lock", str(tmp_path), "-o", str(tmp_path / "missing" / "kernels.lock"))
    assert code == 2 and "does not exist" in err and f"mkdir -p {tmp_path / 'missing'}" in err
    code, _, err = run(capsys, "lock", str(tmp_path), "-o", str(tmp_path))
    assert code == 2 and "is a folder" in err


def test_cache_dir_that_is_a_file(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv in (["download", "kernels-community/x", "--cache-dir", str(afile)], ["--cache-dir", str(afile), "cache", "ls"]):
        code, _, err = run(capsys, *argv)
        assert code == errors.CacheError.exit_code and "is a file, not a folder" in err


@pytest.mark.parametrize("machine, says", [
    ("{bad", "not valid JSON"),
    ('{"foo": 1}', "unknown fields foo"),
    ("[1, 2]", "must be a JSON object"),
    ('{"torch_version": "2.8", "backend": "tpu", "cpu_arch": "x86_64", "os": "linux"}', "backend 'tpu'"),
    ('{"torch_version": 2.8, "backend": "cpu", "cpu_arch": "x86_64", "os": "linux"}', "torch_version must be a string"),
    ('{"torch_version": "2.8", "backend": "cuda", "cpu_arch": "x86_64", "os": "linux", "gpu_capability": [9]}', "gpu_capability"),
    ("/no/such/machine.json", "neither JSON text nor a readable file"),
])
def test_explain_machine_that_is_not_a_machine(machine, says, offline_cache, capsys):
    code, _, err = run(capsys, "explain", "kernels-community/x", "--machine", machine)
    assert code == errors.InvalidArgumentError.exit_code and says in err


def test_local_kernels_naming_an_unknown_user(offline_cache, monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_KERNELS", "kernels-community/x=~nosuchuser-kl/k")
    code, _, err = run(capsys, "explain", "kernels-community/x")
    assert code == 2 and "unknown user" in err and "LOCAL_KERNELS" in err
    with pytest.raises(errors.InvalidKernelRefError, match="unknown user"):
        loader.get_kernel("kernels-community/x")


def test_bad_arguments_on_the_command_line(offline_cache, capsys):
    for argv, says in (
        (["explain", "kernels-community/x", "--version", "abc"], "non-negative whole number"),
        (["explain", "kernels-community/x", "--version", "-1"], "non-negative whole number"),
        (["explain", "kernels-community/x", "--version", "1.5"], "non-negative whole number"),
        (["explain", "kernels-community/x", "--backend", "tpu"], "known: cuda, rocm, xpu, metal, cpu"),
        (["frobnicate"], "invalid choice"),
        (["cache"], "required"),
        (["explain"], "required"),
        (["download"], "give kernel ids"),
        (["download", "kernels-community/x", "../evil"], "'..' is not allowed"),
    ):
        code, _, err = run(capsys, *argv)
        assert code == 2 and says in err and err.startswith("error: ") and len(err.strip().splitlines()) <= 3, (argv, err)


def test_json_makes_errors_json(offline_cache, capsys):
    code, out, err = run(capsys, "--json", "frobnicate")
    data = json.loads(out)
    assert code == 2 and data["error"]["type"] == "UsageError" and data["error"]["exit_code"] == 2 and not err
    code, out, _ = run(capsys, "explain", "kernels-community/not-cached", "--json")
    row = json.loads(out)  # one id: one object, its error inside
    assert code == 3 and row["id"] == "kernels-community/not-cached" and row["error"]["type"] == "OfflineKernelMissingError"
    code, out, _ = run(capsys, "cache", "rm", "kernels-community/x", "--json")
    assert code == 3 and json.loads(out)[0]["error"]["type"] == "KernelNotFoundError"


def test_offline_advice_says_to_unset_hf_hub_offline_and_works(hub_env, hub_server, capsys):
    repo_id = hub_server.new_repo_id("offadvice", org="kernels-community")
    hub_server.add_repo(repo_id, two_variant_files(3, "offadvice"))
    hub_env.set_offline(True)
    proc = shell("download", repo_id)
    assert proc.returncode == errors.OfflineKernelMissingError.exit_code
    commands = advice(proc.stderr)
    assert commands and all(c.startswith("env -u HF_HUB_OFFLINE ") for c in commands if " download " in c)
    assert f"`kernel-loader download {repo_id}`" not in proc.stderr  # not the command that just failed
    for command in commands:
        assert run_advice(command).returncode == 0, command
    assert shell("cache", "ls").stdout.count(repo_id) == 1
    # a kernel the package also ships: download still refuses the shipped copy, says why once
    hub_server.add_shipped_repo("kernels-community/flash-attn2", versions=(1,))
    proc = shell("download", "kernels-community/flash-attn2")
    assert proc.returncode == errors.OfflineKernelMissingError.exit_code and "warning" not in proc.stderr
    assert proc.stderr.count("HF_HUB_OFFLINE=1") == 1, proc.stderr
    commands = advice(proc.stderr)
    assert commands == ["env -u HF_HUB_OFFLINE kernel-loader download kernels-community/flash-attn2"]
    assert run_advice(commands[0]).returncode == 0


def test_a_failing_explain_does_not_advise_itself(hub_env, capsys):
    code, _, err = run(capsys, "explain", "kernels-community/no-such-kernel-here")
    assert code == 3 and "kernel-loader explain kernels-community/no-such-kernel-here" not in err
    assert not re.search(r"[A-Z]\w+(Error|Exception)", err), err  # no library exception class names
    assert err.count("kernels-community/no-such-kernel-here") == 1, err  # the id once
    code, _, err = run(capsys, "download", "kernels-community/no-such-kernel-here")
    assert code == 3 and not re.search(r"[A-Z]\w+(Error|Exception)", err), err
    for command in advice(err):
        assert run_advice(command).returncode == 3  # explain of a missing repo says so, without a traceback


def test_integrity_failure_advice_repairs_the_snapshot(hub_env, hub_server, tmp_path, monkeypatch, capsys):
    repo_id = hub_server.new_repo_id("damaged", org="kernels-community")
    hub_server.add_repo(repo_id, two_variant_files(5, "damaged"))
    hub_server.create_branch(repo_id, "v1")
    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text(f'[tool.kernels.dependencies]\n"{repo_id}" = 1\n')
    monkeypatch.chdir(project)
    assert run(capsys, "lock")[0] == 0
    assert run(capsys, "download", "--lock", "kernels.lock")[0] == 0
    impl = next(hub_env.cache_dir.glob(f"models--*damaged*/snapshots/*/build/torch-universal/damaged/_impl.py"))
    impl.write_text(impl.read_text().replace("return 5", "return 666"))  # writes through to the blob
    code, out, _ = run(capsys, "verify")
    assert code == errors.KernelIntegrityError.exit_code and "MISMATCH" in out
    with pytest.raises(errors.KernelIntegrityError) as info:
        loader.load_kernel(repo_id)
    commands = advice(str(info.value)) + advice(out)
    assert commands
    for command in commands:
        if command.startswith("kernel-loader lock"):
            continue  # re-locking accepts the change; the repair is the other advice
        assert run_advice(command).returncode == 0, command
    loader.clear_memo()
    assert loader.load_kernel(repo_id).answer() == 5
    assert run(capsys, "verify")[0] == 0


def test_download_force_refetches_a_partial_snapshot(hub_env, hub_server, capsys):
    repo_id = hub_server.new_repo_id("partial", org="kernels-community")
    sha = hub_server.add_repo(repo_id, two_variant_files(4, "partial"))
    assert run(capsys, "download", f"{repo_id}@main")[0] == 0
    impl = next(hub_env.cache_dir.glob("models--*partial*/snapshots/*/build/torch-universal/partial/_impl.py"))
    impl.unlink()
    impl.resolve().unlink() if impl.is_symlink() else None
    code, out, _ = run(capsys, "download", f"{repo_id}@main", "--force", "--json")
    assert code == 0 and json.loads(out)[0]["sha"] == sha
    assert "return 4" in impl.read_text()


def test_download_reports_each_id_even_when_one_fails(hub_env, hub_server, capsys):
    repo_id = hub_server.new_repo_id("first", org="kernels-community")
    hub_server.add_repo(repo_id, two_variant_files(1, "first"))
    code, out, err = run(capsys, "download", repo_id, "kernels-community/absent-second")
    assert code == errors.KernelNotFoundError.exit_code
    assert repo_id in out and "absent-second" in err
    code, out, _ = run(capsys, "download", "kernels-community/absent-second", repo_id, "--json")
    rows = json.loads(out)
    assert code == 3 and rows[0]["error"]["exit_code"] == 3 and rows[1]["repo_id"] == repo_id


def test_warnings_are_one_clean_line(offline_cache):
    env = {**os.environ, "KERNEL_LOADER_CACHE": str(offline_cache), "HF_HUB_OFFLINE": "1"}
    proc = shell("explain", "kernels-community/flash-attn2", env=env)
    warnings_seen = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 0 and len(warnings_seen) == 1 and warnings_seen[0].startswith("warning: ")
    assert "sys.exit" not in proc.stderr and "kernel-loader:" not in proc.stderr
    assert "`kernel-loader explain kernels-community/flash-attn2`" not in proc.stderr
    assert "get_bundled_kernel" not in proc.stderr


def test_messages_do_not_name_internal_functions(offline_cache, monkeypatch):
    monkeypatch.setenv("KERNEL_LOADER_NO_BUNDLED", "0")
    import warnings as w

    with w.catch_warnings(record=True) as caught:
        w.simplefilter("always")
        from kernel_loader.sources import bundled

        monkeypatch.setattr(bundled, "_warned", set())
        loader.get_bundled_kernel("kernels-community/flash-attn2")
    assert caught and all("get_bundled_kernel" not in str(c.message) for c in caught)


def test_version_flag(capsys):
    from kernel_loader import __version__

    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"kernel-loader {__version__}"


# -- any argv: no traceback, an exit code from the table ------------------------------------------

VERBS = ["download", "lock", "explain", "variants", "info", "versions", "verify", "cache", "ls", "prune", "rm", "doctor"]
WORDS = st.sampled_from(VERBS + ["--json", "--cache-dir", "--version", "--backend", "--machine", "--lock", "--force",
                                 "--revision", "--dry-run", "-o", "kernels-community/x", "org/y@v1", "x", "", "..",
                                 "{bad", "-1", "abc", "~nouser", "/dev/null", "--help"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(WORDS, st.text(max_size=12)), max_size=6))
def test_any_argv_gets_an_exit_code_from_the_table(offline_cache, capsys, argv):
    if "doctor" in argv or "download" in argv or "lock" in argv:
        argv = [a for a in argv if a not in ("doctor", "download", "lock")]  # no network in a fuzz run
    run(capsys, *argv)


def test_verify_advice_fetches_what_is_missing(hub_env, hub_server, tmp_path, monkeypatch, capsys):
    repo_id = hub_server.new_repo_id("verifyme", org="kernels-community")
    hub_server.add_repo(repo_id, two_variant_files(6, "verifyme"))
    hub_server.create_branch(repo_id, "v1")
    (tmp_path / "pyproject.toml").write_text(f'[tool.kernels.dependencies]\n"{repo_id}" = 1\n')
    monkeypatch.chdir(tmp_path)
    assert run(capsys, "lock")[0] == 0
    code, out, _ = run(capsys, "verify")
    assert code == errors.KernelNotFoundError.exit_code and "missing" in out
    [command] = set(advice(out))
    assert run_advice(command).returncode == 0
    assert run(capsys, "verify")[0] == 0
    # and `cache rm` of something absent points at `cache ls`, which answers
    code, _, err = run(capsys, "cache", "rm", "kernels-community/never-cached")
    assert code == 3 and [run_advice(c).returncode for c in advice(err)] == [0]


def test_info_of_a_folder_with_odd_metadata(tmp_path, capsys):
    from test_loader import make_repo

    make_repo(tmp_path / "odd", {"torch-universal": {"metadata.json": '{"backend": "cuda", "python-depends": "x"}',
                                                     "__init__.py": ""},
                                 "torch-weird": {"metadata.json": "[1]", "__init__.py": ""}})
    code, out, _ = run(capsys, "info", str(tmp_path / "odd"), "--json")
    data = json.loads(out)
    assert code == 0 and data["builds"] == ["torch-universal", "torch-weird"] and data["python_depends"] == []


def test_doctor_reports_a_malformed_local_kernels_instead_of_failing(offline_cache, monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_KERNELS", "not a mapping")
    code, out, _ = run(capsys, "doctor")
    assert code == 0 and "local:     invalid: LOCAL_KERNELS='not a mapping' is not understood" in out
    assert "unset HF_HUB_OFFLINE" in out
