"""Decode benchmark: flash_attn_with_kvcache of the shipped flash-attn2 repo beside SDPA.

One query token per sequence, GQA 32 query / 8 key-value heads, head_dim 128, batch 32, bf16,
contexts 4k and 32k; our kernel on a contiguous cache and on a paged one (page 256, pages
randomly permuted), SDPA (cuDNN, flash, efficient backends forced, ``enable_gqa=True``) on the
same K/V values in its own ``[B, H, L, D]`` layout. Figures are TB/s of K+V read (the bytes the
step must move), median of CUDA-graph replays; eager (launch overhead included) beside them.
Each run also checks every output against a float32 reference (bf16 bound: 1e-2 relative).

    PYTHONPATH=. python3 bench/decode.py [out_dir]      # on a GPU; writes decode-<date>.md|json

``run(out_dir) -> list[dict]`` is what a single GPU script calls; ``sweep`` times tile/split
variants of the Triton kernel (used to pick the shipped defaults).
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = (REPO_ROOT / "kernel_repos" / "kernels-community" / "flash-attn2" / "build"
               / "torch-universal" / "flash_attn2")

BATCH, HEADS_Q, HEADS_KV, HEAD_DIM, PAGE = 32, 32, 8, 128, 256
CONTEXTS = (4096, 32768)
TOLERANCE = 1e-2
DEVICE = "cuda"  # a CPU smoke run of the script's plumbing sets "cpu" (TRITON_INTERPRET=1)


def load_package():
    """The shipped flash_attn2 package, imported by path under a private name."""
    name = "_bench_flash_attn2"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, PACKAGE_DIR / "__init__.py",
                                                  submodule_search_locations=[str(PACKAGE_DIR)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg
    spec.loader.exec_module(pkg)
    return pkg


def _time(fn: Callable[[], object]) -> dict:
    """Median ms of eager calls and of CUDA-graph replays."""
    import triton.testing

    eager = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")
    try:
        graph = triton.testing.do_bench_cudagraph(fn, rep=150, return_mode="median")
    except Exception as exc:  # graphs are a bonus; eager is always reported
        print(f"  cuda graph failed: {type(exc).__name__}: {exc}")
        graph = None
    return {"eager_ms": eager, "graph_ms": graph}


def _inputs(ctx: int, gen: torch.Generator) -> dict:
    dev = DEVICE
    q = torch.randn(BATCH, 1, HEADS_Q, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(BATCH, ctx, HEADS_KV, HEAD_DIM, device=dev, dtype=torch.bfloat16,
                    generator=gen)
    v = torch.randn(BATCH, ctx, HEADS_KV, HEAD_DIM, device=dev, dtype=torch.bfloat16,
                    generator=gen)
    pages_per_row = ctx // PAGE
    num_blocks = BATCH * pages_per_row
    perm = torch.randperm(num_blocks, device=dev, generator=gen)
    table = perm.view(BATCH, pages_per_row).to(torch.int32)
    k_paged = torch.empty(num_blocks, PAGE, HEADS_KV, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    v_paged = torch.empty_like(k_paged)
    k_paged[table.long()] = k.view(BATCH, pages_per_row, PAGE, HEADS_KV, HEAD_DIM)
    v_paged[table.long()] = v.view(BATCH, pages_per_row, PAGE, HEADS_KV, HEAD_DIM)
    lens = torch.full((BATCH,), ctx, device=dev, dtype=torch.int32)
    return dict(q=q, k=k, v=v, k_paged=k_paged, v_paged=v_paged, table=table, lens=lens)


def _reference(inp: dict) -> torch.Tensor:
    """float32 attention of the one query token over all keys, [B, 1, Hq, D]."""
    group = HEADS_Q // HEADS_KV
    outs = []
    for b in range(BATCH):
        q = inp["q"][b, 0].float().view(HEADS_KV, group, HEAD_DIM)
        k = inp["k"][b].float().transpose(0, 1)  # [Hk, L, D]
        v = inp["v"][b].float().transpose(0, 1)
        s = torch.einsum("hgd,hld->hgl", q, k) / math.sqrt(HEAD_DIM)
        outs.append(torch.einsum("hgl,hld->hgd", s.softmax(-1), v).reshape(HEADS_Q, HEAD_DIM))
    return torch.stack(outs).unsqueeze(1)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.float()
    if not torch.isfinite(got).all():
        return float("nan")
    return float((got - want).norm() / want.norm())


CHECKS = [
    # (name, dtype, batch, Sq, S_new, Hq, Hk, D, page, capacity, causal, window, softcap, alibi)
    ("decode d128 paged64 append", torch.bfloat16, 8, 1, 1, 32, 8, 128, 64, 4096, True,
     (-1, -1), 0.0, False),
    ("decode d64 contig window", torch.float16, 6, 1, 1, 16, 2, 64, 0, 3000, True, (700, -1),
     0.0, False),
    ("decode d256 paged256 softcap", torch.bfloat16, 4, 1, 0, 8, 8, 256, 256, 2048, False,
     (-1, -1), 30.0, False),
    ("chunk4 d96 contig alibi", torch.bfloat16, 5, 4, 4, 12, 4, 96, 0, 1500, True, (-1, -1),
     0.0, True),
    ("chunk33 d128 paged16 mqa", torch.float16, 3, 33, 33, 8, 1, 128, 16, 2048, True,
     (-1, -1), 0.0, False),
    # strides not multiples of 16 elements: the kernel's unaligned (no vector hint) variant
    ("decode d40 contig unaligned", torch.bfloat16, 4, 1, 1, 8, 2, 40, 0, 1000, True,
     (-1, -1), 0.0, False),
]


def check(device: str = "cuda", cases: list = CHECKS) -> list[dict]:
    """Triton path vs the package's PyTorch path on float32 copies, at GPU sizes.

    Every buffer the kernel writes is poisoned with NaN first; lengths are random per row and
    include 0 and non-multiples of the page size; new keys are appended.
    """
    pkg = load_package()
    kv = importlib.import_module(pkg.__name__ + "._kvcache")
    decode = importlib.import_module(pkg.__name__ + "._triton_decode")
    original = decode._alloc
    decode._alloc = lambda shape, dtype, device: original(shape, dtype, device).fill_(float("nan"))
    gen = torch.Generator(device=device).manual_seed(int(time.time()) + 1)
    rows = []
    try:
        for (name, dtype, batch, sq, snew, hq, hk, d, page, cap, causal, window, softcap,
             alibi) in cases:
            dev = device
            rnd = lambda *shape: torch.randn(*shape, device=dev, generator=gen).to(dtype)
            lens = torch.randint(0, cap - snew + 1, (batch,), device=dev, generator=gen,
                                 dtype=torch.int32)
            lens[0] = 0
            table = None
            if page:
                per_row = cap // page
                nblocks = batch * per_row + 5
                k_cache, v_cache = rnd(nblocks, page, hk, d), rnd(nblocks, page, hk, d)
                table = torch.randperm(nblocks, device=dev, generator=gen)[: batch * per_row]
                table = table.view(batch, per_row).to(torch.int32)
            else:
                k_cache, v_cache = rnd(batch, cap, hk, d), rnd(batch, cap, hk, d)
            q = rnd(batch, sq, hq, d)
            k_new = rnd(batch, snew, hk, d) if snew else None
            v_new = rnd(batch, snew, hk, d) if snew else None
            slopes = torch.rand(hq, device=dev, generator=gen) if alibi else None
            out, lse = pkg.flash_attn_with_kvcache(
                q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lens, block_table=table,
                causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
                return_softmax_lse=True)
            total = (lens + snew).long()
            rows_idx = torch.arange(batch, device=dev)
            want, want_lse = kv._attention_gathered(
                q.float(), k_cache.float(), v_cache.float(), total, 0, cap, table, page or cap,
                rows_idx, None, slopes, d ** -0.5, causal,
                (window[0], 0 if causal else window[1]), softcap)
            err = _rel_err(out, want)
            fin = torch.isfinite(want_lse)
            lse_err = float((lse[fin] - want_lse[fin]).abs().max()) if fin.any() else 0.0
            ok = (err < TOLERANCE and lse_err < 2e-2 and not out.isnan().any()
                  and torch.equal(torch.isfinite(lse), fin))
            rows.append({"check": name, "rel_err": err, "lse_max_abs_err": lse_err, "ok": ok})
            print(f"check {name:32s} rel err {err:.1e} lse err {lse_err:.1e} "
                  f"{'ok' if ok else 'FAIL'}")
    finally:
        decode._alloc = original
    return rows


def run(out_dir: str | os.PathLike | None = None) -> list[dict]:
    """Time and check every row; write decode-<date>.json|md under ``out_dir`` when given."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pkg = load_package()
    fa = pkg.flash_attn_with_kvcache
    gen = torch.Generator(device=DEVICE).manual_seed(int(time.time()))
    rows: list[dict] = []
    for ctx in CONTEXTS:
        inp = _inputs(ctx, gen)
        ref = _reference(inp)
        kv_bytes = 2 * BATCH * ctx * HEADS_KV * HEAD_DIM * 2

        outputs: dict[str, torch.Tensor] = {}

        def record(name: str, fn: Callable[[], torch.Tensor], note: str = "") -> None:
            try:
                out = fn()
                torch.cuda.synchronize()
                outputs[name] = out.reshape(ref.shape).float()
                err = _rel_err(out.reshape(ref.shape), ref)
                times = _time(fn)
            except Exception as exc:
                rows.append({"ctx": ctx, "impl": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
                print(f"ctx {ctx} {name}: {rows[-1]['error']}")
                return
            again = _time(fn)  # a second timing shows the spread between runs
            best = times["graph_ms"] or times["eager_ms"]
            row = {"ctx": ctx, "impl": name, **times, "graph_ms_again": again["graph_ms"],
                   "eager_ms_again": again["eager_ms"],
                   "tb_s": kv_bytes / (best * 1e-3) / 1e12,
                   "tb_s_eager": kv_bytes / (times["eager_ms"] * 1e-3) / 1e12,
                   "tb_s_again": kv_bytes / ((again["graph_ms"] or again["eager_ms"]) * 1e-3)
                   / 1e12,
                   "rel_err": err, "ok": bool(err < TOLERANCE), "note": note}
            rows.append(row)
            print(f"ctx {ctx:6d} {name:24s} {row['tb_s']:.2f} / {row['tb_s_again']:.2f} TB/s "
                  f"(eager {row['tb_s_eager']:.2f})"
                  f"  err {err:.1e}")

        record("ours contiguous", lambda: fa(inp["q"], inp["k"], inp["v"],
                                             cache_seqlens=inp["lens"]))
        record("ours paged-256", lambda: fa(inp["q"], inp["k_paged"], inp["v_paged"],
                                            cache_seqlens=inp["lens"], block_table=inp["table"]))
        # The appended token is the row's last one again, so the cache's values (and the
        # reference) stay what they were while every call does the write.
        new_k = inp["k"][:, -1:].clone()
        new_v = inp["v"][:, -1:].clone()
        short = inp["lens"] - 1
        record("ours paged-256 +append", lambda: fa(
            inp["q"], inp["k_paged"], inp["v_paged"], k=new_k, v=new_v, cache_seqlens=short,
            block_table=inp["table"]), note="one new token written into the cache per call")
        # SDPA's own layout; contiguous copies of the same values.
        qs = inp["q"].transpose(1, 2).contiguous()
        ks = inp["k"].transpose(1, 2).contiguous()
        vs = inp["v"].transpose(1, 2).contiguous()
        for label, backend in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
                               ("sdpa flash", SDPBackend.FLASH_ATTENTION),
                               ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION)):
            def sdpa(backend=backend):
                with sdpa_kernel(backend):
                    out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs,
                                                                           enable_gqa=True)
                return out.transpose(1, 2)
            record(label, sdpa)
        # The efficient backend has no GQA: give it K/V repeated to 32 heads (4x the bytes
        # moved; TB/s still counts the 8-head bytes, i.e. the work of the same step).
        ke = ks.repeat_interleave(HEADS_Q // HEADS_KV, dim=1)
        ve = vs.repeat_interleave(HEADS_Q // HEADS_KV, dim=1)

        def sdpa_efficient_expanded():
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(qs, ke, ve)
            return out.transpose(1, 2)
        record("sdpa efficient (K/V x4)", sdpa_efficient_expanded,
               note="K/V materialised at 32 heads; it reads 4x the bytes")
        # Ours against SDPA cuDNN directly (both bf16 on the same values).
        if "sdpa cudnn" in outputs:
            for row in rows:
                if row["ctx"] == ctx and row["impl"] in outputs and row["impl"].startswith("ours"):
                    row["rel_diff_vs_sdpa_cudnn"] = _rel_err(outputs[row["impl"]],
                                                             outputs["sdpa cudnn"])
        del inp, qs, ks, vs, ke, ve, outputs
        torch.cuda.empty_cache()
    if out_dir is not None:
        write_results(rows, Path(out_dir), "decode")
    return rows


SWEEP_CONFIGS = [(64, 4, 4), (128, 4, 3), (64, 4, 3), (64, 8, 4), (128, 4, 4)]


def sweep(budget_s: float = 60.0, ctx: int = CONTEXTS[-1], splits_list=(1, 2, 4, 3),
          configs=SWEEP_CONFIGS) -> list[dict]:
    """Tile / split variants of the Triton kernel, contiguous and paged (best first)."""
    pkg = load_package()
    decode = importlib.import_module(pkg.__name__ + "._triton_decode")
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    inp = _inputs(ctx, gen)
    ref = _reference(inp)
    kv_bytes = 2 * BATCH * ctx * HEADS_KV * HEAD_DIM * 2
    rows = []
    start = time.time()
    for cfg in configs:
        for splits in splits_list:
            for paged in (False, True):
                if time.time() - start > budget_s:
                    print("sweep: time budget reached")
                    return sorted(rows, key=lambda r: -r["tb_s"])
                k = inp["k_paged"] if paged else inp["k"]
                v = inp["v_paged"] if paged else inp["v"]

                def fn():
                    return decode.decode_attention(
                        inp["q"], k, v, total_lens=inp["lens"], total_len_uniform=0,
                        capacity=ctx, block_table=inp["table"] if paged else None,
                        batch_idx=None, leftpad=None, alibi_slopes=None,
                        softmax_scale=HEAD_DIM ** -0.5, window_left=-1, window_right=-1,
                        softcap=0.0, num_splits=splits, config=cfg)[0]
                try:
                    err = _rel_err(fn(), ref)
                    ms = _time(fn)["graph_ms"]
                except Exception as exc:
                    print(f"sweep {cfg} splits {splits} paged {paged}: {type(exc).__name__}: {exc}")
                    continue
                row = {"ctx": ctx, "paged": paged, "block_n": cfg[0], "num_warps": cfg[1],
                       "num_stages": cfg[2], "splits": splits, "graph_ms": ms,
                       "tb_s": kv_bytes / (ms * 1e-3) / 1e12, "rel_err": err}
                rows.append(row)
                print(f"sweep {cfg} splits {splits} paged {paged}: {row['tb_s']:.2f} TB/s "
                      f"err {err:.1e}")
    return sorted(rows, key=lambda r: -r["tb_s"])


def _versions() -> dict:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": datetime.date.today().isoformat()}


def write_results(rows: list[dict], out_dir: Path, stem: str, extra: dict | None = None) -> None:
    """``<stem>-<date>.json`` (rows + versions) and a markdown table beside it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {**_versions(), "command": "PYTHONPATH=. python3 bench/decode.py $OUT",
            "shape": f"batch {BATCH}, heads {HEADS_Q}/{HEADS_KV}, head_dim {HEAD_DIM}, bf16, "
                     f"1 query token, page {PAGE}"}
    if extra:
        meta.update(extra)
    date = meta["date"]
    (out_dir / f"{stem}-{date}.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                            indent=1))
    lines = [f"# Decode attention, {meta['gpu']}, {date}", "",
             f"{meta['shape']}; torch {meta['torch']}, triton {meta['triton']}.",
             f"Command: `{meta['command']}`. TB/s of K+V read; CUDA-graph median, timed twice; "
             f"eager median beside it; error vs float32 reference.", "",
             "| ctx | impl | TB/s (1st / 2nd timing) | TB/s eager | ms | rel err |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['ctx']} | {r['impl']} | — | — | — | {r['error'][:80]} |")
            continue
        best = r["graph_ms"] or r["eager_ms"]
        lines.append(f"| {r['ctx']} | {r['impl']} | {r['tb_s']:.2f} / {r['tb_s_again']:.2f} "
                     f"| {r['tb_s_eager']:.2f} | {best:.3f} | {r['rel_err']:.1e} |")
    (out_dir / f"{stem}-{date}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    checks = check()
    (out / "decode-checks.json").write_text(json.dumps(checks, indent=1))
    run(out)
    if os.environ.get("DECODE_SWEEP") == "1":
        budget = float(os.environ.get("DECODE_SWEEP_S", "60"))
        swept = []
        for ctx in CONTEXTS:
            swept += sweep(budget / len(CONTEXTS), ctx=ctx, splits_list=(2, 4, 8, 1))
        (out / "decode-sweep.json").write_text(json.dumps(swept, indent=1))
    print("checks:", "all ok" if all(c["ok"] for c in checks) else
          [c["check"] for c in checks if not c["ok"]])
