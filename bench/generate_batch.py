"""transformers' own flash-attn paths on kernel_loader's kernel, through ``install_flash_attn``.

The bridge is enabled with ``install_flash_attn=True`` before any model module is imported, so
transformers finds "flash-attn 2.8.3" (kernel_loader's stand-in, running on the shipped Triton
kernel) and uses its native FlashAttention code paths; nothing of transformers is patched.

1. Forward parity and time, bf16, left-padded batch 4 x 256: GPT-Neo and Bark (vs eager: they
   have no sdpa) and Falcon (vs sdpa), with ``attn_implementation="flash_attention_2"``. Parity on
   real tokens' logits with transformers' FlashAttention test tolerance (atol = rtol = 4e-2).
2. ``generate_batch`` (continuous batching, paged KV cache) throughput on a Llama-shaped random
   model (hidden 1024, 8 layers, 16 query / 4 key-value heads of 64, bf16): 48 prompts of 64-512
   tokens, 96 greedy new tokens each (EOS disabled). ``flash_attention_2`` (our kernel: varlen
   prefill, ``flash_attn_with_kvcache`` paged decode) against sdpa's paged path, in paired rounds
   (alternating which runs first; round 0 is a warm-up; up to 5 rounds, fewer once a minute has
   passed, at least 3); the figure is the median over rounds of
   generated tokens per second, and the paired ratio is the median of per-round ratios. CUDA
   graphs off for both (sdpa's default); then, once, our kernel with transformers' default
   configuration for flash (CUDA graphs on).

    PYTHONPATH=. python3 bench/generate_batch.py OUT_DIR [--commit=SHA]   # on the GPU machine
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/generate_batch.py OUT_DIR --smoke   # CPU, tiny

``--smoke`` shrinks every size and, on a machine without CUDA, answers transformers' "is CUDA
available" checks yes (as tests/integrations/test_flash_attn_compat_models.py does), so the
script itself can be checked without a GPU; its figures mean nothing.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
TOL = 4e-2
FULL = dict(fwd_batch=4, fwd_seq=256, fwd_reps=5, hidden=1024, layers=8, heads=16, kv_heads=4, vocab=32000,
            requests=48, min_prompt=64, max_prompt=512, new_tokens=96, rounds=5, budget_s=60)
SMOKE = dict(fwd_batch=2, fwd_seq=16, fwd_reps=1, hidden=64, layers=2, heads=4, kv_heads=2, vocab=96,
             requests=3, min_prompt=3, max_prompt=9, new_tokens=4, rounds=2, budget_s=600)


def _open_cuda_gate_for_smoke() -> None:
    from transformers import modeling_flash_attention_utils as fa_utils
    from transformers.utils import import_utils

    import_utils.is_torch_cuda_available = lambda: True
    for version in (2, 3):
        fa_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX[version]["supported_devices"] = ((lambda: True, "cuda"),)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _left_padded(batch: int, seq: int, vocab: int, device: str) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, : (row * seq) // (2 * batch)] = 0
    return ids.to(device), mask.to(device)


def forward_rows(transformers: Any, device: str, dtype: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers.models.bark import modeling_bark

    h = sizes["hidden"] // 4
    models = {
        "gpt-neo": (transformers.GPTNeoForCausalLM, transformers.GPTNeoConfig(
            vocab_size=1024, hidden_size=h, num_layers=2, attention_types=[[["global", "local"], 1]], num_heads=4,
            max_position_embeddings=1024, window_size=1024), "eager"),
        "falcon": (transformers.FalconForCausalLM, transformers.FalconConfig(
            vocab_size=1024, hidden_size=h, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
            new_decoder_architecture=True), "sdpa"),
        "bark": (modeling_bark.BarkSemanticModel, transformers.BarkSemanticConfig(
            block_size=1024, input_vocab_size=1024, output_vocab_size=1024, num_layers=2, num_heads=4,
            hidden_size=h), "eager"),
    }
    ids, mask = _left_padded(sizes["fwd_batch"], sizes["fwd_seq"], 1024, device)
    real = mask.bool()
    rows: dict[str, Any] = {}
    for name, (cls, config, reference_impl) in models.items():
        row: dict[str, Any] = {"reference": reference_impl}
        try:
            torch.manual_seed(0)
            reference = cls._from_config(copy.deepcopy(config), attn_implementation=reference_impl, dtype=dtype)
            ours = cls._from_config(copy.deepcopy(config), attn_implementation="flash_attention_2", dtype=dtype)
            ours.load_state_dict(reference.state_dict())
            reference, ours = reference.to(device).eval(), ours.to(device).eval()
            row["attention_class"] = type(next(m for m in ours.modules() if "FlashAttention" in type(m).__name__)).__name__
            times: dict[str, list[float]] = {"ours": [], "reference": []}
            with torch.no_grad():
                expected = reference(ids, attention_mask=mask).logits.float()
                got = ours(ids, attention_mask=mask).logits.float()
                for _ in range(sizes["fwd_reps"]):
                    for label, model in (("ours", ours), ("reference", reference)):
                        _sync(device)
                        start = time.perf_counter()
                        model(ids, attention_mask=mask)
                        _sync(device)
                        times[label].append((time.perf_counter() - start) * 1e3)
            diff = (got[real] - expected[real]).abs()
            row.update(
                max_abs_err=float(diff.max()),
                within_tol=bool(torch.allclose(got[real], expected[real], atol=TOL, rtol=TOL)),
                ours_ms=statistics.median(times["ours"]),
                reference_ms=statistics.median(times["reference"]),
            )
        except Exception as exc:  # one model failing must not hide the others' figures
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        rows[name] = row
        print(f"forward {name}: {row}", flush=True)
    return rows


def _batching_config(transformers: Any, graphs: bool | None, sizes: dict[str, Any], smoke: bool) -> Any:
    """A ContinuousBatchingConfig for this transformers version (fields differ between 5.17 and 5.24)."""
    import dataclasses

    cls = getattr(transformers, "ContinuousBatchingConfig", None)
    if cls is None:
        return None
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    if "auto_switch_to_flash" in fields:
        kwargs["auto_switch_to_flash"] = False
    if graphs is not None:
        kwargs["use_cuda_graph"] = graphs
    if smoke:
        kwargs.update({("page_size" if "page_size" in fields else "block_size"): 16, "num_blocks": 16,
                       "max_batch_tokens": 64})
    return cls(**kwargs)


def _sdpa_paged_name(transformers: Any) -> str:
    """sdpa for continuous batching: 5.24 takes "sdpa" (paged inside); 5.17 wants "paged|sdpa"."""
    import dataclasses

    cls = getattr(transformers, "ContinuousBatchingConfig", None)
    fields = {f.name for f in dataclasses.fields(cls)} if cls is not None else set()
    return "sdpa" if "auto_switch_to_flash" in fields else "paged|sdpa"


def generate_batch_rows(transformers: Any, device: str, dtype: Any, sizes: dict[str, Any], smoke: bool,
                        deadline: float) -> tuple[dict[str, Any], Any, Any]:
    import torch

    config = transformers.LlamaConfig(
        vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], intermediate_size=sizes["hidden"] * 3,
        num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"], num_key_value_heads=sizes["kv_heads"],
        head_dim=sizes["hidden"] // sizes["heads"], max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )
    sdpa_name = _sdpa_paged_name(transformers)
    torch.manual_seed(0)
    sdpa = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=sdpa_name, dtype=dtype)
    ours = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="flash_attention_2",
                                                      dtype=dtype)
    ours.load_state_dict(sdpa.state_dict())
    sdpa, ours = sdpa.to(device).eval(), ours.to(device).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, sizes["vocab"]) for _ in range(rng.randint(sizes["min_prompt"], sizes["max_prompt"]))]
               for _ in range(sizes["requests"])]
    generation = transformers.GenerationConfig(max_new_tokens=sizes["new_tokens"], min_new_tokens=sizes["new_tokens"],
                                               do_sample=False, eos_token_id=None, pad_token_id=0)

    def run_once(model: Any, graphs: bool | None) -> tuple[float, list[list[int]]]:
        batching = _batching_config(transformers, graphs, sizes, smoke)
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching,
                                       warmup=graphs is not False)
        _sync(device)
        elapsed = time.perf_counter() - start
        tokens = [list(out[key].generated_tokens) for key in sorted(out)]
        return elapsed, tokens

    result: dict[str, Any] = {"sdpa_implementation": sdpa_name, "prompt_tokens": sum(map(len, prompts)),
                              "requests": len(prompts), "new_tokens": sizes["new_tokens"], "rounds": []}
    outputs: dict[str, list[list[int]]] = {}
    for rnd in range(sizes["rounds"]):
        if time.monotonic() > deadline and rnd >= 3:
            result["stopped_early"] = f"time budget reached after {rnd} rounds"
            break
        order = [("ours", ours), ("sdpa", sdpa)] if rnd % 2 == 0 else [("sdpa", sdpa), ("ours", ours)]
        row: dict[str, Any] = {"round": rnd, "first": order[0][0]}
        for label, model in order:
            elapsed, tokens = run_once(model, False)
            generated = sum(len(t) for t in tokens)
            row[f"{label}_s"] = elapsed
            row[f"{label}_tok_per_s"] = generated / elapsed
            outputs[label] = tokens
        result["rounds"].append(row)
        print(f"generate_batch round {rnd}: {row}", flush=True)
        print(f"  attn: ours {ours.config._attn_implementation}, sdpa {sdpa.config._attn_implementation}", flush=True)
    measured = result["rounds"][1:] or result["rounds"]
    for label in ("ours", "sdpa"):
        result[f"{label}_tok_per_s_median"] = statistics.median(r[f"{label}_tok_per_s"] for r in measured)
    result["paired_ratio_median"] = statistics.median(r["ours_tok_per_s"] / r["sdpa_tok_per_s"] for r in measured)
    same = [a == b for a, b in zip(outputs["ours"], outputs["sdpa"])]
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
              for a, b in zip(outputs["ours"], outputs["sdpa"])]
    result["identical_sequences"] = f"{sum(same)}/{len(same)}"
    result["mean_common_prefix_tokens"] = statistics.mean(prefix)
    result["all_lengths_full"] = all(len(t) == sizes["new_tokens"] for t in outputs["ours"])
    return result, ours, run_once


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:
        return None


def _markdown(res: dict[str, Any]) -> str:
    env = res["environment"]
    lines = [
        "# generate_batch and flash-attn model paths on kernel_loader's kernel (install_flash_attn)", "",
        f"Date: {res['date']} · GPU: {env.get('gpu')} · torch {env['torch']} · triton {env.get('triton')} · "
        f"transformers {env['transformers']} · commit {res.get('commit') or 'n/a'}", "",
        f"Command: `{res['command']}`", "",
        f"transformers sees flash-attn: `is_flash_attn_2_available()` = {res['flash_attn_seen']['is_flash_attn_2_available']}, "
        f"`flash_attn.__version__` = {res['flash_attn_seen']['version']}, module: {res['flash_attn_seen']['module']}", "",
    ]
    gb = res.get("generate_batch", {})
    if "error" in gb:
        lines += [f"generate_batch failed: {gb['error'].splitlines()[0]}", ""]
    elif gb:
        lines += [
            f"## generate_batch ({gb['requests']} requests, {gb['prompt_tokens']} prompt tokens, {gb['new_tokens']} "
            f"new tokens each, bf16 Llama-shaped random model)", "",
            "| attention | tokens/s (median) | paired ratio ours/sdpa |", "|---|---|---|",
            f"| flash_attention_2 (our kernel via flash_attn stand-in), CUDA graphs off | "
            f"{gb['ours_tok_per_s_median']:.0f} | {gb['paired_ratio_median']:.3f} |",
            f"| {gb['sdpa_implementation'].replace('|', chr(92) + '|')} (sdpa paged path), CUDA graphs off | "
            f"{gb['sdpa_tok_per_s_median']:.0f} | 1 |",
        ]
        default = gb.get("ours_default_config")
        if default:
            error = default.get("error", "").splitlines()[0] if "error" in default else ""
            cell = f"{default['tok_per_s']:.0f} | — |" if "tok_per_s" in default else f"failed: {error} | — |"
            lines.append(f"| flash_attention_2, transformers' default config (CUDA graphs on) | {cell}")
        lines += ["", "Per round (tokens/s, ours / sdpa): " + ", ".join(
            f"{r['round']}: {r['ours_tok_per_s']:.0f} / {r['sdpa_tok_per_s']:.0f}" for r in gb["rounds"]) + "."]
        lines += ["", f"Rounds: {len(gb['rounds'])} (round 0 warm-up, order alternating). Greedy outputs identical to "
                  f"sdpa: {gb['identical_sequences']} sequences; mean common prefix "
                  f"{gb['mean_common_prefix_tokens']:.1f} of {gb['new_tokens']} tokens (greedy bf16 decoding of a random "
                  "model; where the two part was not checked for near-ties: the forward parity below is the "
                  "correctness check).", ""]
    lines += ["## Forward, bf16, left-padded batch (2-layer models: times are mostly launch overhead)", "", "| model | reference | max abs err | within 4e-2 | ours ms | reference ms |",
              "|---|---|---|---|---|---|"]
    for name, row in res.get("forward", {}).items():
        if "error" in row:
            lines.append(f"| {name} | {row['reference']} | error: {row['error'].splitlines()[0]} | | | |")
        else:
            lines.append(f"| {name} | {row['reference']} | {row['max_abs_err']:.3g} | {row['within_tol']} | "
                         f"{row['ours_ms']:.2f} | {row['reference_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    smoke = "--smoke" in argv
    commit = next((a.split("=", 1)[1] for a in argv if a.startswith("--commit=")), None)  # a copied tree has no .git
    args = [a for a in argv if not a.startswith("--")]
    out = Path(args[0] if args else REPO_ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    sizes = SMOKE if smoke else FULL
    deadline = time.monotonic() + sizes["budget_s"]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the kernel the chain finds offline: the shipped one

    import kernel_loader.integrations.transformers as klt

    klt.enable(install_flash_attn=True)  # before any model module is imported
    import torch
    import transformers
    from transformers.utils import import_utils

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if not smoke:
            print("no CUDA GPU: run with --smoke on a CPU", file=sys.stderr)
            return 2
        _open_cuda_gate_for_smoke()
        import_utils.is_flash_attn_2_available.cache_clear()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    import flash_attn

    from kernel_loader.attention.fallback import explain_chain

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    res: dict[str, Any] = {
        "bench": "generate_batch",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "PYTHONPATH=. python3 bench/generate_batch.py OUT_DIR" + (" --smoke" if smoke else ""),
        "commit": commit or _git_commit(),
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__, "triton": triton_version,
                        "python": platform.python_version(),
                        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)"},
        "flash_attn_seen": {"is_flash_attn_2_available": bool(import_utils.is_flash_attn_2_available()),
                            "version": flash_attn.__version__, "module": repr(flash_attn)},
        "sizes": sizes,
    }

    def write() -> None:
        (out / "generate_batch.json").write_text(json.dumps(res, indent=2) + "\n")
        (out / "generate_batch.md").write_text(_markdown(res))

    print(explain_chain("flash_attention_2"), flush=True)
    ours = run_once = None
    try:
        gb, ours, run_once = generate_batch_rows(transformers, device, dtype, sizes, smoke, deadline)
        res["generate_batch"] = gb
    except Exception as exc:
        res["generate_batch"] = {"error": f"{type(exc).__name__}: {exc}"}
        import traceback

        traceback.print_exc()
    write()
    res["forward"] = forward_rows(transformers, device, dtype, sizes)
    write()
    if run_once is not None and device == "cuda":
        # Last, as a failed CUDA graph capture can leave the context unusable.
        try:
            elapsed, tokens = run_once(ours, None)
            res["generate_batch"]["ours_default_config"] = {"s": elapsed,
                                                            "tok_per_s": sum(map(len, tokens)) / elapsed}
        except Exception as exc:
            res["generate_batch"]["ours_default_config"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        write()
    print(_markdown(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
