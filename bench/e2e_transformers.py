"""End-to-end transformers benchmark: a Llama-architecture model on kernel_loader's kernel.

One run, one model (Llama-3.2-1B shape: hidden 2048, 16 layers, 32 query / 8 key-value heads of
64, vocab 128256; 1.24 B parameters, random weights, bf16), switched between attention
implementations with ``set_attn_implementation`` so every row uses the same weights:

* ``kernels-community/flash-attn2`` through the transformers bridge (the shipped Triton kernel),
* ``flash_attention_2`` through the bridge (``flash_attn`` absent: the fallback chain, same kernel),
* ``sdpa`` (PyTorch picks the backend),
* ``sdpa`` pinned to PyTorch's FlashAttention-2 backend (``sdpa_kernel(FLASH_ATTENTION)``).

Prefill: ``model(ids, use_cache=True, logits_to_keep=1)`` on 8 x 2048 tokens (median of 5 after
2 warm-ups). Decode: greedy ``generate`` of 256 new tokens after the same prompt (min_new_tokens
forces all 256); decode ms/step = (time of the 256-token generate - time of a 1-token generate)
/ 255, which leaves out the prefill and generate's set-up. The four variants alternate over
rounds (7 by default, the order rotating each round); round 0 is a warm-up, and each figure is
the median over the other rounds (the minimum is kept beside it): the lent machine's host speed
drifts between minutes, and eager decoding is bound by host time. The "paired" columns divide
each round's sdpa time by the same round's time of the row, then take the median of those
ratios: the steadier comparison when the host drifts. Before timing, the
bridge's bf16 parity on the GPU: last hidden states of small Llama / Qwen2 (sliding window) /
Gemma2 (softcap) models and of the 1B model vs sdpa (Gemma2: eager) on non-padded positions of a
left-padded batch, with the tolerance transformers' FlashAttention tests use (atol = rtol = 4e-2),
greedy tokens of the small Llama and its gradients after one backward pass.

    PYTHONPATH=. python3 bench/e2e_transformers.py [out_dir]           # on the GPU machine
    PYTHONPATH=. python3 bench/e2e_transformers.py /tmp/out --smoke    # tiny sizes, any machine

``run(out_dir)`` does the same and returns the result dict (bench/gpu_final.py calls it).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

KERNEL = "kernels-community/flash-attn2"
PARITY_TOL = 4e-2  # transformers' FlashAttention-vs-sdpa tests, bf16
REPO_ROOT = Path(__file__).resolve().parents[1]

FULL = dict(batch=8, prompt=2048, new_tokens=256, warmup=2, reps=5, rounds=7, parity_seq=256, big_parity=(2, 512))
SMOKE = dict(batch=2, prompt=64, new_tokens=8, warmup=1, reps=2, rounds=2, parity_seq=32, big_parity=(2, 32))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _big_config(transformers: Any, smoke: bool) -> Any:
    if smoke:
        return transformers.LlamaConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=256, pad_token_id=0, eos_token_id=2,
        )
    return transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=8192, rope_theta=500000.0,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def _small_configs(transformers: Any) -> dict[str, tuple[Any, Any, str]]:
    common = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0)
    return {
        "llama": (transformers.LlamaConfig(**common), transformers.LlamaForCausalLM, "sdpa"),
        "qwen2-sliding": (
            transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=64, max_window_layers=0,
                                     layer_types=["sliding_attention", "full_attention"]),
            transformers.Qwen2ForCausalLM, "sdpa",
        ),
        "gemma2-softcap": (
            transformers.Gemma2Config(**common, head_dim=64, query_pre_attn_scalar=64, sliding_window=64,
                                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
            transformers.Gemma2ForCausalLM, "eager",
        ),
    }


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _left_padded(batch: int, seq: int, vocab: int, device: str, seed: int = 1) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=gen)
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        mask[row, : (seq // 4) * row // max(batch - 1, 1)] = 0
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def _hidden(model: Any, ids: Any, mask: Any) -> Any:
    import torch

    with torch.no_grad():
        return model.model(ids, attention_mask=mask).last_hidden_state


def _compare(actual: Any, expected: Any, mask: Any) -> dict[str, Any]:
    import torch

    a, e = actual[mask.bool()].float(), expected[mask.bool()].float()
    diff = (a - e).abs()
    return {
        "max_abs_diff": diff.max().item(),
        "mean_abs_diff": diff.mean().item(),
        "rel_err": (torch.linalg.vector_norm(a - e) / torch.linalg.vector_norm(e)).item(),
        "within_tol": bool(torch.allclose(a, e, atol=PARITY_TOL, rtol=PARITY_TOL)),
    }


# A second standard implementation compared with the same reference: the bf16 noise floor.
NOISE = {"sdpa": "eager", "eager": None}


def _grads(model: Any, ids: Any, mask: Any) -> dict[str, Any]:
    labels = ids.masked_fill(mask == 0, -100)
    model.train()
    model.zero_grad()
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.eval()
    return grads


def _worst_rel(grads: dict[str, Any], reference: dict[str, Any]) -> float:
    import torch

    return max(
        (torch.linalg.vector_norm(grads[n] - g) / torch.linalg.vector_norm(g).clamp_min(1e-12)).item()
        for n, g in reference.items()
    )


def _divergence(ref: Any, ids: Any, mask: Any, expected: Any, ours: Any) -> dict[str, Any]:
    """Where two greedy generations part, judged by the reference model: the example's
    ``first_divergence`` (step, row, both tokens, the reference's logit gap between them) plus
    whether that gap is a near-tie in the model's dtype."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_example_transformers_generate",
                                                  REPO_ROOT / "examples" / "transformers_generate.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    found = example.first_divergence(ref, ids, mask, expected, ours)
    found["near_tie"] = example.is_near_tie(found["gap"], found["top1"], next(ref.parameters()).dtype)
    return {k: round(v, 5) if isinstance(v, float) else v for k, v in found.items()}


def parity_checks(transformers: Any, device: str, dtype: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    """Parity of the bridge vs sdpa/eager on small models: hidden states, greedy tokens, gradients.

    Each check also compares a second standard implementation (eager vs sdpa) with the same
    reference, which shows how far two correct implementations drift apart in this dtype.
    """
    import torch

    results: dict[str, Any] = {}
    for name, (config, cls, reference) in _small_configs(transformers).items():
        torch.manual_seed(0)
        with torch.device(device):
            ref = cls._from_config(config, attn_implementation=reference, dtype=dtype).eval()

        def same_weights(impl: str) -> Any:
            model = cls._from_config(config.__class__(**config.to_dict()), attn_implementation=impl, dtype=dtype)
            model = model.to(device).eval()
            model.load_state_dict(ref.state_dict())
            return model

        ours = same_weights(KERNEL)
        noise_impl = NOISE[reference]
        noise = same_weights(noise_impl) if noise_impl else None
        ids, mask = _left_padded(4, sizes["parity_seq"], config.vocab_size, device)
        expected = _hidden(ref, ids, mask)
        start = time.perf_counter()
        row = _compare(_hidden(ours, ids, mask), expected, mask)
        row["first_forward_s"] = round(time.perf_counter() - start, 3)
        row["reference"] = reference
        row["config_attn_implementation"] = ours.config._attn_implementation
        if noise is not None:
            row["noise_floor"] = {"implementation": noise_impl, **_compare(_hidden(noise, ids, mask), expected, mask)}
        if name == "llama":
            kwargs = dict(attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
            with torch.no_grad():
                expected_tokens = ref.generate(ids, **kwargs)
                our_tokens = ours.generate(ids, **kwargs)
                row["greedy_16_tokens_identical"] = torch.equal(our_tokens, expected_tokens)
                if not row["greedy_16_tokens_identical"]:
                    row["greedy_divergence"] = _divergence(ref, ids, mask, expected_tokens, our_tokens)
                if noise is not None:
                    # random weights leave near-ties between logits: does a second standard
                    # implementation keep the reference's tokens?
                    row["noise_floor"]["greedy_16_tokens_identical"] = torch.equal(
                        noise.generate(ids, **kwargs), expected_tokens)
            # One backward pass: the worst tensor's relative gradient error against the reference's.
            # Right padding: with left padding the last pad position predicts the first real token,
            # so the loss would depend on what a fully masked query row yields (backend-defined).
            rids, rmask = ids.flip(-1), mask.flip(-1)
            grads_ref = _grads(ref, rids, rmask)
            row["grad_worst_rel_err"] = _worst_rel(_grads(ours, rids, rmask), grads_ref)
            if noise is not None:
                row["noise_floor"]["grad_worst_rel_err"] = _worst_rel(_grads(noise, rids, rmask), grads_ref)
        results[name] = row
        del ref, ours, noise
    return results


@contextlib.contextmanager
def _sdpa_flash_only():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        yield


def bench_rows(transformers: Any, device: str, dtype: Any, sizes: dict[str, Any], smoke: bool) -> dict[str, Any]:
    import torch

    config = _big_config(transformers, smoke)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, config.vocab_size, (sizes["batch"], sizes["prompt"]), generator=gen).to(device)
    mask = torch.ones_like(ids)

    # parity of the big model, bridge vs sdpa, on a left-padded batch
    pb, ps = sizes["big_parity"]
    pids, pmask = _left_padded(pb, ps, config.vocab_size, device, seed=3)
    expected = _hidden(model, pids, pmask)
    model.set_attn_implementation(KERNEL)
    big_parity = _compare(_hidden(model, pids, pmask), expected, pmask)
    model.set_attn_implementation("eager")
    big_parity["noise_floor"] = {"implementation": "eager", **_compare(_hidden(model, pids, pmask), expected, pmask)}
    model.set_attn_implementation("sdpa")
    del expected

    variants: list[tuple[str, str, Callable[[], Any]]] = [
        (KERNEL + " (bridge)", KERNEL, contextlib.nullcontext),
        ("flash_attention_2 (bridge fallback)", "flash_attention_2", contextlib.nullcontext),
        ("sdpa", "sdpa", contextlib.nullcontext),
        ("sdpa, FlashAttention-2 backend", "sdpa", _sdpa_flash_only),
    ]
    tokens = sizes["batch"] * sizes["prompt"]

    def prefill() -> Any:
        return model(ids, attention_mask=mask, use_cache=True, logits_to_keep=1)

    def decode(new_tokens: int = sizes["new_tokens"]) -> Any:
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    # The variants alternate round by round: the lent machine's host speed drifts by tens of
    # percent between minutes, and eager decoding is bound by host time. Round 0 is a warm-up
    # (sdpa's cuDNN builds a graph per new length there; our kernel compiles per shape class).
    measured: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in variants}
    rows: dict[str, dict[str, Any]] = {}
    for round_ in range(sizes["rounds"]):
        # the order rotates too, so no variant always runs first (or right after another) in a round
        shift = round_ % len(variants)
        for label, impl, context in variants[shift:] + variants[:shift]:
            if "error" in rows.get(label, {}):
                continue
            row = rows.setdefault(label, {"attn_implementation": impl})
            try:
                model.set_attn_implementation(impl)
                row["config_attn_implementation"] = model.config._attn_implementation
                with context(), torch.no_grad():
                    if round_ == 0:
                        row["first_prefill_s"] = round(_timed(prefill, device), 3)
                        decode(4)
                    for _ in range(sizes["warmup"]):
                        prefill()
                    times = sorted(_timed(prefill, device) for _ in range(sizes["reps"]))
                    one_token_s = _timed(lambda: decode(1), device)  # prefill + generate's own setup
                    generate_s = _timed(decode, device)
                if round_ == 0:
                    row["first_generate_s"] = round(generate_s, 3)
                    continue
                measured[label].append({
                    "round": round_,
                    "prefill_s": times[len(times) // 2],
                    "decode_step_s": (generate_s - one_token_s) / (sizes["new_tokens"] - 1),
                    "generate_s": generate_s,
                })
            except Exception as exc:  # a refused backend is a result, not a crash of the whole run
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            print(f"  round {round_} {label}: {measured[label][-1] if measured[label] and round_ else row}", flush=True)
    for label, row in rows.items():
        runs = measured[label]
        if "error" in row or not runs:
            continue
        prefill_s = _median([r["prefill_s"] for r in runs])
        step_s = _median([r["decode_step_s"] for r in runs])
        row.update(
            rounds=len(runs),
            prefill_ms=round(prefill_s * 1e3, 2),
            prefill_ms_min=round(min(r["prefill_s"] for r in runs) * 1e3, 2),
            prefill_tokens_per_s=round(tokens / prefill_s),
            generate_s=round(_median([r["generate_s"] for r in runs]), 3),
            decode_ms_per_step=round(step_s * 1e3, 3),
            decode_ms_per_step_min=round(min(r["decode_step_s"] for r in runs) * 1e3, 3),
            decode_tokens_per_s=round(sizes["batch"] / step_s),
            per_round=[{k: (v if k == "round" else round(v * 1e3, 3)) for k, v in r.items()} for r in runs],
        )
    # Paired ratios: each round's sdpa run against the same round's run of the variant. The host's
    # speed drifts between rounds far more than within one, so the median of these ratios is the
    # steadier comparison (above 1: faster than sdpa).
    base_runs = {r["round"]: r for r in measured.get("sdpa", [])}
    for label, row in rows.items():
        pairs = [(base_runs[r["round"]], r) for r in measured[label] if r["round"] in base_runs]
        if "error" in row or not pairs or label == "sdpa":
            continue
        for key, name in (("prefill_s", "prefill"), ("decode_step_s", "decode")):
            ratios = sorted(b[key] / r[key] for b, r in pairs)
            row[f"{name}_vs_sdpa_paired"] = {"median": round(_median(ratios), 4), "min": round(ratios[0], 4),
                                             "max": round(ratios[-1], 4), "rounds": len(ratios)}
    return {"params": params, "config": {k: getattr(config, k) for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "vocab_size")}, "big_model_parity": big_parity, "rows": rows}


def _git_commit() -> str | None:
    if os.environ.get("BENCH_COMMIT"):  # the device machine gets the tree without .git
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except Exception:
        return None


def _markdown(result: dict[str, Any]) -> str:
    env, sizes, bench = result["environment"], result["sizes"], result["bench"]
    lines = [
        f"# transformers end to end: kernel_loader bridge vs sdpa ({env['device']}, {result['date']})",
        "",
        f"Llama architecture, {bench['params'] / 1e9:.2f} B parameters ({bench['config']}), random weights, "
        f"{result['dtype']}; batch {sizes['batch']} x {sizes['prompt']} prompt tokens, {sizes['new_tokens']} new "
        f"tokens (greedy, all forced). torch {env['torch']}, triton {env['triton']}, transformers "
        f"{env['transformers']}, commit {env['commit']}. Command: `{result['command']}`.",
        "",
        "| attention | prefill ms (median / min) | prefill tok/s | vs sdpa | vs sdpa, paired by round (median [min, max]) "
        "| decode tok/s | vs sdpa | vs sdpa, paired by round (median [min, max]) | decode ms/step (median / min) "
        "| generate s (round 0 / median) | first prefill s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def paired(row: dict[str, Any], name: str) -> str:
        p = row.get(f"{name}_vs_sdpa_paired")
        return f"{p['median']:.3f}x [{p['min']:.3f}, {p['max']:.3f}]" if p else "—"

    base = bench["rows"].get("sdpa", {})
    for label, row in bench["rows"].items():
        if "error" in row:
            lines.append(f"| {label} | — | — | — | — | — | — | — | — | — | {row['error']} |")
            continue
        vs_prefill = row["prefill_tokens_per_s"] / base["prefill_tokens_per_s"] if "prefill_tokens_per_s" in base else None
        vs_decode = row["decode_tokens_per_s"] / base["decode_tokens_per_s"] if "decode_tokens_per_s" in base else None
        lines.append(
            f"| {label} | {row['prefill_ms']} / {row.get('prefill_ms_min', '—')} | {row['prefill_tokens_per_s']:,} | "
            f"{f'{vs_prefill:.3f}x' if vs_prefill else '—'} | {paired(row, 'prefill')} | {row['decode_tokens_per_s']:,} | "
            f"{f'{vs_decode:.3f}x' if vs_decode else '—'} | {paired(row, 'decode')} | {row['decode_ms_per_step']} / "
            f"{row.get('decode_ms_per_step_min', '—')} | "
            f"{row.get('first_generate_s', '—')} / {row['generate_s']} | {row['first_prefill_s']} |"
        )
    lines += ["", f"Parity of the bridge in {result['dtype']} (last hidden states on non-padded positions of a "
              f"left-padded batch, vs the reference; tolerance atol = rtol = {PARITY_TOL}). Noise floor: a second "
              "standard implementation (eager) against the same reference.", "",
              "| model | reference | max abs diff | rel err | within tol | noise floor rel err (max abs) | "
              "greedy tokens identical | grad rel err, worst tensor (noise floor) |",
              "|---|---|---|---|---|---|---|---|"]
    checks = dict(result["parity"])
    checks[f"1B model, {sizes['big_parity'][0]} x {sizes['big_parity'][1]}"] = {"reference": "sdpa", **bench["big_model_parity"]}
    for name, row in checks.items():
        noise = row.get("noise_floor")
        noise_text = f"{noise['rel_err']:.3g} ({noise['max_abs_diff']:.3g})" if noise else "—"
        grad = "—"
        if "grad_worst_rel_err" in row:
            grad = f"{row['grad_worst_rel_err']:.3g}"
            if noise and "grad_worst_rel_err" in noise:
                grad += f" ({noise['grad_worst_rel_err']:.3g})"
        greedy = str(row.get("greedy_16_tokens_identical", "—"))
        if "greedy_divergence" in row:
            dv = row["greedy_divergence"]
            greedy += (f" (step {dv['step']}: reference logit gap {dv['gap']:.3g}"
                       + (", a near-tie)" if dv.get("near_tie") else ")"))
        if noise and "greedy_16_tokens_identical" in noise:
            greedy += f" (noise floor: {noise['greedy_16_tokens_identical']})"
        lines.append(
            f"| {name} | {row['reference']} | {row['max_abs_diff']:.3g} | {row['rel_err']:.3g} | {row['within_tol']} | "
            f"{noise_text} | {greedy} | {grad} |"
        )
    return "\n".join(lines) + "\n"


def run(out_dir: str | os.PathLike[str], *, smoke: bool = False) -> dict[str, Any]:
    """Run the parity checks and the benchmark; write ``e2e-transformers-<date>.json`` / ``.md``.

    Uses the shipped kernel when the Hub is unreachable (the GPU machine has no network:
    ``HF_HUB_OFFLINE=1`` is set unless the caller set it). Returns the result dict.

    Raises:
        UnsupportedTransformersVersionError: transformers is outside the bridge's supported range.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    import triton

    import kernel_loader.integrations.transformers as klt

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sizes = SMOKE if smoke else FULL
    klt.enable()
    try:
        started = time.perf_counter()
        parity = parity_checks(transformers, device, dtype, sizes)
        print(f"parity: {json.dumps(parity, indent=1)}", flush=True)
        bench = bench_rows(transformers, device, dtype, sizes, smoke)
    finally:
        klt.disable()
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "PYTHONPATH=. python3 bench/e2e_transformers.py $OUT" + (" --smoke" if smoke else ""),
        "dtype": str(dtype).replace("torch.", ""),
        "sizes": sizes,
        "environment": {
            "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "commit": _git_commit(),
        },
        "parity": parity,
        "bench": bench,
        "seconds": round(time.perf_counter() - started, 1),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"e2e-transformers-{result['date']}" + ("-smoke" if smoke else "")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{stem}.md").write_text(_markdown(result))
    return result


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    res = run(args[0] if args else REPO_ROOT / "bench" / "results", smoke="--smoke" in sys.argv)
    print(_markdown(res))
