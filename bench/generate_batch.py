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
   graphs off for both (sdpa's default). Then our kernel with transformers' default configuration
   for flash (CUDA graphs on, padded batches), in a child process (a failed capture can leave the
   CUDA context unusable): 3 rounds, round 0 a warm-up that also records the padded inputs the
   kernel receives; tokens/s with and without transformers' warm-up (graph capture) time, and the
   tokens compared with our graphs-off run. On a failure the child runs again with
   CUDA_LAUNCH_BLOCKING=1 and both outputs' last lines go into the results; then once more with
   every flash call traced and synchronized, and the arguments of the call that faulted (shapes,
   strides, buffer sizes, small integer tensors' values) go in too.

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


def _llama_pair(transformers: Any, device: str, dtype: Any, sizes: dict[str, Any]) -> tuple[Any, Any, list, Any]:
    """(sdpa model, flash_attention_2 model with the same weights, prompts, generation config)."""
    import torch

    config = transformers.LlamaConfig(
        vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], intermediate_size=sizes["hidden"] * 3,
        num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"], num_key_value_heads=sizes["kv_heads"],
        head_dim=sizes["hidden"] // sizes["heads"], max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    sdpa = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=_sdpa_paged_name(
        transformers), dtype=dtype)
    ours = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="flash_attention_2",
                                                      dtype=dtype)
    ours.load_state_dict(sdpa.state_dict())
    rng = random.Random(0)
    prompts = [[rng.randrange(3, sizes["vocab"]) for _ in range(rng.randint(sizes["min_prompt"], sizes["max_prompt"]))]
               for _ in range(sizes["requests"])]
    generation = transformers.GenerationConfig(max_new_tokens=sizes["new_tokens"], min_new_tokens=sizes["new_tokens"],
                                               do_sample=False, eos_token_id=None, pad_token_id=0)
    return sdpa.to(device).eval(), ours.to(device).eval(), prompts, generation


def _runner(transformers: Any, prompts: list, generation: Any, sizes: dict[str, Any], smoke: bool, device: str):
    """run_once(model, graphs) -> (seconds, seconds spent in transformers' warm-up, tokens per request).

    ``graphs`` None is transformers' default configuration (CUDA graphs on for flash on a GPU), with
    its warm-up (graph capture); the warm-up time is measured by wrapping ``ModelRunner.warmup``."""
    import torch
    from transformers.generation.continuous_batching import model_runner

    warmup_s = [0.0]
    real_warmup = model_runner.ModelRunner.warmup
    if not getattr(real_warmup, "_timed", False):
        def timed_warmup(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return real_warmup(self, *args, **kwargs)
            finally:
                _sync(device)
                warmup_s[0] += time.perf_counter() - start

        timed_warmup._timed = True
        model_runner.ModelRunner.warmup = timed_warmup

    def run_once(model: Any, graphs: bool | None) -> tuple[float, float, list[list[int]]]:
        batching = _batching_config(transformers, graphs, sizes, smoke)
        warmup_s[0] = 0.0
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching,
                                       warmup=graphs is not False)
        _sync(device)
        elapsed = time.perf_counter() - start
        return elapsed, warmup_s[0], [list(out[key].generated_tokens) for key in sorted(out)]

    return run_once


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    same = [x == y for x, y in zip(a, b)]
    prefix = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) for x, y in zip(a, b)]
    return {"identical_sequences": f"{sum(same)}/{len(same)}", "mean_common_prefix_tokens": statistics.mean(prefix)}


def generate_batch_rows(transformers: Any, device: str, dtype: Any, sizes: dict[str, Any], smoke: bool,
                        deadline: float) -> tuple[dict[str, Any], dict[str, list[list[int]]]]:
    sdpa, ours, prompts, generation = _llama_pair(transformers, device, dtype, sizes)
    sdpa_name = _sdpa_paged_name(transformers)
    run_once = _runner(transformers, prompts, generation, sizes, smoke, device)

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
            elapsed, _, tokens = run_once(model, False)
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
    result.update(_agreement(outputs["ours"], outputs["sdpa"]))
    result["all_lengths_full"] = all(len(t) == sizes["new_tokens"] for t in outputs["ours"])
    return result, outputs


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
            if "error" in default:
                cell = f"failed: {default['error'].splitlines()[0]} | — |"
            else:
                cell = (f"{default['tok_per_s_after_warmup']:.0f} (warm-up excluded; {default['tok_per_s']:.0f} with it) | "
                        f"{default['tok_per_s_after_warmup'] / gb['sdpa_tok_per_s_median']:.3f} (ratio of medians) |")
            lines.append(f"| flash_attention_2, transformers' default config (CUDA graphs on) | {cell}")
        lines += ["", "Per round (tokens/s, ours / sdpa): " + ", ".join(
            f"{r['round']}: {r['ours_tok_per_s']:.0f} / {r['sdpa_tok_per_s']:.0f}" for r in gb["rounds"]) + "."]
        lines += ["", f"Rounds: {len(gb['rounds'])} (round 0 warm-up, order alternating). Greedy outputs identical to "
                  f"sdpa: {gb['identical_sequences']} sequences; mean common prefix "
                  f"{gb['mean_common_prefix_tokens']:.1f} of {gb['new_tokens']} tokens (greedy bf16 decoding of a random "
                  "model; where the two part was not checked for near-ties: the forward parity below is the "
                  "correctness check).", ""]
        if default and "error" not in default:
            agree = default.get("agreement_with_ours_graphs_off", {})
            lines += [f"CUDA graphs on: {len(default['rounds'])} rounds (round 0 warm-up), resolved config "
                      f"{default['resolved_config']}; greedy outputs identical to ours with graphs off: "
                      f"{agree.get('identical_sequences')} (mean common prefix {agree.get('mean_common_prefix_tokens')}); "
                      f"padded inputs the kernel received (eager calls of round 0): {default['padding_seen']}.", ""]
        elif default:
            lines += ["CUDA graphs on, the failure (last lines; then a re-run with CUDA_LAUNCH_BLOCKING=1):", "",
                      "```", default.get("output_tail", ""), "---", default.get("with_CUDA_LAUNCH_BLOCKING=1", ""),
                      "```", ""]
            if default.get("faulting_call"):
                call = default["faulting_call"]
                lines += [f"The flash call that faulted (a third run with every call synchronized): call "
                          f"{call['call']}, `{call['kind']}`, arguments:", "", "```json",
                          json.dumps(call["arguments"], indent=1)[:6000], "```", ""]
    lines += ["## Forward, bf16, left-padded batch (2-layer models: times are mostly launch overhead)", "", "| model | reference | max abs err | within 4e-2 | ours ms | reference ms |",
              "|---|---|---|---|---|---|"]
    for name, row in res.get("forward", {}).items():
        if "error" in row:
            lines.append(f"| {name} | {row['reference']} | error: {row['error'].splitlines()[0]} | | | |")
        else:
            lines.append(f"| {name} | {row['reference']} | {row['max_abs_err']:.3g} | {row['within_tol']} | "
                         f"{row['ours_ms']:.2f} | {row['reference_ms']:.2f} |")
    return "\n".join(lines) + "\n"


GRAPH_ROUNDS = 3  # transformers' default configuration: round 0 is a warm-up (and records the padding seen)


def _setup(smoke: bool) -> tuple[Any, Any, str, Any]:
    """(torch, transformers, device, dtype) with the bridge enabled and flash-attn "installed".

    Returns device None when there is no CUDA GPU and ``smoke`` is off."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the kernel the chain finds offline: the shipped one

    import kernel_loader.integrations.transformers as klt

    klt.enable(install_flash_attn=True)  # before any model module is imported
    import torch
    import transformers
    from transformers.utils import import_utils

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if not smoke:
            return torch, transformers, None, None
        _open_cuda_gate_for_smoke()
        import_utils.is_flash_attn_2_available.cache_clear()
    return torch, transformers, device, torch.bfloat16 if device == "cuda" else torch.float32


_FLASH_CALLS = {"flash_attn_with_kvcache": "kvcache", "flash_attn_varlen_func": "varlen"}


def _hook_flash_calls(torch: Any, before: Any, after: Any = None) -> None:
    """Around every ``flash_attn_with_kvcache`` / ``flash_attn_varlen_func`` call of the kernel
    the FlashAttention chain chose: ``before(kind, arguments, capturing)`` with the arguments
    bound by name (``kind``: "kvcache" or "varlen"; ``capturing``: inside a CUDA-graph capture,
    where no tensor may be read), then the call, then ``after(capturing)``."""
    import functools
    import inspect

    from kernel_loader.attention.fallback import flash_chain_kernel

    kernel = flash_chain_kernel("flash_attention_2")

    def wrap(fn: Any, kind: str) -> Any:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def hooked(*args: Any, **kwargs: Any) -> Any:
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            before(kind, signature.bind(*args, **kwargs).arguments, capturing)
            result = fn(*args, **kwargs)
            if after is not None:
                after(capturing)
            return result

        return hooked

    for name, kind in _FLASH_CALLS.items():
        setattr(kernel, name, wrap(getattr(kernel, name), kind))


def _padding_probe(torch: Any, seen: dict[str, Any], enabled: list[bool]) -> None:
    """Count, in the eager calls (never inside a graph capture, where reading a tensor is not
    allowed), the padded inputs transformers hands the kernel: decode rows with negative
    cache_seqlens and all -1 block-table rows, prefill tokens past cu_seqlens_q[-1], empty
    sequences, max_seqlen_k above the key rows."""

    def bump(key: str, by: int = 1) -> None:
        seen[key] = seen.get(key, 0) + by

    def count(kind: str, a: dict[str, Any], capturing: bool) -> None:
        if not enabled[0] or capturing:
            return
        bump(f"{kind}_eager_calls")
        if kind == "kvcache" and isinstance(a.get("cache_seqlens"), torch.Tensor):
            lens, table = a["cache_seqlens"], a.get("block_table")
            bump("kvcache_padding_rows", int((lens < 0).sum()))
            seen["kvcache_min_cache_seqlens"] = min(seen.get("kvcache_min_cache_seqlens", 0), int(lens.min()))
            if table is not None:
                bump("kvcache_all_minus_one_block_rows", int((table < 0).all(dim=1).sum()))
            seen.setdefault("kvcache_batch_sizes", set()).add(int(lens.shape[0]))
        elif kind == "varlen":
            cu_q, q, k = a["cu_seqlens_q"], a["q"], a["k"]
            bump("varlen_tokens_past_cu_seqlens_q", max(0, q.shape[0] - int(cu_q[-1])))
            bump("varlen_empty_sequences", int((cu_q.diff() == 0).sum()))
            if int(a["max_seqlen_k"]) > k.shape[0]:
                bump("varlen_max_seqlen_k_above_key_rows")

    _hook_flash_calls(torch, count)


def _describe(torch: Any, value: Any, capturing: bool) -> Any:
    """A JSON-able account of one argument: a tensor's shape, strides, dtype, buffer size and,
    for small integer tensors outside a graph capture, its values."""
    if isinstance(value, torch.Tensor):
        info: dict[str, Any] = {"shape": list(value.shape), "stride": list(value.stride()),
                                "dtype": str(value.dtype).replace("torch.", ""),
                                "buffer_bytes": value.untyped_storage().nbytes(), "offset": value.storage_offset()}
        if not capturing and not value.is_floating_point() and value.numel() <= 4096:
            values = value.flatten().tolist()
            info["values"] = values if len(values) <= 64 else values[:32] + ["..."] + values[-32:]
        return info
    return value if isinstance(value, (int, float, bool, str, type(None))) else repr(value)[:60]


def _trace_calls(torch: Any, path: Path) -> None:
    """Write each flash call's arguments to ``path`` (one JSON line), synchronizing before and
    after every call outside a graph capture, so after a fault the last line without a
    following "ok" line is the call that faulted."""
    log = path.open("a", buffering=1)
    count = [0]
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def before(kind: str, arguments: dict[str, Any], capturing: bool) -> None:
        count[0] += 1
        if not capturing:
            _sync(device)
        described = {k: _describe(torch, v, capturing) for k, v in arguments.items()}
        log.write(json.dumps({"call": count[0], "kind": kind, "capturing": capturing, "arguments": described}) + "\n")

    def after(capturing: bool) -> None:
        if not capturing:
            _sync(device)
            log.write(json.dumps({"ok": count[0]}) + "\n")

    _hook_flash_calls(torch, before, after)


def _faulting_call(path: Path) -> dict[str, Any] | None:
    """The last traced call that has no "ok" line after it (see :func:`_trace_calls`)."""
    last = None
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if "call" in entry:
                last = entry
            elif last is not None and entry.get("ok") == last["call"]:
                last = None
    return last


def graphs_child(out: Path, smoke: bool, rounds: int, trace: Path | None = None) -> int:
    """The row 'transformers' default configuration (CUDA graphs on)', in its own process: a
    failed capture can leave the CUDA context unusable. Writes ``out/graphs.json``."""
    torch, transformers, device, dtype = _setup(smoke)
    if device is None:
        print("no CUDA GPU: run with --smoke on a CPU", file=sys.stderr)
        return 2
    from transformers.generation.continuous_batching import continuous_api

    sizes = SMOKE if smoke else FULL
    _, ours, prompts, generation = _llama_pair(transformers, device, dtype, sizes)
    run_once = _runner(transformers, prompts, generation, sizes, smoke, device)
    resolved: dict[str, Any] = {}
    real_resolve = continuous_api.resolve_continuous_batching_config

    def recording_resolve(*args: Any, **kwargs: Any) -> Any:
        config = real_resolve(*args, **kwargs)
        resolved.update({name: getattr(config, name, None) for name in (
            "use_cuda_graph", "use_async_batching", "max_requests_per_batch", "max_blocks_per_request",
            "max_batch_tokens", "q_padding_interval_size", "kv_padding_interval_size")})
        return config

    continuous_api.resolve_continuous_batching_config = recording_resolve
    seen: dict[str, Any] = {}
    probing = [True]
    _padding_probe(torch, seen, probing)
    if trace is not None:
        _trace_calls(torch, trace)
    result: dict[str, Any] = {"rounds": []}
    for rnd in range(rounds):
        probing[0] = rnd == 0  # the probe's reads cost host syncs: only in the warm-up round
        elapsed, warmup_s, tokens = run_once(ours, None)
        generated = sum(map(len, tokens))
        row = {"round": rnd, "s": elapsed, "warmup_s": warmup_s, "tok_per_s": generated / elapsed,
               "tok_per_s_after_warmup": generated / max(elapsed - warmup_s, 1e-9)}
        result["rounds"].append(row)
        result["tokens"] = tokens
        print(f"graphs round {rnd}: {row}", flush=True)
    result["resolved_config"] = {k: list(v) if isinstance(v, tuple) else v for k, v in resolved.items()}
    result["padding_seen"] = {k: sorted(v) if isinstance(v, set) else v for k, v in seen.items()}
    (out / "graphs.json").write_text(json.dumps(result) + "\n")
    return 0


def _graphs_row(out: Path, smoke: bool, reference: dict[str, list[list[int]]]) -> dict[str, Any]:
    """Runs :func:`graphs_child`; on a failure runs it once more with CUDA_LAUNCH_BLOCKING=1, so
    the error names the operation that failed (transformers runs each new graph's forward eagerly
    before capturing it)."""
    import tempfile

    faulting: list[Any] = [None]

    def attempt(env: dict[str, str], rounds: int, trace: bool = False) -> tuple[dict[str, Any] | None, str, int]:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, str(Path(__file__).resolve()), tmp, "--graphs-child", f"--rounds={rounds}"]
            if trace:
                cmd.append(f"--trace-calls={Path(tmp) / 'calls.jsonl'}")
            proc = subprocess.run(cmd + (["--smoke"] if smoke else []), capture_output=True, text=True, env=env,
                                  timeout=900, cwd=REPO_ROOT)
            path = Path(tmp) / "graphs.json"
            data = json.loads(path.read_text()) if proc.returncode == 0 and path.exists() else None
            if trace:
                faulting[0] = _faulting_call(Path(tmp) / "calls.jsonl")
        # an abort's C++ backtrace ("frame #N: ...") would push the message out of the tail
        lines = [line for line in (proc.stdout + proc.stderr).strip().splitlines() if not line.startswith("frame #")]
        tail = "\n".join(lines[-40:])
        return data, tail, proc.returncode

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    data, tail, rc = attempt(env, GRAPH_ROUNDS)
    if data is None:
        errors = [line for line in tail.splitlines() if "Error" in line]
        last = errors[-1] if errors else tail.splitlines()[-1] if tail else "no output"
        row: dict[str, Any] = {"error": f"exit status {rc}: {last}", "output_tail": tail}
        _, blocking_tail, _ = attempt(dict(env, CUDA_LAUNCH_BLOCKING="1"), 1)
        row["with_CUDA_LAUNCH_BLOCKING=1"] = blocking_tail
        attempt(env, 1, trace=True)  # every flash call synchronized: the one that faulted, with its arguments
        row["faulting_call"] = faulting[0]
        print(f"faulting call: {json.dumps(faulting[0])[:4000]}", flush=True)
        print(f"graphs row failed:\n{tail}\n--- with CUDA_LAUNCH_BLOCKING=1:\n{blocking_tail}", flush=True)
        return row
    measured = data["rounds"][1:] or data["rounds"]
    row = {"rounds": data["rounds"], "resolved_config": data["resolved_config"], "padding_seen": data["padding_seen"],
           "tok_per_s": statistics.median(r["tok_per_s"] for r in measured),
           "tok_per_s_after_warmup": statistics.median(r["tok_per_s_after_warmup"] for r in measured)}
    for label, tokens in reference.items():
        row[f"agreement_with_{label}_graphs_off"] = _agreement(data["tokens"], tokens)
    return row


def main(argv: list[str]) -> int:
    smoke = "--smoke" in argv
    commit = next((a.split("=", 1)[1] for a in argv if a.startswith("--commit=")), None)  # a copied tree has no .git
    args = [a for a in argv if not a.startswith("--")]
    out = Path(args[0] if args else REPO_ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    if "--graphs-child" in argv:
        rounds = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--rounds=")), GRAPH_ROUNDS)
        trace = next((Path(a.split("=", 1)[1]) for a in argv if a.startswith("--trace-calls=")), None)
        return graphs_child(out, smoke, rounds, trace)
    sizes = SMOKE if smoke else FULL
    deadline = time.monotonic() + sizes["budget_s"]
    torch, transformers, device, dtype = _setup(smoke)
    if device is None:
        print("no CUDA GPU: run with --smoke on a CPU", file=sys.stderr)
        return 2
    from transformers.utils import import_utils

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
    outputs: dict[str, list[list[int]]] = {}
    try:
        gb, outputs = generate_batch_rows(transformers, device, dtype, sizes, smoke, deadline)
        res["generate_batch"] = gb
    except Exception as exc:
        res["generate_batch"] = {"error": f"{type(exc).__name__}: {exc}"}
        import traceback

        traceback.print_exc()
    write()
    res["forward"] = forward_rows(transformers, device, dtype, sizes)
    write()
    if outputs and "error" not in res["generate_batch"]:
        if device == "cuda":
            torch.cuda.empty_cache()  # the child process needs the memory
        res["generate_batch"]["ours_default_config"] = _graphs_row(out, smoke, outputs)
        write()
    print(_markdown(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
