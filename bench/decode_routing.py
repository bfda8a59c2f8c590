"""Which entry point should a decode step take through the flash wrapper?

    PYTHONPATH=. python3 bench/decode_routing.py OUT_DIR

The wrapper can send a one-token query to the kernel's ``flash_attn_with_kvcache`` (split-K,
reads K/V once per kv head, two launches) or to ``flash_attn_func`` (one launch, one program per
query head, K/V read once per query head). In eager decoding the host's launch cost can matter
more than the GPU time, so this times both as a model would call them: many calls back to back,
wall clock per call, synchronised once at the end; SDPA (default choice) beside them. Then the
same question end to end: ``generate()`` on the 1B Llama of bench/e2e_transformers.py with the
routing on and off, alternated.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def per_call_us(fn, n: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def layer_calls() -> list[dict]:
    import warnings

    from kernel_loader.attention import flash as flash_mod
    from kernel_loader.attention import sdpa_attention_forward
    from kernel_loader.loader import get_bundled_kernel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kernel = get_bundled_kernel("kernels-community/flash-attn2")
    fn = flash_mod.make_flash_attention(kernel)
    threshold = flash_mod.DECODE_MIN_KV_BYTES
    rows = []
    for batch, ctx, hq, hk, d in ((8, 2304, 32, 8, 64), (1, 32768, 32, 8, 128), (32, 4096, 32, 8, 128),
                                  (32, 32768, 32, 8, 128)):
        module = SimpleNamespace(is_causal=True, training=False, layer_idx=0, num_key_value_groups=hq // hk)
        q = torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, hk, ctx, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(batch, hk, ctx, d, device="cuda", dtype=torch.bfloat16)
        row = {"batch": batch, "ctx": ctx, "hq": hq, "hk": hk, "d": d}
        with torch.no_grad():
            flash_mod.DECODE_MAX_QUERY, flash_mod.DECODE_MIN_KV_BYTES = 16, 0
            row["kvcache_us"] = per_call_us(lambda: fn(module, q, k, v, None, scaling=d ** -0.5))
            flash_mod.DECODE_MAX_QUERY = 0
            row["func_us"] = per_call_us(lambda: fn(module, q, k, v, None, scaling=d ** -0.5))
            row["sdpa_us"] = per_call_us(lambda: sdpa_attention_forward(module, q, k, v, None, scaling=d ** -0.5))
            flash_mod.DECODE_MAX_QUERY, flash_mod.DECODE_MIN_KV_BYTES = 16, threshold
            row["default_us"] = per_call_us(lambda: fn(module, q, k, v, None, scaling=d ** -0.5))
        flash_mod.DECODE_MAX_QUERY, flash_mod.DECODE_MIN_KV_BYTES = 16, threshold
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v
    return rows


def end_to_end() -> list[dict]:
    import transformers

    import e2e_transformers as e
    import kernel_loader.integrations.transformers as klt
    from kernel_loader.attention import flash as flash_mod

    klt.enable()
    config = e._big_config(transformers, smoke=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                              dtype=torch.bfloat16).eval()
    ids = torch.randint(3, config.vocab_size, (8, 2048), device="cuda")
    mask = torch.ones_like(ids)

    def generate(n):
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0)

    rows = []
    with torch.no_grad():
        for impl, routing in (("sdpa", None), (e.KERNEL, 16), (e.KERNEL, 0), ("sdpa", None), (e.KERNEL, 16),
                              (e.KERNEL, 0)):
            model.set_attn_implementation(impl)
            if routing is not None:
                flash_mod.DECODE_MAX_QUERY = routing
            generate(8)
            one = e._timed(lambda: generate(1), "cuda")
            full = e._timed(lambda: generate(128), "cuda")
            row = {"impl": impl, "decode_max_query": routing, "ms_per_step": (full - one) / 127 * 1e3}
            print(json.dumps(row), flush=True)
            rows.append(row)
    flash_mod.DECODE_MAX_QUERY = 16
    return rows


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    import transformers
    import triton

    result = {"meta": {"date": time.strftime("%Y-%m-%d", time.gmtime()), "gpu": torch.cuda.get_device_name(0),
                       "torch": torch.__version__, "triton": triton.__version__,
                       "transformers": transformers.__version__,
                       "command": "PYTHONPATH=. python3 bench/decode_routing.py $OUT"}}
    result["layer_calls"] = layer_calls()
    (out / "decode_routing.json").write_text(json.dumps(result, indent=1))
    result["end_to_end"] = end_to_end()
    (out / "decode_routing.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
