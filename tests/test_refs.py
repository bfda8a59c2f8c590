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
