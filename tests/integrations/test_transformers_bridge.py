"""The transformers bridge itself: switching, kernel id forms, the FlashAttention fallback, the
``kernels`` package present or absent, the version check, and the kernel from the loopback Hub.

Model-level parity (several architectures, generate, training) is in test_transformers_models.py.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kernel_loader.integrations.transformers as klt  # noqa: E402
from kernel_loader.errors import UnsupportedTransformersVersionError, UntrustedKernelError  # noqa: E402

KERNEL = "kernels-community/flash-attn2"
ATOL, RTOL = 1e-6, 1e-4  # transformers' fp32 eager<>sdpa tolerance
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bridge(offline_shipped):
    klt.enable()
    try:
        yield klt
    finally:
        klt.disable()


def tiny_llama(impl: str, cls=None):
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    )
    torch.manual_seed(0)
    return (cls or transformers.LlamaForCausalLM)._from_config(config, attn_implementation=impl).eval()


def hidden(model, ids, mask):
    with torch.no_grad():
        return model.model(ids, attention_mask=mask).last_hidden_state


def inputs():
    torch.manual_seed(1)
    ids = torch.randint(3, 96, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


def assert_matches_sdpa(model):
    ref = tiny_llama("sdpa")
    ref.load_state_dict(model.state_dict())
    ids, mask = inputs()
    torch.testing.assert_close(hidden(model, ids, mask)[mask.bool()], hidden(ref, ids, mask)[mask.bool()], atol=ATOL, rtol=RTOL)


def registries():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS._global_mapping, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


# ---------------------------------------------------------------------------------------------
# enable / disable


def test_disable_restores_methods_and_registries_exactly(offline_shipped):
    from transformers.modeling_utils import PreTrainedModel

    methods = ("_check_and_adjust_attn_implementation", "set_attn_implementation")
    before_methods = {m: PreTrainedModel.__dict__[m] for m in methods}
    before_attn, before_mask = (dict(m) for m in registries())

    assert not klt.is_enabled()
    klt.enable()
    klt.enable()  # idempotent: one set of hooks
    assert klt.is_enabled()
    for m in methods:
        assert PreTrainedModel.__dict__[m] is not before_methods[m]
    model = tiny_llama(KERNEL)
    tiny_llama("flash_attention_2")
    attn, mask = registries()
    assert KERNEL in attn and KERNEL in mask
    assert klt.registered_names()["flash_attention_2"] == KERNEL

    klt.disable()
    klt.disable()  # idempotent
    assert not klt.is_enabled()
    assert klt.registered_names() == {}
    for m in methods:
        assert PreTrainedModel.__dict__[m] is before_methods[m]
    after_attn, after_mask = registries()
    assert after_attn == before_attn and after_mask == before_mask
    assert all(after_attn[k] is before_attn[k] for k in before_attn)

    # transformers decides again: a kernel id now needs the `kernels` package (absent or too old here)
    with pytest.raises((ImportError, ValueError), match="kernels"):
        tiny_llama(KERNEL)
    # a model switched while enabled must be switched back before use (documented)
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"


def test_disable_puts_back_a_registration_the_bridge_replaced(offline_shipped):
    attn, mask = registries()

    def user_fn(*args, **kwargs):  # pragma: no cover - never called
        raise AssertionError

    attn[KERNEL] = user_fn
    try:
        klt.enable()
        tiny_llama(KERNEL)
        assert attn[KERNEL] is not user_fn
        klt.disable()
        assert attn[KERNEL] is user_fn
        assert KERNEL not in mask
    finally:
        klt.disable()
        attn.pop(KERNEL, None)


# ---------------------------------------------------------------------------------------------
# kernel id forms, FlashAttention fallback, run-time switching


def test_kernel_id_forms_register_kernel_loader_functions(bridge):
    from kernel_loader.attention import ALL_ATTENTION_FUNCTIONS as KL_FUNCTIONS
    from kernel_loader.attention.kernel_backends import registered_kernel_backends

    attn, mask = registries()
    for name in (f"{KERNEL}@main", f"{KERNEL}:flash_attn_varlen_func", f"{KERNEL}@main:flash_attn_varlen_func"):
        model = tiny_llama(name)
        assert model.config._attn_implementation == name
        assert attn[name] is KL_FUNCTIONS[name]
        assert_matches_sdpa(model)
    # the paged variant is registered under the exact string (it serves kernel_loader's paged cache)
    paged = f"paged|{KERNEL}"
    model = tiny_llama(paged)
    assert model.config._attn_implementation == paged
    assert attn[paged] is registered_kernel_backends()[paged].attention
    assert registered_kernel_backends()[paged].description.startswith("paged")


def test_malformed_and_unusable_kernel_ids_raise_kernel_loader_errors(bridge):
    from kernel_loader.errors import InvalidKernelRefError, UnusableKernelError

    with pytest.raises(InvalidKernelRefError, match="Accepted forms"):
        tiny_llama("kernels-community/flash-attn2@")
    with pytest.raises(UnusableKernelError, match="no_such_function"):
        tiny_llama(f"{KERNEL}:no_such_function")
    # plain names are still transformers' business
    assert tiny_llama("eager").config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="not supported"):
        tiny_llama("no_such_backend")


@pytest.mark.parametrize("name", ["flash_attention_2", "flash_attention_3"])
def test_flash_attention_fallback_uses_the_chain(bridge, name):
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    assert not is_flash_attn_2_available() and not is_flash_attn_3_available()  # the case under test
    model = tiny_llama(name)
    # as transformers does with `kernels`: the config names the kernel that serves the request
    assert model.config._attn_implementation == KERNEL
    assert klt.registered_names()[name] == KERNEL
    assert_matches_sdpa(model)


def test_set_attn_implementation_at_run_time(bridge):
    model = tiny_llama("sdpa")
    model.set_attn_implementation(KERNEL)
    assert model.config._attn_implementation == KERNEL
    assert_matches_sdpa(model)
    model.set_attn_implementation("flash_attention_2")
    assert model.config._attn_implementation == KERNEL
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    assert_matches_sdpa(model)


def test_model_listing_its_flash_kernels_gets_the_first(bridge, caplog):
    class PickyLlama(transformers.LlamaForCausalLM):
        _compatible_flash_implementations = [f"{KERNEL}@main"]

    with caplog.at_level(logging.WARNING, logger=klt.__name__):
        model = tiny_llama("flash_attention_2", cls=PickyLlama)
    assert model.config._attn_implementation == f"{KERNEL}@main"
    assert any("works with" in r.getMessage() for r in caplog.records)


def test_model_without_flash_support_is_refused(bridge):
    class NoFlashLlama(transformers.LlamaForCausalLM):
        _supports_flash_attn = False
        _supports_flash_attn_2 = False

    with pytest.raises(ValueError, match="does not support FlashAttention"):
        tiny_llama(KERNEL, cls=NoFlashLlama)
    # "flash_attention_2" stays transformers' call, with its own message
    with pytest.raises(ValueError, match="(?i)flash attention"):
        tiny_llama("flash_attention_2", cls=NoFlashLlama)


def test_transformers_mask_patterns_reach_the_flash_formatter_labelled(bridge):
    """transformers' own mask functions are recognised: expressible patterns give the 2D padding
    mask (or None), and patterns FlashAttention cannot apply raise instead of being dropped."""
    import transformers.masking_utils as mu

    from kernel_loader.errors import UnsupportedAttentionOptionError

    tiny_llama(KERNEL)
    fmt = registries()[1][KERNEL]
    padding = torch.ones(2, 10, dtype=torch.bool)
    padding[1, :3] = False

    def call(mask_function, attention_mask):
        if "cache_position" in inspect.signature(mu.sdpa_mask).parameters:  # 4.57
            sizes = dict(cache_position=torch.arange(10), kv_length=10, kv_offset=0)
        else:
            sizes = dict(q_length=10, kv_length=10, q_offset=0, kv_offset=0)
        return fmt(batch_size=2, mask_function=mask_function, attention_mask=attention_mask, **sizes)

    assert call(mu.causal_mask_function, torch.ones(2, 10, dtype=torch.bool)) is None
    assert torch.equal(call(mu.causal_mask_function, padding), padding)
    assert torch.equal(call(mu.sliding_window_causal_mask_function(4), padding), padding)
    packed = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(torch.zeros(2, 10, dtype=torch.long)))
    assert call(packed, None) is None

    def image_tokens(batch_idx, head_idx, q_idx, kv_idx):  # a Gemma3-style bidirectional block
        return (q_idx < 4) & (kv_idx < 4)

    with pytest.raises(UnsupportedAttentionOptionError, match="FlashAttention cannot apply"):
        call(mu.or_masks(mu.causal_mask_function, image_tokens), padding)
    with pytest.raises(UnsupportedAttentionOptionError):
        call(image_tokens, padding)


# ---------------------------------------------------------------------------------------------
# the `kernels` package


def test_kernels_package_present_is_announced_once_and_bypassed(offline_shipped, monkeypatch, caplog):
    import importlib.util

    from kernel_loader.attention import ALL_ATTENTION_FUNCTIONS as KL_FUNCTIONS

    kernels_installed = importlib.util.find_spec("kernels") is not None
    monkeypatch.setattr(klt, "_announced_kernels", False)
    with caplog.at_level(logging.WARNING, logger=klt.__name__):
        klt.enable()
        klt.disable()
        klt.enable()
    try:
        notes = [r for r in caplog.records if "`kernels` package is installed" in r.getMessage()]
        assert len(notes) == (1 if kernels_installed else 0)

        # Even when transformers would hand the request to `kernels`, the bridge answers first.
        import transformers.modeling_utils as mu

        def kernels_used(*args, **kwargs):
            raise AssertionError("transformers' kernels path was taken")

        monkeypatch.setattr(mu, "is_kernels_available", lambda *a, **k: True)
        for hook in ("lazy_import_flash_attention", "load_and_register_kernel"):  # 5.x, 4.57
            monkeypatch.setattr(mu, hook, kernels_used, raising=False)
        model = tiny_llama("flash_attention_2")
        assert model.config._attn_implementation == KERNEL
        assert registries()[0][KERNEL] is not None
        model = tiny_llama(KERNEL)
        assert registries()[0][KERNEL] is KL_FUNCTIONS[KERNEL]
    finally:
        klt.disable()


_ABSENT_SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, os, sys
    sys.modules["kernels"] = None  # as if `kernels` were not installed: imports and find_spec fail

    import torch, transformers
    import kernel_loader.integrations.transformers as klt  # KERNEL_LOADER_TRANSFORMERS=1 enables it
    from transformers.utils import is_kernels_available

    def tiny(impl):
        cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=impl).eval()

    ids = torch.randint(3, 96, (2, 12)); mask = torch.ones_like(ids); mask[1, :4] = 0
    out = {"kernels_spec": importlib.util.find_spec("kernels") is not None,
           "transformers_sees_kernels": bool(is_kernels_available()), "enabled": klt.is_enabled()}
    ref = tiny("sdpa")
    with torch.no_grad():
        expected = ref.model(ids, attention_mask=mask).last_hidden_state[mask.bool()]
    for name in ("kernels-community/flash-attn2", "flash_attention_2"):
        model = tiny(name)
        with torch.no_grad():
            got = model.model(ids, attention_mask=mask).last_hidden_state[mask.bool()]
        out[name] = {"config": model.config._attn_implementation, "max_diff": (got - expected).abs().max().item(),
                     "close": torch.allclose(got, expected, atol=1e-6, rtol=1e-4)}
    from kernel_loader.attention.kernel_backends import registered_kernel_backends
    out["source"] = registered_kernel_backends()["kernels-community/flash-attn2"].kernel.__kernel_resolution__.source
    print("RESULT " + json.dumps(out))
    """
)


def test_kernels_package_absent_and_the_environment_switch(tmp_path):
    env = dict(os.environ)
    env.update(
        KERNEL_LOADER_TRANSFORMERS="1",
        HF_HUB_OFFLINE="1",
        KERNEL_LOADER_CACHE=str(tmp_path / "cache"),
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]),
    )
    env.pop("KERNEL_LOADER_NO_BUNDLED", None)
    proc = subprocess.run(
        [sys.executable, "-c", _ABSENT_SCRIPT], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["kernels_spec"] is False and out["transformers_sees_kernels"] is False
    assert out["enabled"] is True
    assert out["source"] == "bundled"
    for name in ("kernels-community/flash-attn2", "flash_attention_2"):
        assert out[name]["config"] == KERNEL
        assert out[name]["close"], out[name]
    assert "`kernels` package is installed" not in proc.stderr


# ---------------------------------------------------------------------------------------------
# version check


@pytest.mark.parametrize("version", ["5.30.0", "5.16.2", "4.56.2", "6.0.0", "5.26.0.dev0"])
def test_unsupported_transformers_version_is_refused(monkeypatch, version):
    monkeypatch.setattr(klt, "_installed_transformers_version", lambda: version)
    with pytest.raises(UnsupportedTransformersVersionError) as info:
        klt.enable()
    message = str(info.value)
    assert version in message and klt.SUPPORTED_RANGE in message and "pip install" in message
    assert not klt.is_enabled()


def test_missing_transformers_and_the_override(monkeypatch, caplog):
    monkeypatch.setattr(klt, "_installed_transformers_version", lambda: None)
    with pytest.raises(UnsupportedTransformersVersionError, match="not installed"):
        klt.enable()
    monkeypatch.setattr(klt, "_installed_transformers_version", lambda: "5.30.0")
    with caplog.at_level(logging.WARNING, logger=klt.__name__):
        klt.enable(allow_unsupported=True)
    try:
        assert klt.is_enabled()
        assert any("outside" in r.getMessage() for r in caplog.records)
    finally:
        klt.disable()


@pytest.mark.parametrize("version", ["4.57.0", "4.57.6", "5.17.0", "5.24.0", "5.25.0", transformers.__version__])
def test_supported_versions_are_accepted(monkeypatch, version):
    monkeypatch.setattr(klt, "_installed_transformers_version", lambda: version)
    klt.enable()
    try:
        assert klt.is_enabled()
    finally:
        klt.disable()


def test_the_install_extras_stop_at_the_supported_range():
    # pip must not hand a user (or CI) a transformers release that enable() refuses
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    newest = klt._SUPPORTED_5X[1]
    for extra in ("transformers", "test"):
        spec = next(Requirement(r).specifier for r in project["optional-dependencies"][extra]
                    if Requirement(r).name == "transformers")
        assert spec.contains("4.57.0") and spec.contains("5.17.0") and spec.contains(f"5.{newest}.0")
        assert not spec.contains(f"5.{newest + 1}.0"), f"the {extra} extra admits transformers 5.{newest + 1}"


# ---------------------------------------------------------------------------------------------
# the kernel from the loopback Hub


def test_kernel_from_the_loopback_hub(hub_env, hub_server, monkeypatch, fresh_kernel_backends):
    import huggingface_hub.file_download as file_download

    from kernel_loader.attention.kernel_backends import registered_kernel_backends

    if hasattr(file_download, "HUGGINGFACE_CO_URL_TEMPLATE"):
        # huggingface_hub < 1 (needed by transformers 4.57) copied the URL template at import, and
        # hub_env's patched ENDPOINT stops it from rewriting the template's host: point it here too.
        monkeypatch.setattr(
            file_download, "HUGGINGFACE_CO_URL_TEMPLATE", hub_server.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        )

    sha = hub_server.add_shipped_repo(KERNEL)
    name = f"{KERNEL}@v1"
    klt.enable()
    try:
        model = tiny_llama(name)
        assert model.config._attn_implementation == name
        resolution = registered_kernel_backends()[name].kernel.__kernel_resolution__
        assert resolution.source == "hub"
        assert resolution.sha == sha
        assert_matches_sdpa(model)

        # a kernel outside the trusted orgs needs consent: transformers 5.x's allow_all_kernels=True
        untrusted = "test-org/flash-attn2-copy"
        hub_server.add_shipped_repo(KERNEL, serve_as=untrusted)
        with pytest.raises(UntrustedKernelError, match="test-org"):
            tiny_llama(untrusted)
        if "allow_all_kernels" in inspect.signature(transformers.PreTrainedModel.set_attn_implementation).parameters:
            model = tiny_llama("sdpa")
            model.set_attn_implementation(untrusted, allow_all_kernels=True)
            assert model.config._attn_implementation == untrusted
            assert registered_kernel_backends()[untrusted].kernel.__kernel_resolution__.source == "hub"
            assert_matches_sdpa(model)
    finally:
        klt.disable()
