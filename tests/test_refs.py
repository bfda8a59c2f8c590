import pytest

from kernel_loader.errors import InvalidKernelRefError
from kernel_loader.refs import KernelRef, looks_like_kernel_ref


@pytest.mark.parametrize(
    "text, expected",
    [
        ("org/name", ("org/name", None, None, None)),
        ("org/name@v1", ("org/name", "v1", None, None)),
        ("org/name:flash_attn_func", ("org/name", None, "flash_attn_func", None)),
        ("kernels-community/flash-attn2@0123abcd:fn", ("kernels-community/flash-attn2", "0123abcd", "fn", None)),
        ("paged|org/name", ("org/name", None, None, "paged")),
        ("paged|org/na.me_2@main:f2", ("org/na.me_2", "main", "f2", "paged")),
    ],
)
def test_accepted_forms_round_trip(text, expected):
    ref = KernelRef.parse(text)
    assert (ref.repo_id, ref.revision, ref.function, ref.wrapper) == expected
    assert (ref.org, ref.name) == tuple(expected[0].split("/"))
    assert str(ref) == text
    assert KernelRef.parse(str(ref)) == ref


@pytest.mark.parametrize(
    "text",
    [
        "", "org", "/name", "org/", "org/name/extra", "org/name@", "org/name:", "org/name@v1@v2",
        "org/name:a:b", "../etc/passwd", "org/..", "org/a..b", "/abs/path", "C:\\kernels\\x", "C:/k/x",
        "org/na me", " org/name", "org/name\n", "org/na\x00me", "org\\name", "a|b|org/name", "|org/name",
        "org/name@rev:1fn", "-org/name", "org/name.", "org/a--b", "o" * 100 + "/name", "org/" + "n" * 300,
        "org/name@" + "r" * 300, "~/x/y",
    ],
)
def test_rejected_forms_quote_the_id_and_show_accepted_forms(text):
    with pytest.raises(InvalidKernelRefError) as info:
        KernelRef.parse(text)
    message = str(info.value)
    assert "Accepted forms" in message
    assert repr(text[:120])[:20] in message
    assert isinstance(info.value, ValueError)


def test_non_string_is_rejected():
    with pytest.raises(InvalidKernelRefError, match="expected a string"):
        KernelRef.parse(None)  # type: ignore[arg-type]


def test_diagnosis_names_the_problem():
    with pytest.raises(InvalidKernelRefError, match="exactly one '/'"):
        KernelRef.parse("a/b/c")
    with pytest.raises(InvalidKernelRefError, match="revision after '@' is empty"):
        KernelRef.parse("a/b@")


def test_looks_like_kernel_ref():
    assert looks_like_kernel_ref("kernels-community/flash-attn2")
    assert looks_like_kernel_ref("paged|org/name@v1:fn")
    assert looks_like_kernel_ref("org/../x")  # has the shape; parse() still refuses it
    for name in ("sdpa", "flash_attention_2", "", "org name/x", None, 3):
        assert not looks_like_kernel_ref(name)


def test_from_parts_and_conflicts():
    assert str(KernelRef.from_parts("org/name", "v2")) == "org/name@v2"
    assert KernelRef.from_parts("org/name@v2", "v2").revision == "v2"
    with pytest.raises(InvalidKernelRefError, match="also given"):
        KernelRef.from_parts("org/name@v1", "v2")
    with pytest.raises(InvalidKernelRefError):
        KernelRef.from_parts("org/name", "../x")


def test_repo_id_never_escapes_the_cache(tmp_path):
    from kernel_loader.cache import repo_folder

    for text in ("org/name", "a.b/c_d-e", "paged|x/y@v1"):
        folder = repo_folder(KernelRef.parse(text).repo_id, "model", tmp_path)
        assert folder.parent == tmp_path


# -- arguments beside the id, checked at the public entry points before any disk or network work --

import kernel_loader  # noqa: E402
from kernel_loader.errors import InvalidArgumentError, KernelFunctionNotFoundError  # noqa: E402
from kernel_loader.machine import Machine  # noqa: E402
from kernel_loader.refs import check_backend, check_function, check_version  # noqa: E402


@pytest.fixture
def no_io(monkeypatch, tmp_path):
    """Any Hub call, cache read or lock search fails the test: the argument must be refused first."""
    from kernel_loader import cache, lockfile
    from kernel_loader.sources import hub

    def forbidden(*args, **kwargs):
        raise AssertionError("touched the network or the disk before checking the arguments")

    for module, name in ((hub, "remote_repo"), (cache, "find_snapshot"), (cache, "cached_refs"), (lockfile, "find_lockfile"),
                         (lockfile, "lock_for")):
        monkeypatch.setattr(module, name, forbidden)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("version", ["abc", 1.5, -1, True, False, "1"])
def test_version_must_be_a_non_negative_int(version, no_io):
    with pytest.raises(InvalidArgumentError, match="version="):
        check_version(version)
    for call in (kernel_loader.get_kernel, kernel_loader.has_kernel, kernel_loader.resolve_kernel):
        with pytest.raises(InvalidArgumentError, match=r"whole number N >= 0|negative"):
            call("kernels-community/flash-attn2", version=version)


def test_good_versions_pass():
    assert check_version(None) is None and check_version(0) == 0 and check_version(3) == 3


def test_backend_is_one_of_the_known_backends(no_io):
    cpu = Machine("2.8", True, "cpu", None, "x86_64", "linux")
    with pytest.raises(InvalidArgumentError) as info:
        check_backend("tpu", cpu)
    text = str(info.value)
    assert "known: cuda, rocm, xpu, metal, cpu" in text and "this machine has cpu" in text and "'cpu' or 'cpu'" not in text
    with pytest.raises(InvalidArgumentError, match="not a known backend"):
        kernel_loader.get_kernel("kernels-community/flash-attn2", backend="tpu")
    with pytest.raises(InvalidArgumentError, match="not available here"):
        kernel_loader.resolve_kernel("kernels-community/flash-attn2", backend="cuda", machine=cpu)
    with pytest.raises(InvalidArgumentError, match="not a known backend"):
        kernel_loader.get_local_kernel(".", backend=3)
    assert check_backend("cpu", cpu) == "cpu" and check_backend(None) is None


def test_load_kernel_checks_the_id_before_looking_for_a_lock(no_io):
    with pytest.raises(InvalidKernelRefError, match="'..' is not allowed"):
        kernel_loader.load_kernel("../x")


def test_a_function_the_kernel_lacks_is_named_with_what_it_has():
    import types

    module = types.ModuleType("toy")
    module.flash_attn_func = lambda: None
    module._private = 1
    check_function(module, KernelRef.parse("org/toy:flash_attn_func"))
    with pytest.raises(KernelFunctionNotFoundError, match=r"org/toy has no function 'nope'; it has: flash_attn_func$"):
        check_function(module, KernelRef.parse("org/toy:nope"))


def test_get_kernel_refuses_a_missing_function(tmp_path, monkeypatch):
    from test_loader import kernel_files, make_repo

    from kernel_loader import loader

    loader.clear_memo()
    make_repo(tmp_path / "toy", {"torch-universal": kernel_files(7, "fnkernel")})
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-community/fnkernel={tmp_path / 'toy'}")
    assert kernel_loader.get_kernel("kernels-community/fnkernel:answer").answer() == 7
    with pytest.raises(KernelFunctionNotFoundError, match="has no function 'nope'; it has: .*answer"):
        kernel_loader.get_kernel("kernels-community/fnkernel:nope")
    loader.clear_memo()


# -- any argument values to the public entry points: one of our errors, nothing else -------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kernel_loader.errors import KernelLoaderError  # noqa: E402

VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False, width=16),
                   st.sampled_from(["org/x", "kernels-community/x@v1", "x", "", "..", "cpu", "tpu", "abc", "~nouser/k"]),
                   st.text(max_size=8), st.lists(st.integers(), max_size=2))


@pytest.fixture
def empty_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_LOADER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KERNEL_LOADER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KERNEL_LOADER_NO_BUNDLED", "1")
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    monkeypatch.chdir(tmp_path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(repo_id=VALUES, revision=VALUES, version=VALUES, backend=VALUES, lock=VALUES)
def test_any_arguments_raise_only_our_errors(empty_offline, repo_id, revision, version, backend, lock):
    from kernel_loader import loader

    calls = (
        lambda: loader.get_kernel(repo_id, revision, version=version, backend=backend),
        lambda: loader.has_kernel(repo_id, revision, version=version),
        lambda: loader.resolve_kernel(repo_id, revision, version=version, backend=backend, download=False),
        lambda: loader.load_kernel(repo_id, lockfile=lock),
        lambda: loader.get_local_kernel(repo_id, backend=backend),
    )
    for call in calls:
        try:
            call()
        except KernelLoaderError:
            pass


def test_a_path_with_a_nul_character_is_refused_before_the_filesystem():
    from kernel_loader import loader
    from kernel_loader.errors import InvalidArgumentError

    for bad in ("\x00", "kernels/\x00x"):
        with pytest.raises(InvalidArgumentError, match="NUL"):
            loader.get_local_kernel(bad)
