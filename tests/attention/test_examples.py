"""The attention examples run and say what they claim."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_custom_attention_example(capsys):
    from kernel_loader.attention import AttentionInterface, AttentionMaskInterface

    try:
        _load("custom_attention").main()
    finally:
        for name in ("alibi", "alibi_unmasked"):
            AttentionInterface.unregister(name)
            AttentionMaskInterface.unregister(name)
    out = capsys.readouterr().out
    assert "weight on padded keys: 0.0" in out
    assert "no formatter -> mask None" in out and "local override called 1 time(s)" in out


@pytest.mark.filterwarnings("ignore:Using the copy", "ignore:flash_attention_2 uses")
def test_standalone_model_switches_backends(offline_hub):
    ex = _load("standalone_model")
    model = ex.TinyDecoder(ex.DecoderConfig()).eval()
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        model.set_attn_implementation("eager")
        ref = model(ids, mask)
        for name in ("sdpa", "flash_attention_2", "kernels-community/flash-attn2"):
            model.set_attn_implementation(name)
            torch.testing.assert_close(model(ids, mask)[mask.bool()], ref[mask.bool()], atol=1e-4, rtol=1e-4)
        full = ex.paged_generate(model, "paged|eager", new_tokens=3)
        assert torch.equal(ex.paged_generate(model, "paged|sdpa", new_tokens=3), full)
        assert torch.equal(ex.paged_generate(model, "paged|flash_attention_2", new_tokens=3), full)
