"""``kernel_loader.install_flash_attn()``: ``import flash_attn`` without the flash-attn package.

What the stand-in promises: the four module names import (without torch); ``importlib.metadata``
and transformers' own availability checks see flash-attn 2.8.3 / FlashAttention 3; the functions
keep flash-attn's signatures and compute on the fallback chain's kernel; ``bert_padding`` has
flash-attn's semantics; a real flash_attn always wins; the chain and ``kernel-loader explain``
name the stand-in. Model-level paths (GPT-Neo, Falcon, Bark, generate_batch) are in
test_flash_attn_compat_models.py.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kernel_loader
from kernel_loader import flash_attn_compat
from kernel_loader.errors import UnsupportedAttentionOptionError, UnusableKernelError

REPO_ROOT = Path(__file__).resolve().parents[2]
DOC = REPO_ROOT / "docs" / "transformers.md"
STAND_IN_MODULES = ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn.bert_padding", "flash_attn_interface",
                    "flash_attn_3")

import transformers as _transformers  # noqa: E402

_TRANSFORMERS_4 = _transformers.__version__.startswith("4.")


def doc_block(test_id: str) -> str:
    """The fenced block of docs/transformers.md that the ``run-by`` comment hands to ``test_id``."""
    text = DOC.read_text()
    marker = f"<!-- run-by: {test_id} -->"
    assert marker in text, f"docs/transformers.md has no block for {test_id}"
    after = text.split(marker, 1)[1].lstrip("\n")
    assert after.startswith("```"), f"the run-by comment for {test_id} is not followed by a code block"
    return after.split("\n", 1)[1].split("\n```", 1)[0] + "\n"


def drop_flash_attn_modules() -> None:
    for name in list(sys.modules):
        if name == "flash_attn" or name.startswith("flash_attn.") or name in ("flash_attn_interface", "flash_attn_3"):
            del sys.modules[name]


@pytest.fixture
def stand_in(offline_shipped):
    assert kernel_loader.install_flash_attn() is True
    try:
        yield
    finally:
        kernel_loader.uninstall_flash_attn()
        drop_flash_attn_modules()


def reference(q, k, v, causal):
    """SDPA in float64 on [B, S, H, D] tensors (GQA by repeating kv heads)."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    mask = None
    if causal:  # bottom-right aligned, as flash-attn >= 2.1
        sq, sk = q.shape[2], k.shape[2]
        mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def qkv(b=2, sq=8, sk=8, hq=4, hk=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, sq, hq, d, generator=g), torch.randn(b, sk, hk, d, generator=g),
            torch.randn(b, sk, hk, d, generator=g))


# ----------------------------------------------------------------------------------------------
# importing


def test_install_is_idempotent_and_uninstall_removes_modules_and_metadata(offline_shipped):
    try:
        assert kernel_loader.install_flash_attn() is True
        assert kernel_loader.install_flash_attn() is False
        import flash_attn

        assert flash_attn.__version__ == flash_attn_compat.FLASH_ATTN_VERSION == "2.8.3"
        assert metadata.version("flash_attn") == metadata.version("flash-attn") == "2.8.3"
    finally:
        assert kernel_loader.uninstall_flash_attn() is True
    assert kernel_loader.uninstall_flash_attn() is False
    assert "flash_attn" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("flash_attn")
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("flash_attn")


def test_importing_the_stand_in_imports_neither_torch_nor_a_kernel():
    script = textwrap.dedent(
        """
        import sys
        import kernel_loader
        kernel_loader.install_flash_attn()
        import flash_attn, flash_attn.flash_attn_interface, flash_attn.bert_padding, flash_attn_interface, flash_attn_3
        from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
        from flash_attn.bert_padding import pad_input, unpad_input, index_first_axis
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton", "huggingface_hub"))
        print("HEAVY", heavy)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout


def test_every_module_name_imports_with_flash_attns_public_names(stand_in):
    import flash_attn
    import flash_attn.bert_padding
    import flash_attn.flash_attn_interface
    import flash_attn_3
    import flash_attn_interface

    for name in STAND_IN_MODULES:
        assert flash_attn_compat.is_stand_in(sys.modules[name])
    for fn in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_qkvpacked_func",
               "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func"):
        assert getattr(flash_attn, fn) is getattr(flash_attn.flash_attn_interface, fn)
    for fn in ("pad_input", "unpad_input", "index_first_axis", "index_put_first_axis",
               "unpad_input_for_concatenated_sequences"):
        assert callable(getattr(flash_attn.bert_padding, fn))
    assert flash_attn_interface.__version__ == "3.0.0"
    for fn in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"):  # FA3's package name too
        assert getattr(flash_attn_3, fn) is getattr(flash_attn_interface, fn)
    assert flash_attn_3.__version__ == "3.0.0"


def test_signatures_are_flash_attns_because_transformers_reads_them(stand_in):
    import flash_attn
    import flash_attn_interface

    varlen2 = inspect.signature(flash_attn.flash_attn_varlen_func).parameters
    assert {"dropout_p", "window_size", "softcap", "deterministic", "block_table", "max_seqlen_q"} <= set(varlen2)
    kv2 = inspect.signature(flash_attn.flash_attn_with_kvcache).parameters
    assert {"block_table", "cache_seqlens", "return_softmax_lse"} <= set(kv2)
    varlen3 = inspect.signature(flash_attn_interface.flash_attn_varlen_func).parameters
    assert "dropout_p" not in varlen3 and {"seqused_k", "qv", "attention_chunk"} <= set(varlen3)
    kv3 = inspect.signature(flash_attn_interface.flash_attn_with_kvcache).parameters
    assert "page_table" in kv3 and "block_table" not in kv3


# ----------------------------------------------------------------------------------------------
# what transformers sees


def test_metadata_answers_as_an_installed_flash_attn(stand_in):
    mapping = metadata.packages_distributions()
    assert [d.replace("_", "-") for d in mapping["flash_attn"]] == ["flash-attn"]
    assert [d.replace("_", "-") for d in mapping["flash_attn_interface"]] == ["flash-attn-3"]
    assert metadata.version("flash_attn_3") == "3.0.0"
    assert "install_flash_attn" in metadata.metadata("flash-attn")["Summary"]


def test_transformers_own_checks_accept_it(stand_in, cuda_answered_yes, monkeypatch):
    """transformers' real functions, with its CUDA gate answered yes (flash-attn is only ever used
    on CUDA; here the CPU stands in for that machine) -- and the same checks refuse without it."""
    from transformers.utils import import_utils

    checks = (import_utils.is_flash_attn_2_available, import_utils.is_flash_attn_3_available,
              import_utils.is_flash_attn_greater_or_equal)
    for check in checks:
        getattr(check, "cache_clear", lambda: None)()  # cached in 5.x, not in 4.57
    assert import_utils.is_flash_attn_2_available()
    assert import_utils.is_flash_attn_3_available()  # 4.57 looks for the module flash_attn_3, 5.x for flash_attn_interface
    assert import_utils.is_flash_attn_greater_or_equal("2.3.3")
    assert import_utils.is_flash_attn_greater_or_equal("2.8.3")
    assert not import_utils.is_flash_attn_greater_or_equal("2.9")
    if hasattr(import_utils, "is_flash_attn_4_available"):  # 5.x
        assert not import_utils.is_flash_attn_4_available()  # FA4 also lives under flash_attn; we are not FA4
    kernel_loader.uninstall_flash_attn()  # clears transformers' cached answers itself
    assert not import_utils.is_flash_attn_2_available()
    assert not import_utils.is_flash_attn_greater_or_equal("2.3.3")


def test_transformers_import_time_distribution_map_is_refreshed(offline_shipped, monkeypatch):
    """transformers up to 5.17 maps import names to distributions once, when it is imported."""
    from transformers.utils import import_utils

    mapping = dict(metadata.packages_distributions())
    monkeypatch.setattr(import_utils, "PACKAGE_DISTRIBUTION_MAPPING", mapping, raising=False)
    assert "flash_attn" not in mapping
    kernel_loader.install_flash_attn()
    try:
        assert mapping["flash_attn"] == ["flash_attn"] and mapping["flash_attn_interface"] == ["flash_attn_3"]
    finally:
        kernel_loader.uninstall_flash_attn()
    assert "flash_attn" not in mapping and "flash_attn_interface" not in mapping


def _real_package_on_sys_path(tmp_path, monkeypatch, module_file: str, dist: str, version: str, top_level: str) -> None:
    """A real (tiny) package: ``module_file`` (a path under site-packages) and its dist-info."""
    site = tmp_path / "site"
    (site / module_file).parent.mkdir(parents=True, exist_ok=True)
    (site / module_file).write_text(f"__version__ = {version!r}\nREAL = True\n")
    info = site / f"{dist}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(top_level + "\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    drop_flash_attn_modules()
    kernel_loader.install_flash_attn()


def test_a_real_flash_attn_on_sys_path_wins(tmp_path, offline_shipped, monkeypatch):
    _real_package_on_sys_path(tmp_path, monkeypatch, "flash_attn/__init__.py", "flash_attn", "2.7.4", "flash_attn")
    try:
        import flash_attn

        assert getattr(flash_attn, "REAL", False) and not flash_attn_compat.is_stand_in(flash_attn)
        assert metadata.version("flash_attn") == "2.7.4"
        assert [d for d in metadata.packages_distributions()["flash_attn"]] == ["flash_attn"]
        with pytest.raises(ModuleNotFoundError):  # the stand-in never grafts modules onto a real package
            importlib.import_module("flash_attn.bert_padding")
        assert "the real flash_attn package is installed" in flash_attn_compat.describe("flash_attention_2")
        # FA3 is not installed there, so its stand-in still serves
        assert metadata.version("flash_attn_3") == "3.0.0"
    finally:
        kernel_loader.uninstall_flash_attn()
        drop_flash_attn_modules()


def test_a_real_flash_attention_3_takes_both_of_its_names(tmp_path, offline_shipped, monkeypatch):
    """FlashAttention 3 installs ``flash_attn_interface`` and the package ``flash_attn_3``: when
    the real one provides either, the stand-in serves neither (no half-real, half-stand-in FA3)."""
    _real_package_on_sys_path(tmp_path, monkeypatch, "flash_attn_interface.py", "flash_attn_3", "3.0.0b1",
                              "flash_attn_interface")
    try:
        import flash_attn_interface

        assert getattr(flash_attn_interface, "REAL", False)
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("flash_attn_3")
        assert metadata.version("flash_attn_3") == "3.0.0b1"
        import flash_attn  # FA2 is not installed there: its stand-in still serves

        assert flash_attn_compat.is_stand_in(flash_attn)
    finally:
        kernel_loader.uninstall_flash_attn()
        drop_flash_attn_modules()


# ----------------------------------------------------------------------------------------------
# the functions compute on the chain's kernel


def test_fa2_functions_match_reference_and_the_kernel_itself(stand_in):
    import flash_attn

    from kernel_loader.attention.fallback import resolve_flash_chain

    q, k, v = qkv(sq=5, sk=9)
    out = flash_attn.flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), reference(q, k, v, True), atol=1e-5, rtol=1e-5)
    chosen = resolve_flash_chain("flash_attention_2")
    assert chosen.steps[0].ok is False and "stand-in" in chosen.steps[0].reason
    assert torch.equal(out, chosen.kernel.flash_attn_func(q, k, v, causal=True))
    out, lse, _ = flash_attn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert lse.shape == (2, 4, 5)

    packed = torch.cat([q[0], q[1, :3]]), torch.cat([k[0], k[1, :6]]), torch.cat([v[0], v[1, :6]])
    cu_q = torch.tensor([0, 5, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 15], dtype=torch.int32)
    varlen = flash_attn.flash_attn_varlen_func(*packed, cu_q, cu_k, 5, 9, causal=True)
    torch.testing.assert_close(varlen[:5].double(), reference(q[:1], k[:1], v[:1], True)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(varlen[5:].double(), reference(q[1:, :3], k[1:, :6], v[1:, :6], True)[0],
                               atol=1e-5, rtol=1e-5)

    qkv_packed = torch.stack([q, q, q], dim=2)
    torch.testing.assert_close(flash_attn.flash_attn_qkvpacked_func(qkv_packed).double(), reference(q, q, q, False),
                               atol=1e-5, rtol=1e-5)


def test_compiled_code_calling_the_stand_in_gets_the_eager_numbers(stand_in):
    # the stand-in picks its kernel when called (locks, the chain's walk), which torch.compile
    # cannot trace: the graph is cut there, and the kernel's own call is compiled after the cut
    import flash_attn

    q, k, v = (t.requires_grad_() for t in qkv(sq=5, sk=9))
    step = lambda q, k, v: flash_attn.flash_attn_func(q, k, v, causal=True)  # noqa: E731
    torch._dynamo.reset()
    try:
        got = torch.compile(step, backend="aot_eager")(q, k, v)
    finally:
        torch._dynamo.reset()
    want = step(q, k, v)
    assert torch.equal(got, want)
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(want.sum(), (q, k, v))))


def test_the_chain_never_takes_the_stand_in_for_the_package(stand_in, monkeypatch):
    """On a GPU the package step would import ``flash_attn`` and find the stand-in: it must skip it
    (the stand-in runs on the chain's choice), and a chain that returned it anyway is refused."""
    import flash_attn

    from kernel_loader.attention import fallback

    monkeypatch.setattr(fallback, "_cuda_capability", lambda: ((9, 0), "GPU H200 (sm90)"))
    outcome = fallback.resolve_flash_chain("flash_attention_2", refresh=True)
    assert outcome.steps[0].ok is False and "stand-in" in outcome.steps[0].reason
    assert not flash_attn_compat.is_stand_in(outcome.kernel)

    monkeypatch.setattr(fallback, "flash_chain_kernel", lambda name: flash_attn)
    q, k, v = qkv()
    with pytest.raises(UnusableKernelError, match="stand-in"):
        flash_attn.flash_attn_func(q, k, v)


def test_fa2_kvcache_paged_appends_and_attends(stand_in):
    import flash_attn

    q, k, v = qkv(b=2, sq=1, sk=7, seed=3)
    page = 4
    k_cache = torch.zeros(4, page, 2, 16)
    v_cache = torch.zeros(4, page, 2, 16)
    block_table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    for row in range(2):  # the first 6 keys are already cached; the 7th comes with the call
        for pos in range(6):
            k_cache[block_table[row, pos // page], pos % page] = k[row, pos]
            v_cache[block_table[row, pos // page], pos % page] = v[row, pos]
    out = flash_attn.flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k[:, 6:], v=v[:, 6:], cache_seqlens=torch.tensor([6, 6], dtype=torch.int32),
        block_table=block_table, causal=True,
    )
    torch.testing.assert_close(out.double(), reference(q, k, v, True), atol=1e-5, rtol=1e-5)
    assert torch.equal(k_cache[block_table[1, 1], 2], k[1, 6])  # appended in place


def test_fa3_api_runs_on_an_fa2_kernel_and_refuses_what_it_cannot_honour(stand_in):
    import flash_attn_interface

    q, k, v = qkv(sq=4, sk=6, seed=5)
    out = flash_attn_interface.flash_attn_func(q, k, v, causal=True, num_splits=3, pack_gqa=True)
    torch.testing.assert_close(out.double(), reference(q, k, v, True), atol=1e-5, rtol=1e-5)
    result = flash_attn_interface.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert isinstance(result, tuple) and len(result) == 2  # FA3 answers (out, softmax_lse)

    cu_q = torch.tensor([0, 4, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 12], dtype=torch.int32)
    varlen = flash_attn_interface.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q,
                                                         cu_k, 4, 6, causal=True)
    torch.testing.assert_close(varlen.view_as(q).double(), reference(q, k, v, True), atol=1e-5, rtol=1e-5)

    page_cache_k = k.reshape(4, 3, 2, 16)  # two pages of 3 keys per row
    page_cache_v = v.reshape(4, 3, 2, 16)
    page_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    decode = flash_attn_interface.flash_attn_with_kvcache(
        q[:, -1:], page_cache_k, page_cache_v, cache_seqlens=torch.tensor([6, 6], dtype=torch.int32),
        page_table=page_table, causal=True,
    )
    torch.testing.assert_close(decode.double(), reference(q[:, -1:], k, v, True), atol=1e-5, rtol=1e-5)

    with pytest.raises(UnsupportedAttentionOptionError, match="qv"):
        flash_attn_interface.flash_attn_func(q, k, v, qv=q)
    with pytest.raises(UnsupportedAttentionOptionError, match="attention_chunk"):
        flash_attn_interface.flash_attn_func(q, k, v, attention_chunk=2)


# ----------------------------------------------------------------------------------------------
# bert_padding


def test_unpad_and_pad_follow_flash_attn(stand_in):
    from flash_attn.bert_padding import index_first_axis, pad_input, unpad_input

    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3).requires_grad_()
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(hidden, mask)
    assert indices.tolist() == [1, 2, 3, 4, 5]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 3, 5]
    assert max_seqlen == 3 and isinstance(max_seqlen, int)
    assert seqused.dtype == torch.int32 and seqused.tolist() == [3, 2]
    assert torch.equal(packed, hidden.reshape(8, 3)[[1, 2, 3, 4, 5]])

    restored = pad_input(packed, indices, 2, 4)
    assert torch.equal(restored, hidden * mask[..., None])
    restored.sum().backward()  # differentiable, like flash-attn's autograd functions
    assert torch.equal(hidden.grad, mask[..., None].float().expand(2, 4, 3))

    unused = torch.tensor([[0, 0, 0, 0], [0, 0, 1, 0]])
    packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(hidden, mask, unused)
    assert cu_seqlens.tolist() == [0, 3, 6] and seqused.tolist() == [3, 2] and indices.tolist()[-1] == 6
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        index_first_axis(torch.arange(3), torch.tensor([0]))


def test_bert_padding_agrees_with_transformers_copies(stand_in):
    """transformers keeps private copies of flash-attn's padding functions for FA3; both must agree."""
    from flash_attn.bert_padding import pad_input, unpad_input
    from transformers.modeling_flash_attention_utils import _pad_input, _unpad_input

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 2, 4, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.4
    mask[:, 0] = True
    ours, theirs = unpad_input(hidden, mask), _unpad_input(hidden, mask)
    for a, b in zip(ours, theirs):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    assert torch.equal(pad_input(ours[0], ours[1], 3, 5), _pad_input(theirs[0], theirs[1], 3, 5))


def test_unpad_concatenated_sequences_gives_one_entry_per_sequence(stand_in):
    from flash_attn.bert_padding import unpad_input_for_concatenated_sequences

    hidden = torch.arange(2 * 6, dtype=torch.float32).reshape(2, 6, 1)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    packed, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(hidden, lengths)
    assert cu_seqlens.tolist() == [0, 2, 5, 11] and max_seqlen == 6
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11]
    assert packed.flatten().tolist() == [float(i) for i in indices.tolist()]


# ----------------------------------------------------------------------------------------------
# explain and the bridge option


def test_explain_names_the_stand_in(offline_shipped, capsys):
    from kernel_loader.cli import main

    assert main(["explain", "flash_attention_2"]) == 0
    assert "kernel_loader.install_flash_attn()" in capsys.readouterr().out
    kernel_loader.install_flash_attn()
    try:
        assert main(["explain", "flash_attention_3"]) == 0
        text = capsys.readouterr().out
        assert "flash_attn_interface stand-in: installed in this process" in text
        assert "only kernel_loader's stand-in" in text  # the chain's package step skips it
    finally:
        kernel_loader.uninstall_flash_attn()


def test_bridge_option_installs_the_stand_in(offline_shipped):
    pytest.importorskip("transformers")
    import kernel_loader.integrations.transformers as klt

    klt.enable(install_flash_attn=True)
    try:
        assert flash_attn_compat.is_flash_attn_installed()
        import flash_attn

        assert flash_attn_compat.is_stand_in(flash_attn)
    finally:
        klt.disable()
        kernel_loader.uninstall_flash_attn()
        drop_flash_attn_modules()


# ----------------------------------------------------------------------------------------------
# the documented snippets


def test_docs_snippet_plain_import(offline_shipped, capsys):
    code = doc_block("tests/integrations/test_flash_attn_compat.py::test_docs_snippet_plain_import")
    try:
        exec(compile(code, str(DOC), "exec"), {"__name__": "__docs__"})
    finally:
        kernel_loader.uninstall_flash_attn()
        drop_flash_attn_modules()
    assert capsys.readouterr().out.strip() == "torch.Size([2, 6, 4, 64])"


def test_docs_explain_command(tmp_path):
    block = doc_block("tests/integrations/test_flash_attn_compat.py::test_docs_explain_command")
    commands = [line[2:] for line in block.splitlines() if line.startswith("$ ")]
    assert commands == ["kernel-loader explain flash_attention_2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KERNEL_LOADER_CACHE": str(tmp_path / "cache"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run(commands[0], shell=True, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[USED] the shipped kernel" in out.stdout
    assert "flash_attn stand-in: not installed; kernel_loader.install_flash_attn()" in out.stdout
