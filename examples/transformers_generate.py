"""Generate with a transformers model whose attention runs on a kernel loaded by kernel_loader.

    python examples/transformers_generate.py                      # tiny random Llama, CPU or GPU
    python examples/transformers_generate.py --model path/or/hub-id --kernel kernels-community/flash-attn2@v1
    KERNEL_LOADER_TRANSFORMERS=1 python your_script.py            # the same switch, without code changes

No ``kernels`` package is needed: ``attn_implementation="org/repo"`` (and ``"flash_attention_2"``
when ``flash_attn`` is not installed) goes through kernel_loader once the bridge is enabled. The
kernel comes from the Hub, the cache, or -- offline or when the Hub is unreachable -- the copy of
``kernels-community/flash-attn2`` that kernel_loader ships. The script generates with sdpa and with
the kernel, prints both, and exits non-zero if the greedy tokens differ -- unless they part at a
near-tie: where sdpa's own logits put its token and ours within two rounding steps of the model's
dtype (random bf16 weights make such ties common; any change of summation order may flip them).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import transformers

import kernel_loader.integrations.transformers as klt


def tiny_llama_config() -> transformers.LlamaConfig:
    # 2 layers, GQA (4 query heads share 2 key/value heads): small enough for a laptop CPU.
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def load(model_id: str | None, attn_implementation: str, device: str, dtype: torch.dtype):
    if model_id is None:
        torch.manual_seed(0)  # same random weights for every implementation
        model = transformers.AutoModelForCausalLM.from_config(
            tiny_llama_config(), attn_implementation=attn_implementation, dtype=dtype
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_id, attn_implementation=attn_implementation, dtype=dtype
        )
    return model.to(device).eval()


def first_divergence(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, expected: torch.Tensor,
                     actual: torch.Tensor) -> dict | None:
    """Where two greedy generations from the same prompt part, judged by ``model`` (the reference).

    Returns None when they are identical, else the first differing step and row, both tokens, and
    ``gap``: the reference's logit of its own token minus its logit of ours at that step.
    """
    if torch.equal(expected, actual):
        return None
    prompt = input_ids.shape[1]
    differ = (expected[:, prompt:] != actual[:, prompt:]).nonzero()
    step = int(differ[:, 1].min())
    row = int(differ[differ[:, 1] == step][0, 0])
    ids = expected[row:row + 1, : prompt + step]
    mask = torch.cat([attention_mask[row:row + 1], attention_mask.new_ones(1, step)], dim=1)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # as generate() derives them
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=positions).logits[0, -1].float()
    ours, theirs = int(actual[row, prompt + step]), int(expected[row, prompt + step])
    return {"step": step, "row": row, "sdpa_token": theirs, "our_token": ours,
            "gap": float(logits[theirs] - logits[ours]), "top1": float(logits[theirs])}


def is_near_tie(gap: float, top1: float, dtype: torch.dtype) -> bool:
    """Whether a logit gap is at most two rounding steps (units in the last place) of ``dtype`` at
    the top logit's magnitude: a tie that rounding alone can flip."""
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(top1), torch.finfo(dtype).tiny)))
    return gap <= 2 * ulp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model path or Hub id (default: a tiny random Llama)")
    parser.add_argument("--kernel", default="kernels-community/flash-attn2", help="kernel id or flash_attention_2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 / float16 / bfloat16 (default: bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)

    klt.enable()  # or set KERNEL_LOADER_TRANSFORMERS=1 before importing this module

    # Two prompts of different lengths, left-padded as generate() expects for decoders.
    torch.manual_seed(1)
    vocab = 256 if args.model is None else None
    if vocab is None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        batch = tokenizer(["The kernel loader", "Attention kernels from the Hub are"], return_tensors="pt", padding=True)
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    else:
        input_ids = torch.randint(3, vocab, (2, 12))
        attention_mask = torch.ones_like(input_ids)
        attention_mask[0, :4] = 0
        input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    input_ids, attention_mask = input_ids.to(args.device), attention_mask.to(args.device)

    outputs, models = {}, {}
    for impl in ("sdpa", args.kernel):
        model = models[impl] = load(args.model, impl, args.device, dtype)
        start = time.perf_counter()
        with torch.no_grad():
            outputs[impl] = model.generate(
                input_ids, attention_mask=attention_mask, max_new_tokens=args.max_new_tokens,
                min_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=model.config.pad_token_id,
            )
        seconds = time.perf_counter() - start
        print(f"{impl:>32} -> config._attn_implementation={model.config._attn_implementation!r}  {seconds:.2f}s")
        print(f"{'':>32}    new tokens: {outputs[impl][:, input_ids.shape[1]:].tolist()}")

    from kernel_loader.attention.kernel_backends import registered_kernel_backends

    name = klt.registered_names().get(args.kernel, args.kernel)
    backend = registered_kernel_backends().get(name)
    if backend is not None:
        print("\nwhere the kernel came from:\n" + backend.kernel.__kernel_resolution__.explain())

    diverged = first_divergence(models["sdpa"], input_ids, attention_mask, outputs["sdpa"], outputs[args.kernel])
    print(f"\ngreedy tokens identical to sdpa: {diverged is None}")
    if diverged is None:
        return 0
    tie = is_near_tie(diverged["gap"], diverged["top1"], dtype)
    print(f"first difference: new token {diverged['step']} of prompt {diverged['row']}: sdpa chose "
          f"{diverged['sdpa_token']}, the kernel {diverged['our_token']}; sdpa's own logits put them "
          f"{diverged['gap']:.3g} apart (top logit {diverged['top1']:.3g}, {dtype}) -> "
          + ("a near-tie that rounding can flip, not an error" if tie else "a real difference"))
    return 0 if tie else 1


if __name__ == "__main__":
    sys.exit(main())
