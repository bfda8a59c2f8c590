"""Experiment: where the short-sequence causal prefill loses to cuDNN (d=64), and two remedies.

    PYTHONPATH=. python3 bench/prefill_persist.py OUT_DIR [--maxnreg]   # GPU: check and time
    python bench/prefill_persist.py --check                   # CPU, TRITON_INTERPRET=1: accuracy

Why: at d=64, GQA 32/8, causal, our forward runs at 1.00-1.01x cuDNN at 8k-16k tokens per
sequence but 0.92-0.96x at 2k and 0.86-0.90x at 1k (bench/results/prefill-order-2026-11-30.md).
The inner loop is as fast as cuDNN's; what grows as sequences shorten is the share of
(a) masked diagonal blocks (2 of 17 key blocks per program on average at 2k, 2 of 9 at 1k) and
(b) per-program start-up: each program loads its q tile and its first K/V blocks before any
math, a latency the other program on the SM only partly covers. The gap pattern fits (b): it
halves with each doubling of the length.

Contenders, interleaved, medians (bf16, q/k/v ``[B, S, H, D]``):
* the shipped kernel with its own config and with other tile configs (more, smaller programs
  per SM hide start-up better);
* a minimal copy of the shipped dense causal path (same loop, heavy-first chunked order) as
  the control, and as a persistent kernel (a grid of k programs per SM walking the same tile
  order), with and without loading the next tile's q before the current epilogue;
* a timing-only variant computing the diagonal blocks without a mask (wrong output) to size (a).
Writes OUT_DIR/prefill-persist.json.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path
from statistics import median_high

if "--check" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import attention as A  # noqa: E402
from prefill_exp2 import _step  # noqa: E402  (the control step of that experiment: plain exp2)


@triton.jit
def _tile_of(t, hpc, row_blocks):
    """Tile index in heavy-first order -> (row block, batch row * head)."""
    per_chunk = hpc * row_blocks
    r = t % per_chunk
    return row_blocks - 1 - r // hpc, (t // per_chunk) * hpc + r % hpc


@triton.jit
def _load_q(Q, pid_m, pid_bh, n_heads, stride_qb, stride_qm, stride_qh,
            BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    return tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :])


@triton.jit
def _tile(q, pid_m, pid_bh, K, V, O, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
          stride_ob, stride_om, stride_oh, n_heads, group, qk_scale,
          FAKE_DIAG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    b = (pid_bh // n_heads).to(tl.int64)
    h = pid_bh % n_heads
    hk = (h // group).to(tl.int64)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    fhi = (m0 // BLOCK_N) * BLOCK_N  # seqlen_q == seqlen_k, a multiple of BLOCK_M: diag = 0
    for n0 in range(0, fhi, BLOCK_N):
        acc, l_i, m_i = _step(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, n0, 0,
                              qk_scale, False, 0, BLOCK_M, BLOCK_N, HEAD_DIM)
    for n0 in range(fhi, m0 + BLOCK_M, BLOCK_N):
        acc, l_i, m_i = _step(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, n0, 0,
                              qk_scale, not FAKE_DIAG, 0, BLOCK_M, BLOCK_N, HEAD_DIM)
    out = acc / l_i[:, None]
    tl.store(O + b * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
             out.to(O.dtype.element_ty))


@triton.jit
def _fwd(Q, K, V, O, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
         stride_vb, stride_vn, stride_vh, stride_ob, stride_om, stride_oh,
         n_heads, group, qk_scale, n_tiles, hpc, row_blocks,
         PERSISTENT: tl.constexpr, PREFETCH: tl.constexpr, FAKE_DIAG: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    if not PERSISTENT:
        # the shipped heavy-first grid: (heads in a chunk, row blocks, chunks)
        pid_bh = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
        q = _load_q(Q, pid_m, pid_bh, n_heads, stride_qb, stride_qm, stride_qh, BLOCK_M, HEAD_DIM)
        _tile(q, pid_m, pid_bh, K, V, O, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
              stride_ob, stride_om, stride_oh, n_heads, group, qk_scale, FAKE_DIAG, BLOCK_M, BLOCK_N, HEAD_DIM)
    elif not PREFETCH:
        for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
            pid_m, pid_bh = _tile_of(t, hpc, row_blocks)
            q = _load_q(Q, pid_m, pid_bh, n_heads, stride_qb, stride_qm, stride_qh, BLOCK_M, HEAD_DIM)
            _tile(q, pid_m, pid_bh, K, V, O, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                  stride_ob, stride_om, stride_oh, n_heads, group, qk_scale, FAKE_DIAG, BLOCK_M, BLOCK_N, HEAD_DIM)
    else:
        # q of the next tile is loaded before this tile's math, so its latency is hidden
        nprog = tl.num_programs(0)
        pid_m, pid_bh = _tile_of(tl.program_id(0), hpc, row_blocks)
        q = _load_q(Q, pid_m, pid_bh, n_heads, stride_qb, stride_qm, stride_qh, BLOCK_M, HEAD_DIM)
        for t in range(tl.program_id(0), n_tiles, nprog):
            pid_m, pid_bh = _tile_of(t, hpc, row_blocks)
            nm, nbh = _tile_of(tl.minimum(t + nprog, n_tiles - 1), hpc, row_blocks)
            q_next = _load_q(Q, nm, nbh, n_heads, stride_qb, stride_qm, stride_qh, BLOCK_M, HEAD_DIM)
            _tile(q, pid_m, pid_bh, K, V, O, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                  stride_ob, stride_om, stride_oh, n_heads, group, qk_scale, FAKE_DIAG, BLOCK_M, BLOCK_N, HEAD_DIM)
            q = q_next


def forward(q, k, v, cfg=(128, 64, 8, 3), persistent=0, prefetch=False, fake_diag=False, hpc=None,
            maxnreg=None):
    """q [B, S, Hq, D], k/v [B, S, Hk, D]; S a multiple of BLOCK_M, causal.

    persistent: 0 = one program per tile; k > 0 = k programs per SM walking the tiles.
    maxnreg: a register cap per thread (the persistent forms otherwise take 166-204 registers,
    which leaves one 8-warp program per SM).
    """
    bm, bn, warps, stages = cfg
    b, s, hq, d = q.shape
    hk = k.shape[2]
    # on the CPU check, NaN marks any row a variant forgot to write
    o = torch.empty_like(q) if q.is_cuda else torch.full_like(q, float("nan"))
    programs_bh = b * hq
    if hpc is None:
        fwd = A.forward_module()
        hpc = fwd._heads_per_chunk(programs_bh, hq // hk, s * d * 2 * q.element_size(), fwd.L2_BUDGET_BYTES)
    row_blocks = s // bm
    n_tiles = row_blocks * programs_bh
    if persistent:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 2
        grid = (min(n_tiles, persistent * sms),)
    else:
        grid = (hpc, row_blocks, programs_bh // hpc)
    return _fwd[grid](q, k, v, o, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
                      hq, hq // hk, d ** -0.5 * 1.4426950408889634, n_tiles, hpc, row_blocks,
                      PERSISTENT=bool(persistent), PREFETCH=prefetch, FAKE_DIAG=fake_diag,
                      BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d, num_warps=warps, num_stages=stages,
                      **({"maxnreg": maxnreg} if maxnreg else {})), o


def check_cpu() -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 64, 4, 32) * 2
    k, v = (torch.randn(2, 64, 2, 32) for _ in range(2))
    ref = A.reference_bshd(q, k, v)
    for persistent, prefetch, hpc in ((0, False, 4), (0, False, 8), (1, False, 4), (1, True, 4), (3, True, 2)):
        _, out = forward(q, k, v, (16, 16, 4, 1), persistent, prefetch, hpc=hpc)
        err = float((out.double() - ref).abs().max())
        print(f"persistent={persistent} prefetch={prefetch} hpc={hpc}: max|out - fp64| = {err:.2e}")
        assert err < 2e-3, err


SHAPES = [(8, 2048), (16, 1024), (2, 8192)]
CONFIGS = [(64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 2), (128, 64, 4, 3), (64, 128, 4, 3),
           (128, 32, 8, 3), (64, 32, 4, 3), (128, 64, 8, 4)]


def _compiled_info(kernel) -> dict:
    try:
        return {"regs": kernel.n_regs, "spills": kernel.n_spills, "shared": kernel.metadata.shared,
                "warps": kernel.metadata.num_warps}
    except AttributeError:
        return {}


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    fwd = A.forward_module()
    hq, hk, d = 32, 8, 64
    result = {"date": datetime.date.today().isoformat(),
              "command": "PYTHONPATH=. python3 bench/prefill_persist.py $OUT " + " ".join(sys.argv[2:]),
              "commit": os.environ.get("BENCH_COMMIT", "unknown"),
              "environment": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "triton": triton.__version__, "cuda": torch.version.cuda},
              "heads": "32/8", "head_dim": d, "rows": [], "compiled": {}}
    t0 = time.time()
    for b, s in SHAPES:
        torch.manual_seed(0)
        q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        contenders = {
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, enable_gqa=True).transpose(1, 2),
            "shipped": lambda: fwd.attention_forward(q, k, v, softmax_scale=d ** -0.5, causal=True,
                                                     store_lse=False)[0],
        }
        for cfg in ([] if "--maxnreg" in sys.argv else CONFIGS):
            contenders["shipped " + "x".join(map(str, cfg))] = (
                lambda c=cfg: fwd.attention_forward(q, k, v, softmax_scale=d ** -0.5, causal=True,
                                                    store_lse=False, config=c)[0])
        if "--maxnreg" in sys.argv:  # second run: the persistent forms under a register cap
            exp = {"copy 128x64x8x3": dict(cfg=(128, 64, 8, 3)),
                   "persistent2 128x64x8x3 maxnreg128": dict(cfg=(128, 64, 8, 3), persistent=2, maxnreg=128),
                   "persistent2 prefetch 128x64x8x3 maxnreg128": dict(cfg=(128, 64, 8, 3), persistent=2,
                                                                       prefetch=True, maxnreg=128),
                   "copy 64x64x4x3": dict(cfg=(64, 64, 4, 3)),
                   "persistent3 prefetch 64x64x4x3 maxnreg168": dict(cfg=(64, 64, 4, 3), persistent=3,
                                                                      prefetch=True, maxnreg=168),
                   "persistent3 64x64x4x3 maxnreg168": dict(cfg=(64, 64, 4, 3), persistent=3, maxnreg=168)}
        else:
            exp = {"copy 128x64x8x3": dict(cfg=(128, 64, 8, 3)),
                   "copy 128x64x8x3 unmasked diagonal (timing only)": dict(cfg=(128, 64, 8, 3), fake_diag=True),
                   "persistent1 128x64x8x3": dict(cfg=(128, 64, 8, 3), persistent=1),
                   "persistent2 128x64x8x3": dict(cfg=(128, 64, 8, 3), persistent=2),
                   "persistent1 prefetch 128x64x8x3": dict(cfg=(128, 64, 8, 3), persistent=1, prefetch=True),
                   "persistent2 prefetch 128x64x8x3": dict(cfg=(128, 64, 8, 3), persistent=2, prefetch=True),
                   "copy 64x64x4x3": dict(cfg=(64, 64, 4, 3)),
                   "persistent2 prefetch 64x64x4x3": dict(cfg=(64, 64, 4, 3), persistent=2, prefetch=True),
                   "persistent3 prefetch 64x64x4x3": dict(cfg=(64, 64, 4, 3), persistent=3, prefetch=True),
                   "persistent4 prefetch 64x64x4x3": dict(cfg=(64, 64, 4, 3), persistent=4, prefetch=True)}
        for name, kw in exp.items():
            contenders[name] = (lambda kw=kw: forward(q, k, v, **kw)[1])
        ref = A.reference_bshd(q, k, v).float() if s <= 2048 else None
        errors, names = {}, []
        seen = set(fwd._FWD._cache)
        for name, fn in contenders.items():
            try:
                o = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # a config that does not fit is reported, not fatal
                print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                errors[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
                continue
            names.append(name)
            if ref is not None:
                errors[name] = float((o.float() - ref).abs().max())
            if name in exp and name not in result["compiled"]:
                result["compiled"][name] = _compiled_info(forward(q, k, v, **exp[name])[0])
            for key in set(fwd._FWD._cache) - seen:
                result["compiled"][name] = _compiled_info(fwd._FWD._cache[key][3])
            seen = set(fwd._FWD._cache)
        for name in names:  # warm-up
            contenders[name]()
        torch.cuda.synchronize()
        samples = A.interleaved_us({n: contenders[n] for n in names})
        us = {n: median_high(v) for n, v in samples.items()}
        row = {"batch": b, "seq": s, "us": {n: round(t, 1) for n, t in us.items()},
               "vs_sdpa": {n: round(us["sdpa"] / t, 3) for n, t in us.items()},
               "maxabs_vs_fp64": errors, "samples_us": {n: [round(x, 1) for x in v] for n, v in samples.items()}}
        result["rows"].append(row)
        print(f"[{time.time() - t0:5.1f}s] {b}x{s} GQA 32/8 d=64 causal", flush=True)
        for n in names:
            err = errors.get(n)
            print(f"  {n:52s} {us[n]:8.1f} us  {us['sdpa'] / us[n]:6.3f}x sdpa"
                  + (f"  max|diff| vs fp64 {err:.1e}" if isinstance(err, float) else "")
                  + f"  {result['compiled'].get(n, '')}", flush=True)
        (out_dir / "prefill-persist.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    if "--check" in sys.argv:
        check_cpu()
    else:
        main()
