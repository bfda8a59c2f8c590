"""The flash_attention_2/3 fallback chain, with each outcome and the logged reasons asserted.

Hub cases use the loopback olah server (tests/hub_server.py); "unreachable" is that server
stopped (its port refuses connections).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from kernel_loader import loader
from kernel_loader.attention import (
    ALL_ATTENTION_FUNCTIONS,
    explain_chain,
    flash_chain_kernel,
    reset_fallback_cache,
    resolve_flash_chain,
)
from kernel_loader.errors import KernelNotFoundError

from .conftest import make_case, module, reference_attention

LOGGER = "kernel_loader.attention.fallback"


@pytest.fixture
def fresh():
    loader.clear_memo()
    reset_fallback_cache()
    yield
    loader.clear_memo()
    reset_fallback_cache()


@pytest.fixture
def fake_flash_attn(tmp_path, monkeypatch):
    """An installed ``flash_attn`` package (it only needs to be findable: there is no GPU here)."""
    pkg = tmp_path / "site" / "flash_attn"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("def flash_attn_varlen_func(*a, **k):\n    raise RuntimeError('no GPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return pkg


def _steps(outcome):
    return [(s.option, s.ok) for s in outcome.steps]


@pytest.mark.filterwarnings("ignore:Using the copy")
def test_offline_without_flash_attn_uses_shipped_kernel(offline_hub, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    with pytest.warns(UserWarning, match="flash_attention_2 uses the shipped kernel") as record:
        outcome = resolve_flash_chain("flash_attention_2")
    assert _steps(outcome) == [("the flash_attn package", False), ("Hub kernel kernels-community/flash-attn2", False),
                               ("the shipped kernel", True)]
    assert outcome.chosen == 2
    assert "not installed" in outcome.steps[0].reason and "pip install flash-attn" in outcome.steps[0].reason
    assert "HF_HUB_OFFLINE" in outcome.steps[1].reason
    assert "shipped copy of kernels-community/flash-attn2" in outcome.steps[2].reason
    assert len([r for r in record if "flash_attention_2 uses" in str(r.message)]) == 1
    message = next(str(r.message) for r in record if "flash_attention_2 uses" in str(r.message))
    assert ".." not in message and message.endswith("for the whole chain.")
    logged = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(logged) == 3 and "step 1" in logged[0] and "(used)" in logged[2]

    # walked once: a second lookup logs and warns nothing
    caplog.clear()
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert resolve_flash_chain("flash_attention_2") is outcome
        flash_chain_kernel("flash_attention_2")
    assert not [w for w in again if "flash_attention_2 uses" in str(w.message)]
    assert not [r for r in caplog.records if r.name == LOGGER]


@pytest.mark.filterwarnings("ignore:Using the copy", "ignore:flash_attention_2 uses")
def test_registered_flash_attention_2_runs_on_the_chosen_kernel(offline_hub):
    case = make_case(b=2, hq=4, hkv=2, sq=6, padding=[(2, 0), (0, 0)])
    out, _ = ALL_ATTENTION_FUNCTIONS["flash_attention_2"](module(), case.q, case.k, case.v, case.padding)
    ref = reference_attention(case.q, case.k, case.v, padding=case.padding)
    torch.testing.assert_close(out.double()[case.padding], ref[case.padding], atol=2e-5, rtol=2e-5)


@pytest.mark.filterwarnings("ignore:Using the copy", "ignore:flash_attention_2 uses")
def test_installed_flash_attn_without_gpu_is_skipped(offline_hub, fake_flash_attn):
    if torch.cuda.is_available():
        pytest.fail("this test describes a machine without a CUDA GPU")
    outcome = resolve_flash_chain("flash_attention_2")
    assert "installed, but this machine has no CUDA GPU" in outcome.steps[0].reason
    assert outcome.chosen == 2


@pytest.mark.filterwarnings("ignore:Using the copy")
def test_shipped_copy_disabled_and_offline_is_a_clear_error(offline_hub, monkeypatch):
    monkeypatch.setenv("KERNEL_LOADER_NO_BUNDLED", "1")
    with pytest.raises(KernelNotFoundError) as info:
        flash_chain_kernel("flash_attention_2")
    text = str(info.value)
    assert "no usable FlashAttention kernel" in text and "sdpa" in text
    assert "1. [no] the flash_attn package" in text
    assert "2. [no] Hub kernel kernels-community/flash-attn2" in text
    assert "3. [no] the shipped kernel" in text and "KERNEL_LOADER_NO_BUNDLED" in text
    case = make_case(b=1, hq=2, hkv=2, sq=3)
    with pytest.raises(KernelNotFoundError):
        ALL_ATTENTION_FUNCTIONS["flash_attention_2"](module(), case.q, case.k, case.v, None)


@pytest.mark.filterwarnings("ignore:Using the copy", "ignore:flash_attention_2 uses")
def test_hub_unreachable_falls_back_to_shipped(hub_env, hub_server, fresh):
    with hub_server.offline():
        outcome = resolve_flash_chain("flash_attention_2")
    assert outcome.steps[1].ok is False
    assert "unreachable" in outcome.steps[1].reason
    assert outcome.chosen == 2


@pytest.mark.filterwarnings("ignore:Using the copy", "ignore:flash_attention_2 uses")
def test_hub_kernel_is_used_when_the_hub_has_it(hub_env, hub_server, fresh):
    hub_server.add_shipped_repo("kernels-community/flash-attn2")
    outcome = resolve_flash_chain("flash_attention_2")
    assert _steps(outcome)[:2] == [("the flash_attn package", False), ("Hub kernel kernels-community/flash-attn2", True)]
    assert outcome.chosen == 1 and len(outcome.steps) == 2
    assert "loaded from hub" in outcome.steps[1].reason and "torch-universal" in outcome.steps[1].reason
    assert outcome.kernel.__kernel_resolution__.source == "hub"


@pytest.mark.filterwarnings("ignore:Using the copy", "ignore:flash_attention_3 uses")
def test_flash_attention_3_chain_offline(offline_hub):
    outcome = resolve_flash_chain("flash_attention_3")
    assert [s.option for s in outcome.steps] == [
        "the flash_attn_interface package",
        "Hub kernel kernels-community/flash-attn3",
        "Hub kernel kernels-community/vllm-flash-attn3",
        "the shipped kernel",
    ]
    assert outcome.chosen == 3 and "shipped copy of kernels-community/flash-attn2" in outcome.steps[3].reason
    assert "kernels-community/flash-attn3 is not shipped" in outcome.steps[3].reason


@pytest.mark.filterwarnings("ignore:Using the copy")
def test_explain_chain_is_fresh_and_silent(offline_hub, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        text = explain_chain("flash_attention_2")
    assert text.splitlines()[0].startswith("flash_attention_2: FlashAttention fallback chain")
    assert "3. [USED] the shipped kernel" in text and "=> flash_attention_2 runs on the shipped kernel" in text
    assert not [w for w in seen if "flash_attention_2 uses" in str(w.message)]
    assert not [r for r in caplog.records if r.name == LOGGER]
    with pytest.raises(KeyError):
        explain_chain("sdpa")
