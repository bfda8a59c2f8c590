"""Kernel ids as backends: which function and mask formatter a kernel gets, and what is refused.

Custom kernels are real kernel repos written to tmp_path and served through ``LOCAL_KERNELS``
(the loader's local override), so they are imported exactly like Hub kernels.
"""

from __future__ import annotations

import json
import textwrap
import warnings

import pytest
import torch

from kernel_loader.attention import (
    ALL_ATTENTION_FUNCTIONS,
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionInterface,
    AttentionMaskInterface,
    PagedKVCache,
    create_causal_mask,
    eager_mask,
    kernel_backends,
    paged_attention_mask,
    register_kernel_backend,
    sdpa_mask,
)
from kernel_loader.errors import InvalidKernelRefError, UnusableKernelError

from .conftest import make_case, module, reference_attention

CUSTOM = '''
import torch

def my_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Plain attention with an additive 4D mask (follows the attention-function contract)."""
    scores = query @ key.transpose(-1, -2) * (scaling or query.shape[-1] ** -0.5)
    if attention_mask is not None:
        scores = scores + attention_mask
    out = scores.softmax(-1) @ value
    return out.transpose(1, 2).contiguous(), None

my_attention.mask_format = "eager"

def helper():
    return 1
'''


def _write_kernel(root, pkg, source):
    variant = root / "build" / "torch-universal"
    (variant / pkg).mkdir(parents=True)
    (variant / pkg / "__init__.py").write_text(textwrap.dedent(source))
    (variant / "metadata.json").write_text(json.dumps({"name": pkg, "version": 1, "python-depends": []}))
    return root


@pytest.fixture
def local_kernels(tmp_path, monkeypatch, offline_hub):
    custom = _write_kernel(tmp_path / "custom", "custom_attn", CUSTOM)
    empty = _write_kernel(tmp_path / "empty", "empty_kernel", "VALUE = 3\n")
    monkeypatch.setenv("LOCAL_KERNELS", f"test-org/custom-attn={custom},test-org/empty={empty}")
    added = []
    yield added
    for name in added:
        AttentionInterface.unregister(name)
        AttentionMaskInterface.unregister(name)
        kernel_backends._registered.pop(name, None)


def test_named_function_registers_with_its_mask_format(local_kernels):
    name = "test-org/custom-attn:my_attention"
    local_kernels.append(name)
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(name)
    assert fn.__name__ == "my_attention"
    assert ALL_MASK_ATTENTION_FUNCTIONS[name] is eager_mask
    # and it runs end to end with the mask its formatter builds
    case = make_case(b=2, hq=2, hkv=2, sq=5, padding=[(2, 0), (0, 0)])
    mask = create_causal_mask(type("C", (), {"_attn_implementation": name})(), torch.zeros(2, 5, 8), case.padding)
    out, _ = fn(module(), case.q, case.k, case.v, mask)
    ref = reference_attention(case.q, case.k, case.v, padding=case.padding)
    torch.testing.assert_close(out.double()[case.padding], ref[case.padding], atol=1e-5, rtol=1e-5)


def test_a_parsed_ref_is_registered_under_its_text_without_parsing_again(local_kernels, monkeypatch):
    from kernel_loader.refs import KernelRef

    ref = KernelRef.parse("test-org/custom-attn:my_attention")
    local_kernels.append(str(ref))
    parsed = []
    real_parse = KernelRef.parse.__func__

    def recording_parse(cls, text):
        parsed.append(text)
        return real_parse(cls, text)

    monkeypatch.setattr(KernelRef, "parse", classmethod(recording_parse))
    backend = kernel_backends.register_kernel_backend(ref)
    # the loader validates the repo id it is handed; the whole id is never parsed again
    assert str(ref) not in parsed and set(parsed) <= {"test-org/custom-attn"}
    assert backend.name == "test-org/custom-attn:my_attention"
    assert AttentionInterface._global_mapping[backend.name] is backend.attention


def test_missing_function_lists_exports(local_kernels):
    name = "test-org/custom-attn:nope"
    local_kernels.append(name)
    with pytest.raises(UnusableKernelError) as info:
        ALL_ATTENTION_FUNCTIONS.get_interface(name)
    assert "'nope'" in str(info.value) and "my_attention" in str(info.value) and "helper" in str(info.value)
    assert name not in ALL_ATTENTION_FUNCTIONS


def test_kernel_without_attention_api_names_what_was_looked_for(local_kernels):
    name = "test-org/empty"
    local_kernels.append(name)
    with pytest.raises(UnusableKernelError, match="flash_attn_varlen_func") as info:
        ALL_ATTENTION_FUNCTIONS.get_interface(name)
    assert "test-org/empty:<function>" in str(info.value)


def test_unknown_wrapper_prefix(local_kernels):
    with pytest.raises(InvalidKernelRefError, match="paged"):
        register_kernel_backend("cached|test-org/custom-attn")


@pytest.mark.filterwarnings("ignore:Using the copy")
def test_paged_kernel_id_registers_paged_function(offline_hub):
    name = "paged|kernels-community/flash-attn2"
    try:
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(name)
        assert ALL_MASK_ATTENTION_FUNCTIONS[name] is paged_attention_mask
        case = make_case(b=1, hq=2, hkv=2, sq=4)
        cache = PagedKVCache(num_layers=1, batch_size=1, num_kv_heads=2, head_dim=16, num_blocks=4, block_size=4)
        cache.begin_step(4)
        out, _ = fn(module(), case.q, case.k, case.v, None, paged_cache=cache, layer_idx=0)
        torch.testing.assert_close(out.double(), reference_attention(case.q, case.k, case.v), atol=2e-5, rtol=2e-5)
    finally:
        AttentionInterface.unregister(name)
        AttentionMaskInterface.unregister(name)
        kernel_backends._registered.pop(name, None)


def test_sdpa_is_the_default_mask_format():
    import types

    kernel = types.ModuleType("k")
    kernel.fn = lambda *a, **k: None
    backend = kernel_backends.kernel_attention_function("org/k:fn", kernel, "fn", None)
    assert backend.mask_formatter is sdpa_mask
    kernel.ATTENTION_MASK_FORMAT = "bogus"
    with pytest.raises(UnusableKernelError, match="mask format"):
        kernel_backends.kernel_attention_function("org/k:fn", kernel, "fn", None)
