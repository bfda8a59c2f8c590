"""The lead's combined GPU call: every check and timing the issues ask for on the H200, in one run.

    PYTHONPATH=. python3 bench/gpu_final.py OUT_DIR [--budget=SECONDS]

Phases (each bounded and independent: one failing is recorded and the next runs):
1. loader: ``get_kernel("kernels-community/flash-attn2")`` offline on the GPU machine (shipped copy),
   its explanation, ``kernel-loader doctor``;
2. attention registry on the GPU (bf16): eager / sdpa / flex_attention (compiled) /
   flash_attention_2 (fallback chain) / the kernel id, each against an fp64 reference on the real
   positions of a left-padded GQA batch, causal and sliding window; the chain's explanation;
3. kernel correctness at real sizes (bench/check_gpu.py's cases, bf16 and fp16, poisoned outputs);
4. decode benchmark (bench/decode.py);
5. transformers end to end (bench/e2e_transformers.py);
6. the short rows (d=64, seq 1k) timed eagerly and replayed from a CUDA graph, ours beside SDPA's
   FlashAttention-2, to separate kernel time from host launch overhead;
7. the full attention table (bench/attention.py), as far as the budget allows.

Everything lands in OUT_DIR (``summary.md`` and ``summary.json`` plus each phase's own files).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "kernel_repos"))
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the GPU machine has no network

import torch  # noqa: E402

T0 = time.time()
SUMMARY: dict = {"phases": {}}
LINES: list[str] = []


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def phase(name: str, out: Path):
    def wrap(fn):
        t = time.time()
        log(f"--- {name}")
        try:
            result = fn()
            SUMMARY["phases"][name] = {"ok": True, "seconds": round(time.time() - t, 1), "result": result}
        except Exception:
            SUMMARY["phases"][name] = {"ok": False, "seconds": round(time.time() - t, 1),
                                       "error": traceback.format_exc()[-2000:]}
            log(f"{name} FAILED:\n{traceback.format_exc()[-2000:]}")
        (out / "summary.json").write_text(json.dumps(SUMMARY, indent=1, default=str))
        return fn
    return wrap


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def reference(q, k, v, allowed):
    """fp64 attention over [B, H, S, D] with a boolean [B, 1|H, Sq, Sk] mask; GQA by repetition."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
    s = (q.double() @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~allowed, float("-inf"))
    return (s.softmax(-1).nan_to_num(0) @ v).transpose(1, 2)  # [B, Sq, H, D]


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    budget = next((float(a.split("=")[1]) for a in sys.argv[2:] if a.startswith("--budget=")), 480.0)
    deadline = T0 + budget
    import transformers
    import triton

    props = torch.cuda.get_device_properties(0)
    SUMMARY["meta"] = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "command": "PYTHONPATH=. python3 " + " ".join(sys.argv),
        "gpu": props.name, "capability": list(torch.cuda.get_device_capability(0)),
        "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
    }
    log(f"meta {SUMMARY['meta']}")

    @phase("1 loader", out)
    def _loader():
        import kernel_loader

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = time.perf_counter()
            fa = kernel_loader.get_kernel("kernels-community/flash-attn2", version=1)
            first_s = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(1000):
            kernel_loader.get_kernel("kernels-community/flash-attn2", version=1)
        memo_us = (time.perf_counter() - t) * 1e3
        explanation = fa.__kernel_resolution__.explain()
        q, k, v = (torch.randn(2, 512, h, 128, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
        o = fa.flash_attn_func(q, k, v, causal=True)
        allowed = torch.ones(512, 512, dtype=torch.bool, device="cuda").tril()[None, None]
        err = rel(o, reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), allowed))
        doctor = subprocess.run([sys.executable, "-m", "kernel_loader", "doctor"], capture_output=True, text=True,
                                cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        log(explanation)
        log(doctor.stdout[-1500:])
        return {"first_load_s": first_s, "memoized_us": memo_us, "explain": explanation,
                "warnings": [str(w.message)[:300] for w in caught], "bf16_rel_err_vs_fp64": err,
                "doctor_rc": doctor.returncode, "doctor": doctor.stdout[-3000:] + doctor.stderr[-1000:]}

    @phase("2 attention registry", out)
    def _registry():
        from types import SimpleNamespace

        import attention as A

        from kernel_loader.attention import ALL_ATTENTION_FUNCTIONS, create_causal_mask, explain_chain
        from kernel_loader.attention import create_sliding_window_causal_mask

        A.raise_recompile_limit(64)
        b, hq, hkv, s, d, window = 4, 16, 4, 1000, 128, 256
        pad = torch.tensor([0, 37, 0, 511])  # left padding per row
        real = torch.arange(s)[None, :] >= pad[:, None]
        real = real.cuda()
        q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        module = SimpleNamespace(is_causal=True, training=False, layer_idx=0, num_key_value_groups=hq // hkv)
        idx = torch.arange(s, device="cuda")
        rows = []
        for win in (None, window):
            allowed = (idx[None, :] <= idx[:, None])
            if win:
                allowed &= idx[:, None] - idx[None, :] < win
            allowed = allowed[None, None] & real[:, None, None, :]
            ref = reference(q, k, v, allowed)
            for name in ("eager", "sdpa", "flex_attention", "flash_attention_2", "kernels-community/flash-attn2"):
                cfg = SimpleNamespace(_attn_implementation=name, sliding_window=win, is_causal=True)
                x = torch.empty(b, s, 1, device="cuda", dtype=torch.bfloat16)
                builder = create_sliding_window_causal_mask if win else create_causal_mask
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        mask = builder(cfg, x, real.long())
                        fn = ALL_ATTENTION_FUNCTIONS.get_interface(name)
                        o, _ = fn(module, q, k, v, mask, scaling=d ** -0.5, sliding_window=win)
                        torch.cuda.synchronize()
                        t = time.perf_counter()
                        for _ in range(5):
                            fn(module, q, k, v, mask, scaling=d ** -0.5, sliding_window=win)
                        torch.cuda.synchronize()
                        ms = (time.perf_counter() - t) / 5 * 1e3
                    err = rel(o[real], ref[real])
                    rows.append({"backend": name, "window": win, "rel_err": err, "ok": err < 1e-2, "ms": ms})
                except Exception as exc:
                    rows.append({"backend": name, "window": win, "error": f"{type(exc).__name__}: {exc}"[:400]})
                log(str(rows[-1]))
        return {"rows": rows, "chain": explain_chain("flash_attention_2")}

    @phase("3 kernel correctness", out)
    def _checks():
        import check_gpu

        results = {}
        for name, case in check_gpu.CHECKS.items():
            for dt in case[-1]:
                results[f"{name}/{dt}"] = check_gpu.run_check(name, dt)
                log(f"{name}/{dt}: {results[f'{name}/{dt}']}")
        return results

    @phase("4 decode", out)
    def _decode():
        import decode

        checks = decode.check()
        rows = decode.run(out)
        return {"checks": checks, "rows": rows}

    @phase("5 transformers e2e", out)
    def _e2e():
        import e2e_transformers

        return e2e_transformers.run(out)

    @phase("6 short rows, eager vs graph", out)
    def _short():
        import attention as A
        from torch.nn.attention import SDPBackend, sdpa_kernel

        fa = A.load_package()
        rows = []
        for causal in (False, True):
            for provider in ("ours", "fa2"):
                batch, seq, dim = 16, 1024, 64
                q, k, v = A.inputs_for(provider, batch, seq, dim, grad=True)
                do = torch.randn_like(q)
                if provider == "ours":
                    def f():
                        return fa.flash_attn_func(q, k, v, causal=causal)
                else:
                    def f():
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

                def step():
                    return torch.autograd.grad(f(), (q, k, v), do)

                flops = A.fwd_flops(batch, 16, seq, seq, dim, causal)
                res = {"provider": provider, "causal": causal}
                for label, fn, mult in (("fwd", f, 1.0), ("fwd+bwd", step, 3.5)):
                    eager = [A.bench_ms(fn) for _ in range(3)]
                    # the same work replayed from a CUDA graph: no host launch cost between kernels
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        for _ in range(3):
                            fn()
                    torch.cuda.current_stream().wait_stream(s)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        fn()
                    graph = [A.bench_ms(g.replay) for _ in range(3)]
                    res[label] = {"eager_tflops": [flops * mult / (m * 1e-3) / 1e12 for m in eager],
                                  "graph_tflops": [flops * mult / (m * 1e-3) / 1e12 for m in graph]}
                rows.append(res)
                log(json.dumps(res))
        return rows

    @phase("7 attention table", out)
    def _table():
        import attention as A

        remaining = deadline - time.time()
        if remaining < 60:
            return {"skipped": f"only {remaining:.0f} s of the budget left"}
        rows = A.run(with_flex=True, flex_dims=(128,), deadline=deadline - 40, flex_deadline=deadline - 60,
                     hard_deadline=deadline - 10, log=log)
        (out / "attention.json").write_text(json.dumps(rows, indent=1, default=str))
        md = A.table_md(rows, show_first=False)
        (out / "attention.md").write_text(md)
        print(md)
        return {"rows": len(rows)}

    log(f"done in {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
