"""transformers models running on kernel_loader's attention through the bridge, vs sdpa.

Tiny random-initialised models (2 layers, hidden 64, sequences <= 32, fp32) built from configs:
Llama (GQA), Qwen2 (sliding window on one layer), Gemma2 (softcap + sliding window), an encoder
(BERT on transformers 5.x; on 4.57 BERT does not use the attention interface, so SigLIP's text
encoder stands in, compared without padding because 4.57 drops its padding mask for any "flash"
implementation) and LLaVA (CLIP vision + Llama text) for the per-backbone dict form.

Each model is saved once with sdpa and reloaded with ``from_pretrained(path,
attn_implementation=...)``, so both sides have the same weights. The kernel is the copy
kernel_loader ships (HF_HUB_OFFLINE=1, empty cache), running its Triton kernels in the
interpreter (TRITON_INTERPRET=1 from conftest). Hidden states are compared on non-padded positions
with the fp32 tolerance transformers uses for its eager-vs-sdpa tests (atol 1e-6, rtol 1e-4).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kernel_loader.integrations.transformers as klt  # noqa: E402

KERNEL = "kernels-community/flash-attn2"
ATOL, RTOL = 1e-6, 1e-4  # transformers' fp32 eager<>sdpa tolerance
TF5 = int(transformers.__version__.split(".")[0]) >= 5
VOCAB = 128


@pytest.fixture(scope="module", autouse=True)
def bridge(offline_shipped_module):
    """The bridge on, and the shipped kernel as the only source (offline, empty cache)."""
    klt.enable()
    try:
        yield
    finally:
        klt.disable()


def _kernel_source(name: str) -> str:
    from kernel_loader.attention.kernel_backends import registered_kernel_backends

    return registered_kernel_backends()[name].kernel.__kernel_resolution__.source


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, where: torch.Tensor | None = None, **tol) -> None:
    if where is not None:
        actual, expected = actual[where], expected[where]
    torch.testing.assert_close(actual, expected, atol=tol.get("atol", ATOL), rtol=tol.get("rtol", RTOL))


# ---------------------------------------------------------------------------------------------
# tiny configs


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def qwen2_config():
    return transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_sliding_window=True, sliding_window=8, max_window_layers=0,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def gemma2_config():
    return transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=64, sliding_window=8, attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


DECODERS = {
    "llama": (llama_config, transformers.LlamaForCausalLM),
    "qwen2": (qwen2_config, transformers.Qwen2ForCausalLM),
    "gemma2": (gemma2_config, transformers.Gemma2ForCausalLM),
}
# Gemma2's softcap has no sdpa path in transformers: its reference is eager.
REFERENCE = {"gemma2": "eager"}

_saved: dict[str, Path] = {}


def _saved_model(name: str, make_config, cls, tmp_path_factory) -> Path:
    """Save a seeded sdpa model once per session; the kernel side reloads the same weights."""
    if name not in _saved:
        torch.manual_seed(0)
        model = cls._from_config(make_config(), attn_implementation=REFERENCE.get(name, "sdpa"))
        path = tmp_path_factory.mktemp(f"model-{name}")
        model.save_pretrained(path)
        _saved[name] = path
    return _saved[name]


def _pair(name: str, tmp_path_factory, impl: str = KERNEL):
    make_config, cls = DECODERS[name]
    path = _saved_model(name, make_config, cls, tmp_path_factory)
    ref = cls.from_pretrained(path, attn_implementation=REFERENCE.get(name, "sdpa")).eval()
    ours = cls.from_pretrained(path, attn_implementation=impl).eval()
    return ref, ours


def _batch(seq: int = 24, padding: str = "left"):
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, seq))
    mask = torch.ones(2, seq, dtype=torch.long)
    if padding == "left":
        mask[0, :7] = 0
    elif padding == "right":
        mask[0, -7:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


# ---------------------------------------------------------------------------------------------
# decoders: forward parity (left/right padding), packed sequences, generate


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_decoder_hidden_states_match_sdpa_with_padding(name, tmp_path_factory):
    ref, ours = _pair(name, tmp_path_factory)
    assert ours.config._attn_implementation == KERNEL
    assert _kernel_source(KERNEL) == "bundled"
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from kernel_loader.attention import ALL_ATTENTION_FUNCTIONS as KL_FUNCTIONS

    # transformers dispatches to the very function kernel_loader built for the kernel
    assert ALL_ATTENTION_FUNCTIONS[KERNEL] is KL_FUNCTIONS[KERNEL]
    for padding in ("left", "right"):
        ids, mask = _batch(padding=padding)
        with torch.no_grad():
            expected = ref.model(ids, attention_mask=mask).last_hidden_state
            actual = ours.model(ids, attention_mask=mask).last_hidden_state
        _assert_close(actual, expected, mask.bool())


def test_packed_sequences_via_position_ids_match_separate_sequences(tmp_path_factory):
    ref, ours = _pair("qwen2", tmp_path_factory)  # sliding window 8 < sequence lengths: it must restart
    torch.manual_seed(2)
    lengths = (13, 11)
    seqs = [torch.randint(3, VOCAB, (1, n)) for n in lengths]
    packed = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        actual = ours.model(packed, position_ids=position_ids).last_hidden_state
        expected = torch.cat([ref.model(s).last_hidden_state for s in seqs], dim=1)
    _assert_close(actual, expected)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_greedy_generate_same_tokens_as_sdpa(name, tmp_path_factory):
    ref, ours = _pair(name, tmp_path_factory)
    ids, mask = _batch(seq=12, padding="left")
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    expected = ref.generate(ids, **kwargs)
    actual = ours.generate(ids, **kwargs)
    assert actual.shape == expected.shape == (2, 17)
    assert torch.equal(actual, expected)


def test_training_steps_loss_decreases_and_gradients_match_sdpa(tmp_path_factory):
    ref, ours = _pair("llama", tmp_path_factory)
    ref.train()
    ours.train()
    ids, mask = _batch(seq=16, padding="right")
    labels = ids.masked_fill(mask == 0, -100)

    for model in (ref, ours):
        model.zero_grad()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
    grads_ref = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    grads_ours = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    assert grads_ours.keys() == grads_ref.keys() and "model.layers.0.self_attn.q_proj.weight" in grads_ours
    for n in grads_ref:
        _assert_close(grads_ours[n], grads_ref[n], atol=1e-5, rtol=1e-3)

    optimizer = torch.optim.AdamW(ours.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = ours(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses


# ---------------------------------------------------------------------------------------------
# encoder (bidirectional)


def _encoder():
    if TF5:
        config = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64,
        )
        return "bert", config, transformers.BertModel
    config = transformers.SiglipTextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=32,
    )
    return "siglip-text", config, transformers.SiglipTextModel


def test_encoder_bidirectional_matches_sdpa_with_padding(tmp_path_factory):
    name, config, cls = _encoder()
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(name)
    cls._from_config(copy.deepcopy(config), attn_implementation="sdpa").save_pretrained(path)
    ref = cls.from_pretrained(path, attn_implementation="sdpa").eval()
    ours = cls.from_pretrained(path, attn_implementation=KERNEL).eval()
    assert ours.config._attn_implementation == KERNEL
    # SigLIP's text model on 4.57 drops the padding mask for every "flash" implementation (it is
    # meant for max_length padding), so there the comparison runs on unpadded rows.
    ids, mask = _batch(seq=20, padding="right" if TF5 else "none")
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask).last_hidden_state
        actual = ours(ids, attention_mask=mask).last_hidden_state
    _assert_close(actual, expected, mask.bool())
    # a bidirectional model's first token sees the last one: changing it must change token 0
    ids2 = ids.clone()
    ids2[1, -1] = (ids2[1, -1] + 1) % VOCAB
    with torch.no_grad():
        changed = ours(ids2, attention_mask=mask).last_hidden_state
    assert not torch.allclose(changed[1, 0], actual[1, 0])


# ---------------------------------------------------------------------------------------------
# composite model: per-backbone dict form


def llava_config():
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=28, patch_size=14, projection_dim=32,
    )
    text = llama_config()
    return transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=VOCAB - 1,
        vision_feature_layer=-1, vision_feature_select_strategy="default", image_seq_length=4,
    )


def _llava_inputs():
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB - 1, (2, 14))
    ids[:, 2:6] = VOCAB - 1  # 4 image tokens = (28 / 14) ** 2 patches
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    pixels = torch.randn(2, 3, 28, 28)
    return ids, mask, pixels


def test_composite_model_per_backbone_dict(tmp_path_factory):
    cls = transformers.LlavaForConditionalGeneration
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llava")
    cls._from_config(llava_config(), attn_implementation="sdpa").save_pretrained(path)
    ref = cls.from_pretrained(path, attn_implementation="sdpa").eval()
    ours = cls.from_pretrained(
        path, attn_implementation={"": "sdpa", "text_config": KERNEL, "vision_config": "sdpa"}
    ).eval()
    assert ours.config.text_config._attn_implementation == KERNEL
    assert ours.config.vision_config._attn_implementation == "sdpa"

    ids, mask, pixels = _llava_inputs()

    def hidden(model):
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, pixel_values=pixels, output_hidden_states=True)
        return out.hidden_states[-1]

    expected = hidden(ref)
    _assert_close(hidden(ours), expected, mask.bool())

    # at run time: the vision tower (bidirectional CLIP) moves to the kernel as well
    ours.set_attn_implementation({"vision_config": KERNEL})
    assert ours.config.vision_config._attn_implementation == KERNEL
    assert ours.config.text_config._attn_implementation == KERNEL
    _assert_close(hidden(ours), expected, mask.bool())

    # and back to sdpa everywhere
    ours.set_attn_implementation("sdpa")
    assert ours.config.text_config._attn_implementation == "sdpa"
    assert ours.config.vision_config._attn_implementation == "sdpa"
    _assert_close(hidden(ours), expected, mask.bool())


def test_compiled_training_step_is_one_graph_with_eager_numbers(tmp_path_factory):
    """torch.compile of a forward+backward through the kernel gives the eager step's loss and
    gradients; on transformers 5.x in one graph (``fullgraph=True``: the kernel is a custom operator
    under compilation). transformers 4.57 hands the attention function ``position_ids``, and telling
    packed rows from plain ones reads them, which cuts the graph there."""
    _, ours = _pair("llama", tmp_path_factory)
    ours.train()
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))

    def loss_and_grads(forward):
        ours.zero_grad()
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in ours.parameters()]

    torch._dynamo.reset()
    try:
        compiled_loss, compiled_grads = loss_and_grads(torch.compile(ours, backend="aot_eager", fullgraph=TF5))
    finally:
        torch._dynamo.reset()
    eager_loss, eager_grads = loss_and_grads(ours)
    _assert_close(compiled_loss, eager_loss)
    for got, want in zip(compiled_grads, eager_grads):
        _assert_close(got, want)
