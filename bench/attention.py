"""Attention benchmark: the shipped flash-attn2 kernel beside PyTorch SDPA and FlexAttention.

bf16, 16 heads, head dims 64/128/256, sequence 1k/4k/16k at 16k tokens per batch, causal and
not, forward and forward+backward, in TFLOP/s (forward = 4·B·H·S²·D, halved when causal;
forward+backward = 3.5 × forward), median of ``triton.testing.do_bench``. Each provider gets its
native layout: ours ``[B, S, H, D]``, SDPA/Flex ``[B, H, S, D]``. Plus varlen (random lengths
packed, vs SDPA on the zero-padded batch, FLOPs counted on real tokens) and the first-call
latency of our kernel (compile included) per row. Every row also records the relative
difference between our output and SDPA flash's.

    PYTHONPATH=. python3 bench/attention.py [out_dir]     # on a GPU; bench/check_gpu.py calls run()
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = (REPO_ROOT / "kernel_repos" / "kernels-community" / "flash-attn2" / "build"
               / "torch-universal" / "flash_attn2")
TOKENS, HEADS = 16384, 16
HEAD_DIMS = (64, 128, 256)
SEQS = (1024, 4096, 16384)
SDPA_BACKENDS = ("flash", "cudnn", "efficient")


def load_package(package_dir: Path = PACKAGE_DIR, name: str = "_bench_attention_flash_attn2"):
    """The flash_attn2 package in ``package_dir`` (the shipped one by default), imported by path
    under the private module name ``name`` (once per name)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(package_dir) / "__init__.py",
                                                  submodule_search_locations=[str(package_dir)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg
    spec.loader.exec_module(pkg)
    return pkg


def forward_module():
    """The shipped package's Triton forward module (``_triton_fwd``), for benchmarks of its options."""
    return importlib.import_module(load_package().__name__ + "._triton_fwd")


def fwd_flops(batch: int, heads: int, seq_q: int, seq_k: int, dim: int, causal: bool) -> float:
    f = 4.0 * batch * heads * seq_q * seq_k * dim
    return f / 2 if causal else f


def bench_ms(fn: Callable[[], object]) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def interleaved_us(contenders: Dict[str, Callable[[], object]], rounds: int = 11,
                   calls: int = 10) -> Dict[str, List[float]]:
    """Microseconds per call of each contender (CUDA events over ``calls`` launches), timed in
    ``rounds`` rounds that each time every contender once, starting at a rotating position, so
    clock drift and heat spread over all of them. Returns the samples; report their median."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    names = list(contenders)
    samples: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = contenders[name]
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) * 1000.0 / calls)
    return samples


def reference_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                   window_left: int = -1) -> torch.Tensor:
    """fp64 attention on ``[B, S, H, D]`` tensors (GQA: K/V heads repeated; masks top-left
    aligned, equal lengths), returned in the same layout."""
    s = q.shape[1]
    g = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2).double() for t in (q, k, v))
    kt, vt = kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1)
    i = torch.arange(s, device=q.device)
    allowed = torch.ones(s, s, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= i[None, :] <= i[:, None]
    if window_left >= 0:
        allowed &= i[None, :] >= i[:, None] - window_left
    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed).transpose(1, 2)


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]


def raise_recompile_limit(limit: int) -> None:
    """Let dynamo keep ``limit`` compiled graphs per function.

    Flex compiles one graph per shape and grad mode. The default limit (8) is hit within the
    table, after which torch silently runs an unfused flex_attention about 30x slower.
    """
    import torch._dynamo

    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, limit)


def providers(causal: bool, with_flex: bool, names=None) -> Dict[str, Callable]:
    """name -> fn(q, k, v) on that provider's layout; q/k/v built by ``inputs_for``."""
    fa = load_package()
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    out: Dict[str, Callable] = {"ours": lambda q, k, v: fa.flash_attn_func(q, k, v, causal=causal)}
    for name in SDPA_BACKENDS:
        def run(q, k, v, _b=_sdpa_backend(name)):
            with sdpa_kernel(_b):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out[f"sdpa-{name}"] = run
    if with_flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        raise_recompile_limit(64)

        compiled = torch.compile(flex_attention, dynamic=False)
        masks: Dict[tuple, object] = {}

        def flex(q, k, v):
            mask = None
            if causal:
                key = (q.shape[-2], k.shape[-2])
                if key not in masks:
                    masks[key] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None,
                                                   q.shape[-2], k.shape[-2], device=q.device)
                mask = masks[key]
            return compiled(q, k, v, block_mask=mask)
        out["flex"] = flex
    if names is not None:
        out = {k: v for k, v in out.items() if k in names}
    return out


def inputs_for(provider: str, batch: int, seq: int, dim: int, grad: bool, dtype=torch.bfloat16):
    shape = (batch, seq, HEADS, dim) if provider == "ours" else (batch, HEADS, seq, dim)
    ts = [torch.randn(shape, device="cuda", dtype=dtype, requires_grad=grad) for _ in range(3)]
    return ts


def _to_ours_layout(t: torch.Tensor, provider: str) -> torch.Tensor:
    return t if provider == "ours" else t.transpose(1, 2)


def measure(provider: str, fn: Callable, batch: int, seq: int, dim: int, causal: bool) -> dict:
    """Forward and forward+backward timings (and first-call seconds) of one provider."""
    row: dict = {"provider": provider}
    torch.manual_seed(0)
    q, k, v = inputs_for(provider, batch, seq, dim, grad=True)
    do = torch.randn_like(q)
    flops = fwd_flops(batch, HEADS, seq, seq, dim, causal)
    try:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = fn(q, k, v)
        torch.cuda.synchronize()
        row["first_fwd_s"] = time.perf_counter() - t0
        row["out"] = _to_ours_layout(out, provider).detach()
        with torch.no_grad():
            ms = bench_ms(lambda: fn(q, k, v))
        row["fwd_ms"], row["fwd_tflops"] = ms, flops / ms / 1e9
    except Exception as e:  # a backend that does not take this shape: record why and go on
        row["fwd_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    try:
        def step():
            o = fn(q, k, v)
            return torch.autograd.grad(o, (q, k, v), do)
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        row["first_fwdbwd_s"] = time.perf_counter() - t0
        ms = bench_ms(step)
        row["fwdbwd_ms"], row["fwdbwd_tflops"] = ms, 3.5 * flops / ms / 1e9
    except Exception as e:
        row["fwdbwd_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return row


def dense_rows(dims=HEAD_DIMS, seqs=SEQS, with_flex: bool = True, deadline: Optional[float] = None,
               flex_deadline: Optional[float] = None, hard_deadline: Optional[float] = None,
               names=None, flex_dims=HEAD_DIMS, log=print) -> List[dict]:
    """One row per (head dim, seq, causal). Past ``deadline`` only our kernel is timed, past
    ``flex_deadline`` FlexAttention (slow to compile) is left out, past ``hard_deadline`` nothing."""
    rows = []
    for dim in dims:
        for seq in seqs:
            for causal in (False, True):
                if hard_deadline is not None and time.time() > hard_deadline:
                    log(f"skipped d={dim} seq={seq} causal={causal}: time budget")
                    continue
                batch = TOKENS // seq
                use_flex = (with_flex and dim in flex_dims
                            and (flex_deadline is None or time.time() < flex_deadline))
                result = {"dim": dim, "seq": seq, "causal": causal, "batch": batch, "heads": HEADS}
                for name, fn in providers(causal, use_flex, names).items():
                    if deadline is not None and time.time() > deadline and name != "ours":
                        result[name] = {"skipped": "time budget"}
                        continue
                    result[name] = measure(name, fn, batch, seq, dim, causal)
                ref = result.get("sdpa-flash", {}).get("out")
                ours = result["ours"].get("out")
                if ref is not None and ours is not None:
                    result["ours_vs_flash_rel"] = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
                for p in result.values():
                    if isinstance(p, dict):
                        p.pop("out", None)
                rows.append(result)
                log(format_row(result))
                torch.cuda.empty_cache()
    return rows


def varlen_rows(dim: int = 128, log=print) -> List[dict]:
    """Random lengths packed to ~16k tokens vs SDPA over the zero-padded batch."""
    fa = load_package()
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    lens: List[int] = []
    while sum(lens) < TOKENS:
        lens.append(int(torch.randint(128, 4097, (1,), generator=gen)))
    lens[-1] -= sum(lens) - TOKENS
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    max_len = max(lens)
    rows = []
    for causal in (False, True):
        flops = sum(fwd_flops(1, HEADS, n, n, dim, causal) for n in lens)
        q, k, v = (torch.randn(TOKENS, HEADS, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        result = {"dim": dim, "seq": f"varlen {len(lens)} seqs, max {max_len}", "causal": causal,
                  "batch": len(lens), "heads": HEADS, "lengths": lens}

        def ours():
            return fa.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=causal)

        row = {"provider": "ours"}
        t0 = time.perf_counter()
        with torch.no_grad():
            ours()
        torch.cuda.synchronize()
        row["first_fwd_s"] = time.perf_counter() - t0
        with torch.no_grad():
            ms = bench_ms(ours)
        row["fwd_ms"], row["fwd_tflops"] = ms, flops / ms / 1e9
        ms = bench_ms(lambda: torch.autograd.grad(ours(), (q, k, v), do))
        row["fwdbwd_ms"], row["fwdbwd_tflops"] = ms, 3.5 * flops / ms / 1e9
        result["ours"] = row
        # SDPA has no varlen: the padded batch [n, H, max_len, D] is what it must be given.
        pq, pk, pv = (torch.zeros(len(lens), HEADS, max_len, dim, device="cuda", dtype=torch.bfloat16,
                                  requires_grad=True) for _ in range(3))
        pdo = torch.randn_like(pq)
        for name in ("flash", "cudnn"):
            r = {"provider": f"sdpa-{name}"}
            try:
                def sd(_b=_sdpa_backend(name)):
                    with sdpa_kernel(_b):
                        return F.scaled_dot_product_attention(pq, pk, pv, is_causal=causal)
                with torch.no_grad():
                    ms = bench_ms(sd)
                r["fwd_ms"], r["fwd_tflops"] = ms, flops / ms / 1e9
                ms = bench_ms(lambda: torch.autograd.grad(sd(), (pq, pk, pv), pdo))
                r["fwdbwd_ms"], r["fwdbwd_tflops"] = ms, 3.5 * flops / ms / 1e9
            except Exception as e:
                r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            result[f"sdpa-{name}"] = r
        rows.append(result)
        log(format_row(result))
    return rows


COLUMNS = ("ours", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex")


def _cell(p: Optional[dict]) -> str:
    if not p or "skipped" in p:
        return "—"
    f = f"{p['fwd_tflops']:.0f}" if "fwd_tflops" in p else "err"
    b = f"{p['fwdbwd_tflops']:.0f}" if "fwdbwd_tflops" in p else "err"
    return f"{f} / {b}"


def format_row(r: dict, show_first: bool = True) -> str:
    cells = " | ".join(_cell(r.get(c)) for c in COLUMNS)
    ours, fl = r.get("ours", {}), r.get("sdpa-flash", {})
    ratio = "—"
    if "fwd_tflops" in ours and "fwd_tflops" in fl:
        rb = (f"{ours['fwdbwd_tflops'] / fl['fwdbwd_tflops']:.2f}"
              if "fwdbwd_tflops" in ours and "fwdbwd_tflops" in fl else "—")
        ratio = f"{ours['fwd_tflops'] / fl['fwd_tflops']:.2f} / {rb}"
    first = ours.get("first_fwd_s")
    first_s = f"{first:.1f} / {ours.get('first_fwdbwd_s', float('nan')):.1f}" if first is not None else "—"
    causal = "yes" if r["causal"] else "no"
    line = f"| {r['dim']} | {r['seq']} | {causal} | {cells} | {ratio} |"
    return line + f" {first_s} |" if show_first else line


def table_md(rows: List[dict], show_first: bool = False) -> str:
    """Markdown table; ``show_first`` adds our first-call seconds (meaningful only on a cold cache)."""
    head = ("| d | seq | causal | ours fwd / fwd+bwd | SDPA flash (FA2) | SDPA cuDNN | SDPA efficient | "
            "FlexAttention | ours ÷ FA2 fwd / fwd+bwd |" + (" ours first call s (fwd / fwd+bwd) |" if show_first else "")
            + "\n|---|---|---|---|---|---|---|---|---|" + ("---|" if show_first else ""))
    return head + "\n" + "\n".join(format_row(r, show_first) for r in rows)


def run(dims=HEAD_DIMS, seqs=SEQS, names=None, with_flex: bool = True, with_varlen: bool = True,
        deadline: Optional[float] = None, flex_deadline: Optional[float] = None,
        hard_deadline: Optional[float] = None, flex_dims=HEAD_DIMS, log=print) -> List[dict]:
    """Dense rows then varlen; deadlines are absolute ``time.time()`` values (see dense_rows)."""
    rows = dense_rows(dims, seqs, with_flex=with_flex, deadline=deadline, flex_deadline=flex_deadline,
                      hard_deadline=hard_deadline, names=names, flex_dims=flex_dims, log=log)
    if with_varlen and (hard_deadline is None or time.time() < hard_deadline):
        rows += varlen_rows(log=log)
    return rows


if __name__ == "__main__":
    import json

    all_rows = run()
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    (out / "attention.json").write_text(json.dumps(all_rows, indent=1))
    print(table_md(all_rows, show_first=True))
