"""examples/transformers_generate.py: it runs offline with the shipped kernel and judges a
difference in greedy tokens by the reference's own logits (a near-tie is not an error)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "transformers_generate.py"


@pytest.fixture
def example(offline_shipped):
    """The example module, run against the shipped kernel only (offline, empty cache)."""
    spec = importlib.util.spec_from_file_location("example_transformers_generate", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    import kernel_loader.integrations.transformers as klt

    klt.disable()


def test_example_generates_the_same_tokens_as_sdpa_on_the_cpu(example, capsys):
    assert example.main(["--device", "cpu", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "greedy tokens identical to sdpa: True" in out
    assert "source:   bundled" in out


def test_first_divergence_names_the_step_and_the_reference_logit_gap(example):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(example.tiny_llama_config(), attn_implementation="sdpa")
    model.eval()
    ids = torch.randint(3, 200, (2, 8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
    assert example.first_divergence(model, ids, mask, expected, expected.clone()) is None
    swapped = expected.clone()
    swapped[1, 8 + 2] = (expected[1, 8 + 2] + 1) % 256
    found = example.first_divergence(model, ids, mask, expected, swapped)
    assert (found["step"], found["row"], found["our_token"]) == (2, 1, int(swapped[1, 10]))
    with torch.no_grad():  # the gap is the reference's logit of its token minus that of ours
        logits = model(expected[1:, :10]).logits[0, -1]
    assert found["gap"] == pytest.approx(float(logits[found["sdpa_token"]] - logits[found["our_token"]]), abs=1e-5)
    assert found["gap"] >= 0  # greedy: the reference's token was its maximum


@pytest.mark.parametrize("gap, top1, dtype, tie", [
    (0.00390625, 0.9258, torch.bfloat16, True),   # one bf16 step at 0.93 (seen on the H200)
    (0.0078125, 0.9258, torch.bfloat16, True),    # two steps
    (0.02, 0.9258, torch.bfloat16, False),
    (0.0, 5.0, torch.float32, True),
    (1e-3, 5.0, torch.float32, False),
])
def test_near_tie_is_two_rounding_steps_of_the_dtype(example, gap, top1, dtype, tie):
    assert example.is_near_tie(gap, top1, dtype) is tie
