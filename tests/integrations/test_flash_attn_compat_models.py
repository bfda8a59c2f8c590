"""transformers' own flash-attn paths on kernel_loader's kernel, through the bridge's
``install_flash_attn=True``: the models that import flash-attn themselves (GPT-Neo, Falcon, Bark),
``flash_attention_2`` / ``flash_attention_3`` on a registry model, and ``generate_batch``
(continuous batching, paged cache), each against sdpa (or eager where the model has no sdpa).

transformers only ever uses flash-attn on CUDA, so its CUDA checks are answered yes here: the CPU
stands in for that machine, and the kernel runs in Triton's interpreter. Nothing else is faked:
the stand-in, transformers' flash code and the shipped kernel are the real ones. The same paths
run on a real GPU in bench/generate_batch.py.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kernel_loader  # noqa: E402
import kernel_loader.integrations.transformers as klt  # noqa: E402
from test_flash_attn_compat import doc_block  # noqa: E402

ATOL = 1e-5
DOC = Path(__file__).resolve().parents[2] / "docs" / "transformers.md"

_ON_4 = __import__("transformers").__version__.startswith("4.")
#: Continuous batching's API (ContinuousBatchingConfig) is transformers 5's.
needs_transformers_5 = pytest.mark.skipif(_ON_4, reason="transformers 4.57 has no ContinuousBatchingConfig")
# Model modules that decide at import time whether flash-attn is there.
LEGACY_MODULES = (
    "transformers.models.gpt_neo.modeling_gpt_neo",
    "transformers.models.falcon.modeling_falcon",
    "transformers.models.bark.modeling_bark",
)


@pytest.fixture
def flash_attn_stand_in(offline_shipped, cuda_answered_yes, monkeypatch):
    """The bridge with install_flash_attn=True, on the shipped kernel, with transformers' CUDA
    checks answered yes. Yields a dict counting calls into the kernel, by function name."""
    from transformers import modeling_flash_attention_utils as fa_utils
    from transformers.utils import import_utils

    from kernel_loader.attention.fallback import flash_chain_kernel

    matrix = getattr(fa_utils, "FLASH_ATTENTION_COMPATIBILITY_MATRIX", None)  # 5.x only
    for version in (2, 3) if matrix is not None else ():
        monkeypatch.setitem(matrix[version], "supported_devices", ((lambda: True, "cuda"),))
    monkeypatch.setattr(fa_utils, "_loaded_implementation", None, raising=False)  # transformers' memo of the loaded flash API
    klt.enable(install_flash_attn=True)
    for name in LEGACY_MODULES:  # as if first imported now, after the stand-in came
        if name in sys.modules:
            importlib.reload(sys.modules[name])
    calls: dict[str, int] = {}
    kernel = flash_chain_kernel("flash_attention_2")
    for fn in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"):
        monkeypatch.setattr(kernel, fn, _counted(getattr(kernel, fn), calls))
    try:
        yield calls
    finally:
        klt.disable()
        kernel_loader.uninstall_flash_attn()


def _counted(fn, calls):
    @functools.wraps(fn)  # keeps the signature, which the stand-in reads
    def counted(*args, **kwargs):
        calls[fn.__name__] = calls.get(fn.__name__, 0) + 1
        return fn(*args, **kwargs)

    return counted


def build_pair(cls, config, reference_impl, flash_impl="flash_attention_2"):
    torch.manual_seed(0)
    reference = cls._from_config(copy.deepcopy(config), attn_implementation=reference_impl).eval()
    flash = cls._from_config(copy.deepcopy(config), attn_implementation=flash_impl).eval()
    flash.load_state_dict(reference.state_dict())
    assert flash.config._attn_implementation == flash_impl
    return reference, flash


def assert_same_prefill_and_decode(reference, flash, padded=True, decode=True):
    """Left-padded prefill (unpadded with ``padded=False``), then one cached decode step (none with
    ``decode=False``): logits of real tokens agree."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0
    with torch.no_grad():
        outs = []
        for model in (reference, flash):
            first = model(ids[:, :-1], attention_mask=mask[:, :-1], use_cache=decode)
            step = (model(ids[:, -1:], attention_mask=mask, past_key_values=first.past_key_values, use_cache=True)
                    if decode else None)
            outs.append((first.logits, step.logits if decode else None))
    real = mask[:, :-1].bool()
    torch.testing.assert_close(outs[1][0][real], outs[0][0][real], atol=ATOL, rtol=1e-4)
    if decode:
        torch.testing.assert_close(outs[1][1], outs[0][1], atol=ATOL, rtol=1e-4)


def test_gpt_neo_flash_attention_2_runs_on_the_kernel(flash_attn_stand_in):
    from transformers.models.gpt_neo import modeling_gpt_neo

    # window_size above the sequence length: GPT-Neo's flash class does not apply local windows.
    config = transformers.GPTNeoConfig(
        vocab_size=96, hidden_size=64, num_layers=2, attention_types=[[["global", "local"], 1]], num_heads=4,
        max_position_embeddings=64, window_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    reference, flash = build_pair(transformers.GPTNeoForCausalLM, config, "eager")  # GPT-Neo has no sdpa
    assert isinstance(flash.transformer.h[0].attn.attention, modeling_gpt_neo.GPTNeoFlashAttention2)
    # 4.57's GPTNeoFlashAttention2 slices the 2-D padding mask as a 4-D one (IndexError) before any
    # flash-attn call, so only unpadded batches run there, with any flash-attn
    assert_same_prefill_and_decode(reference, flash, padded=not _ON_4)
    calls = flash_attn_stand_in.get("flash_attn_varlen_func", 0) + flash_attn_stand_in.get("flash_attn_func", 0)
    assert calls >= 4  # prefill + decode, 2 layers (varlen when padded)


@pytest.mark.parametrize("new_decoder_architecture", [False, True], ids=["multi-query", "grouped-kv"])
def test_falcon_flash_attention_2_runs_on_the_kernel(flash_attn_stand_in, new_decoder_architecture):
    from transformers.models.falcon import modeling_falcon

    config = transformers.FalconConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=new_decoder_architecture, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    reference, flash = build_pair(transformers.FalconForCausalLM, config, "sdpa")
    if hasattr(modeling_falcon, "FalconFlashAttention2"):  # up to 5.24: a flash class of its own
        assert isinstance(flash.transformer.h[0].self_attention, modeling_falcon.FalconFlashAttention2)
    else:  # 5.25: one attention class on transformers' attention interface
        assert flash.config._attn_implementation == "flash_attention_2"
    assert_same_prefill_and_decode(reference, flash)
    calls = flash_attn_stand_in.get("flash_attn_varlen_func", 0) + flash_attn_stand_in.get("flash_attn_func", 0)
    assert calls >= 4  # prefill + decode, 2 layers


def test_bark_flash_attention_2_runs_on_the_kernel(flash_attn_stand_in):
    from transformers.models.bark import modeling_bark

    config = transformers.BarkSemanticConfig(
        block_size=64, input_vocab_size=96, output_vocab_size=96, num_layers=2, num_heads=4, hidden_size=64,
    )
    reference, flash = build_pair(modeling_bark.BarkSemanticModel, config, "eager")  # Bark has no sdpa
    assert isinstance(flash.layers[0].attn, modeling_bark.BarkSelfFlashAttention2)
    # 4.57's BarkSelfFlashAttention2 hands its [batch, seq, heads, dim] keys to a DynamicCache made
    # for [batch, heads, seq, dim], which breaks cached decoding with any flash-attn
    assert_same_prefill_and_decode(reference, flash, decode=not _ON_4)
    assert flash_attn_stand_in.get("flash_attn_varlen_func", 0) >= (2 if _ON_4 else 4)


@pytest.mark.parametrize("flash_impl", ["flash_attention_2", "flash_attention_3"])
def test_transformers_native_flash_implementations_use_the_stand_in(flash_attn_stand_in, flash_impl):
    """With flash-attn "installed", the bridge leaves flash_attention_2/3 to transformers, whose
    own wrapper imports flash_attn / flash_attn_interface: both land on the kernel."""
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    )
    reference, flash = build_pair(transformers.LlamaForCausalLM, config, "sdpa", flash_impl)
    assert klt.registered_names() == {}  # transformers' own path, not the bridge's registration
    assert_same_prefill_and_decode(reference, flash)
    assert flash_attn_stand_in.get("flash_attn_varlen_func", 0) >= 4


def _generate_batch_tokens(flash_batching: dict, warmup_flash: bool) -> dict[str, list]:
    """Greedy tokens of 3 prompts through generate_batch on a tiny Llama: sdpa's paged path, and
    flash_attention_2 with ``flash_batching`` added to its ContinuousBatchingConfig."""
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    reference, flash = build_pair(transformers.LlamaForCausalLM, config, "sdpa")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (5, 9, 3)]
    generation = transformers.GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens = {}
    for name, model in (("sdpa", reference), ("flash", flash)):
        batching = transformers.ContinuousBatchingConfig(
            page_size=16, num_blocks=16, max_batch_tokens=64, auto_switch_to_flash=False,
            **(flash_batching if name == "flash" else {}),
        )
        with torch.no_grad():
            result = model.generate_batch(prompts, generation_config=generation,
                                          continuous_batching_config=batching, warmup=warmup_flash and name == "flash")
        tokens[name] = [result[key].generated_tokens for key in sorted(result)]
        assert model.config._attn_implementation == ("sdpa" if name == "sdpa" else "flash_attention_2")
    return tokens


@needs_transformers_5
def test_generate_batch_on_the_kernel_matches_sdpa_paged(flash_attn_stand_in):
    """Continuous batching (paged cache) with flash_attention_2 generates sdpa's greedy tokens."""
    tokens = _generate_batch_tokens({}, warmup_flash=False)
    assert tokens["flash"] == tokens["sdpa"]
    assert all(len(t) == 6 for t in tokens["flash"])
    assert flash_attn_stand_in.get("flash_attn_varlen_func", 0) >= 12  # 2 layers x (prefill + decode steps)


class _ReplayedGraph:
    """What a captured CUDA graph amounts to here: replay() runs the captured forward again on the
    same static input buffers, with the host values (shapes, max lengths) of the capture."""

    def __init__(self, forward_fn, args):
        self.forward_fn, self.args = forward_fn, args

    def replay(self):
        self.forward_fn(*self.args)

    def reset(self):  # transformers frees its graphs with this; nothing is held here
        self.args = ()


@pytest.fixture
def graph_shaped_batching(monkeypatch):
    """transformers' continuous batching as it runs on a GPU with its defaults for flash: decode
    fast path (``flash_attn_with_kvcache`` + block table) and CUDA graphs on, so every batch is
    padded to a graph's fixed size. The CPU has neither, so transformers' two questions (is CUDA
    there, is a graph backend there) are answered yes and a graph capture keeps the forward to
    replay it. The padding, the graph keys and the captured host values are transformers' own."""
    import types

    from transformers.generation.continuous_batching import initialization, model_runner

    class _Cuda(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch.cuda, name)

        @staticmethod
        def is_available():
            return True

    class _Torch(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

    answered = _Torch("torch")
    answered.cuda = _Cuda("torch.cuda")
    monkeypatch.setattr(initialization, "torch", answered)  # 5.17: torch.cuda.is_available()
    monkeypatch.setattr(initialization, "get_accelerator_graph_name", lambda: "CUDAGraph", raising=False)  # 5.24
    for pools in ("get_memory_pools", "get_cuda_pools"):  # 5.24, 5.17
        monkeypatch.setattr(model_runner, pools, lambda: (None, None), raising=False)
    captured = []

    def capture(self, forward_fn, compute_stream, *args):
        forward_fn(*args)  # transformers runs the forward once before capturing it
        graph = _ReplayedGraph(forward_fn, args)
        captured.append(graph)
        self.inputs_and_outputs.set_graph(graph)

    monkeypatch.setattr(model_runner.ModelRunner, "_capture_graph", capture)
    return captured


def _recorded(fn, calls):
    @functools.wraps(fn)
    def record(*args, **kwargs):
        bound = inspect.signature(fn).bind(*args, **kwargs)
        calls.append({k: (v.tolist() if isinstance(v, torch.Tensor) and v.dtype in (torch.int32, torch.int64)
                          else tuple(v.shape) if isinstance(v, torch.Tensor) else v)
                      for k, v in bound.arguments.items()})
        return fn(*args, **kwargs)

    return record


@needs_transformers_5
def test_generate_batch_with_cuda_graph_padding_matches_sdpa_paged(flash_attn_stand_in, graph_shaped_batching,
                                                                   monkeypatch):
    """generate_batch with transformers' GPU defaults for flash (decode fast path, CUDA graphs, so
    padded batches): 3 requests in graphs of 4 rows give a padding row (cache_seqlens -1, a block
    table row of -1) at every decode step, and prefill batches carry query tokens past
    cu_seqlens_q[-1] and empty sequences. The tokens are sdpa's (unpadded, no graphs)."""
    from kernel_loader.attention.fallback import flash_chain_kernel

    kernel = flash_chain_kernel("flash_attention_2")
    decode_calls, varlen_calls = [], []
    monkeypatch.setattr(kernel, "flash_attn_with_kvcache", _recorded(kernel.flash_attn_with_kvcache, decode_calls))
    monkeypatch.setattr(kernel, "flash_attn_varlen_func", _recorded(kernel.flash_attn_varlen_func, varlen_calls))
    # 4 rows per graph for 3 requests; async double-buffering needs a GPU (it changes how inputs
    # are staged, not the attention calls)
    tokens = _generate_batch_tokens({"max_requests_per_batch": 4, "max_blocks_per_request": 4,
                                     "use_async_batching": False}, warmup_flash=True)
    assert tokens["flash"] == tokens["sdpa"]
    assert all(len(t) == 6 for t in tokens["flash"])
    assert graph_shaped_batching, "no graph was captured"
    padded_decode = [c for c in decode_calls if -1 in c["cache_seqlens"]]
    assert len(padded_decode) >= 2 * 5  # 2 layers x the decode steps of 3 requests in 4 rows
    assert all(c["block_table"][c["cache_seqlens"].index(-1)] == [-1] * 4 for c in padded_decode)
    assert any(c["q"][0] > c["cu_seqlens_q"][-1] and c["cu_seqlens_q"][-1] == c["cu_seqlens_q"][-2]
               for c in varlen_calls)  # padded prefill: tokens past the last sequence, empty sequences


@needs_transformers_5
def test_docs_snippet_gpt_neo(flash_attn_stand_in, capsys):
    code = doc_block("tests/integrations/test_flash_attn_compat_models.py::test_docs_snippet_gpt_neo")
    exec(compile(code, str(DOC), "exec"), {"__name__": "__docs__"})
    assert capsys.readouterr().out.split() == ["GPTNeoFlashAttention2", "torch.Size([2,", "20])"]
    assert flash_attn_stand_in.get("flash_attn_func", 0) + flash_attn_stand_in.get("flash_attn_varlen_func", 0) >= 8
