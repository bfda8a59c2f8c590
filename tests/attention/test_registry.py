"""Registry semantics: global vs local, unknown names, kernel ids, overriding a built-in formatter."""

from __future__ import annotations

import pytest
import torch

from kernel_loader.attention import (
    ALL_ATTENTION_FUNCTIONS,
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionInterface,
    AttentionMaskInterface,
    create_causal_mask,
    eager_mask,
    sdpa_attention_forward,
    sdpa_mask,
)
from kernel_loader.errors import UnknownAttentionBackendError


def _dummy(module, query, key, value, attention_mask, **kwargs):
    return query.transpose(1, 2).contiguous(), None


@pytest.fixture
def cleanup():
    names = []
    yield names
    for name in names:
        AttentionInterface.unregister(name)
        AttentionMaskInterface.unregister(name)


def test_builtins_are_registered():
    keys = set(ALL_ATTENTION_FUNCTIONS.valid_keys())
    assert {"eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3"} <= keys
    assert {"paged|eager", "paged|sdpa", "paged|flash_attention_2"} <= keys
    assert set(ALL_MASK_ATTENTION_FUNCTIONS.valid_keys()) >= {"eager", "sdpa", "flex_attention", "flash_attention_2"}
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


def test_global_register_is_seen_by_every_instance(cleanup):
    cleanup.append("my_attn")
    other = AttentionInterface()
    AttentionInterface.register("my_attn", _dummy)
    assert ALL_ATTENTION_FUNCTIONS["my_attn"] is _dummy
    assert other.get_interface("my_attn") is _dummy
    assert "my_attn" in other.valid_keys()


def test_local_assignment_stays_local():
    local = AttentionInterface()
    local["sdpa"] = _dummy
    assert local["sdpa"] is _dummy
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    assert AttentionInterface()["sdpa"] is sdpa_attention_forward
    del local["sdpa"]
    assert local["sdpa"] is sdpa_attention_forward
    with pytest.raises(KeyError):
        del local["sdpa"]  # only local entries can be deleted


def test_registries_are_separate(cleanup):
    cleanup.append("only_attention")
    AttentionInterface.register("only_attention", _dummy)
    assert "only_attention" not in ALL_MASK_ATTENTION_FUNCTIONS


def test_unknown_name_raises_keyerror_listing_names():
    with pytest.raises(KeyError) as info:
        ALL_ATTENTION_FUNCTIONS.get_interface("no_such_backend")
    assert isinstance(info.value, UnknownAttentionBackendError)
    text = str(info.value)
    assert "'no_such_backend'" in text and "sdpa" in text and "register" in text
    with pytest.raises(KeyError):
        ALL_ATTENTION_FUNCTIONS["no_such_backend"]
    assert "no_such_backend" not in ALL_ATTENTION_FUNCTIONS


def test_get_interface_none_returns_default():
    assert ALL_ATTENTION_FUNCTIONS.get_interface(None, _dummy) is _dummy
    with pytest.raises(KeyError):
        ALL_ATTENTION_FUNCTIONS.get_interface(None)


def test_register_validates_arguments():
    with pytest.raises(TypeError):
        AttentionInterface.register("x", "not callable")
    with pytest.raises(TypeError):
        AttentionInterface.register("", _dummy)


def test_membership_and_len_cover_local_and_global():
    local = AttentionInterface()
    n = len(local)
    local["just_here"] = _dummy
    assert len(local) == n + 1 and "just_here" in local
    assert list(local)[-1] == "just_here"


def test_overriding_builtin_formatter_changes_masks(attn):
    x = torch.zeros(1, 4, 8)
    pad = torch.tensor([[0, 1, 1, 1]])
    before = create_causal_mask(attn.config("sdpa"), x, pad)
    assert before.dtype == torch.bool
    try:
        AttentionMaskInterface.register("sdpa", eager_mask)  # global override
        after = create_causal_mask(attn.config("sdpa"), x, pad)
        assert after.dtype == torch.float32
        assert torch.equal(after == 0, before)
    finally:
        AttentionMaskInterface.register("sdpa", sdpa_mask)
    assert create_causal_mask(attn.config("sdpa"), x, pad).dtype == torch.bool


def test_local_formatter_override_does_not_leak():
    local = AttentionMaskInterface()
    local["sdpa"] = eager_mask
    assert local["sdpa"] is eager_mask
    assert ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is sdpa_mask


@pytest.mark.filterwarnings("ignore:Using the copy")
def test_kernel_id_lookup_registers_function_and_formatter(offline_hub):
    from kernel_loader.attention.backends.flash_api import flash_kernel
    from kernel_loader.attention.mask_formatters import flash_attention_mask

    name = "kernels-community/flash-attn2"
    AttentionInterface.unregister(name)
    AttentionMaskInterface.unregister(name)
    from kernel_loader.attention import kernel_backends

    kernel_backends._registered.pop(name, None)
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(name)
    assert name in AttentionInterface._global_mapping
    assert ALL_MASK_ATTENTION_FUNCTIONS[name] is flash_attention_mask
    assert flash_kernel(fn.flash_kernel).varlen is not None
    # a second lookup is a plain dict hit
    assert ALL_ATTENTION_FUNCTIONS[name] is fn


@pytest.mark.filterwarnings("ignore:Using the copy")
def test_mask_lookup_of_kernel_id_loads_it(offline_hub, attn):
    from kernel_loader.attention import kernel_backends

    name = "kernels-community/flash-attn2@v1"
    for reg in (AttentionInterface, AttentionMaskInterface):
        reg.unregister(name)
    kernel_backends._registered.pop(name, None)
    x = torch.zeros(2, 4, 8)
    pad = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    mask = create_causal_mask(attn.config(name), x, pad)
    assert mask.shape == (2, 4) and mask.dtype == torch.bool
    assert name in ALL_ATTENTION_FUNCTIONS


def test_unregistered_names_go_to_the_installed_resolvers_first(cleanup, monkeypatch):
    from kernel_loader.attention import registry

    asked = []

    def resolver(name):
        asked.append(name)
        if name != "made_on_demand":
            return False
        AttentionInterface.register(name, _dummy)
        AttentionMaskInterface.register(name, sdpa_mask)
        return True

    monkeypatch.setattr(registry, "_resolvers", [*registry._resolvers, resolver])
    cleanup.append("made_on_demand")
    assert "made_on_demand" not in ALL_ATTENTION_FUNCTIONS  # membership never resolves
    assert ALL_ATTENTION_FUNCTIONS.get_interface("made_on_demand") is _dummy
    assert ALL_MASK_ATTENTION_FUNCTIONS["made_on_demand"] is sdpa_mask  # now a plain dict hit
    assert asked == ["made_on_demand"]
    with pytest.raises(UnknownAttentionBackendError, match="not_a_backend"):
        ALL_ATTENTION_FUNCTIONS.get_interface("not_a_backend")
    assert asked[-1] == "not_a_backend"
