"""The GPU's clock and power while one forward runs back to back in long turns: ours beside SDPA
cuDNN on every row of the attention table (``bench/attention.py``'s twelve: head_dim 128 at 1k,
4k and 16k keys, 256 at 4k, 64 with GQA 32/8 at 2k and with 16 heads at 4k; causal and not).

Why: the table's short timings catch the clock wherever it is. Both kernels run the GPU at its
power limit, where the clock it keeps depends on what the kernel draws: a long burst of a kernel
that draws more per FLOP holds a lower clock, so a short timing can rank two kernels the other
way round from a training step, which runs them back to back for seconds. This times each
contender in such turns and records the clock and power it ran at.

Each contender takes turns (``--rounds`` rounds, balanced order, after 2 s of matrix products):
a turn runs the forward back to back for ``--burst`` seconds, timed by CUDA events in five equal
chunks, while ``nvidia-smi`` samples the SM clock, power draw, temperature and active clock-event
reasons every 50 ms. A turn's row: TFLOP/s over the turn and in its first and last chunk, the
median clock and power of the samples taken during it, the hottest sample, and every clock-event
reason seen (``sw_power_cap``: the power limit lowered the clocks).

    python bench/power_probe.py [--out DIR] [--burst S] [--rounds N]     # on a GPU, ~2.5 min
    python bench/power_probe.py --rows 64/16/16/4096/causal,64/32/8/16384/causal --triton

``--rows`` picks other rows (head_dim/query heads/kv heads/keys/causal|full); ``--triton`` adds
the package's Triton forward called directly ('ours Triton', its shipped tile), beside the
package's own call, which may take the Gluon forward; ``--gluon`` the Gluon forward called
directly; ``--pairs`` (GQA rows) the Triton forward with two query heads a program (128 rows, 8
warps: ``bench/fwd_head_pairs.py``), which reads each K/V block from L2 half as often;
``--tile BM,BN,W,S`` the Triton forward with that tile and one head a program.
"""

from __future__ import annotations

import importlib
import statistics
import subprocess
import threading
import time
from typing import Optional

import harness

TOKENS = 16384  # a batch, as bench/attention.py's
# (d, query heads, kv heads, keys, causal): the attention table's rows
ROWS = tuple((d, hq, hk, keys, causal) for d, hq, hk, keys in
             ((128, 16, 16, 1024), (128, 16, 16, 4096), (128, 16, 16, 16384), (256, 16, 16, 4096),
              (64, 32, 8, 2048), (64, 16, 16, 4096)) for causal in (False, True))
QUERY = "clocks.sm,power.draw,temperature.gpu"
# nvidia-smi's bit names for the active clock-event reasons (`nvidia-smi --help-query-gpu`)
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
           0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
           0x100: "display_clocks"}


def parse_sample(line: str) -> Optional[dict]:
    """One ``nvidia-smi --format=csv,noheader,nounits`` line of ``QUERY`` plus the reasons field:
    ``{"clock_mhz", "power_w", "temp_c", "reasons"}`` (a value nvidia-smi reports as ``[N/A]`` is
    None); None for a line that is not such a sample. Raises nothing."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None

    def number(text: str) -> Optional[float]:
        try:
            return float(text)
        except ValueError:
            return None
    clock, power, temp = (number(p) for p in parts[:3])
    try:
        reasons: Optional[int] = int(parts[3], 16)
    except ValueError:
        reasons = None
    if clock is None and power is None:
        return None
    return {"clock_mhz": clock, "power_w": power, "temp_c": temp, "reasons": reasons}


def reason_names(mask: int) -> str:
    """The reasons set in ``mask``, by nvidia-smi's names, joined by ``+``; ``none`` when none."""
    names = [name for bit, name in REASONS.items() if mask & bit]
    return "+".join(names) if names else "none"


def summarise(samples: list, start: float, end: float) -> dict:
    """The samples ``(time, parsed)`` taken within ``[start, end]``: their count, median clock
    and power, hottest temperature, and the union of their reasons. Raises nothing."""
    inside = [s for t, s in samples if start <= t <= end]
    out: dict = {"samples": len(inside)}
    for key, field in (("clock_mhz", "clock_mhz"), ("power_w", "power_w")):
        values = [s[field] for s in inside if s[field] is not None]
        out[key] = statistics.median(values) if values else None
    temps = [s["temp_c"] for s in inside if s["temp_c"] is not None]
    out["temp_max_c"] = max(temps) if temps else None
    mask = 0
    for s in inside:
        mask |= s["reasons"] or 0
    out["reasons"] = reason_names(mask)
    return out


class Sampler:
    """``nvidia-smi`` sampling one GPU every ``period_ms`` in a child process, its lines stamped
    with this process's monotonic clock as they arrive. Raises RuntimeError from :meth:`start`
    when nvidia-smi is missing or answers neither name of the reasons field."""

    def __init__(self, gpu: int, period_ms: int = 50) -> None:
        self.gpu, self.period_ms = gpu, period_ms
        self.samples: list = []
        self._proc: Optional[subprocess.Popen] = None
        self._reader: Optional[threading.Thread] = None

    def start(self) -> None:
        # drivers from 535 call the field clocks_event_reasons; older ones only clocks_throttle_reasons
        for field in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
            query = [f"--query-gpu={QUERY},{field}", "--format=csv,noheader,nounits", f"--id={self.gpu}"]
            try:
                once = subprocess.run(["nvidia-smi", *query], capture_output=True, text=True, timeout=30)
            except FileNotFoundError as e:
                raise RuntimeError("nvidia-smi is not on PATH: the probe reads clocks and power through it") from e
            if once.returncode == 0 and parse_sample(once.stdout.strip()) is not None:
                break
        else:
            raise RuntimeError(f"nvidia-smi answered neither reasons field: {once.stdout} {once.stderr}")
        self._proc = subprocess.Popen(["nvidia-smi", *query, f"--loop-ms={self.period_ms}"],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append((time.monotonic(), sample))

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()  # our own child, by its PID
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=10)


def parse_rows(text: str) -> list[tuple]:
    """``--rows``: ``d/hq/hk/keys/causal|full`` items, comma-separated, as ROWS' tuples. Raises
    ValueError for an item of another shape."""
    rows = []
    for item in text.split(","):
        parts = item.strip().split("/")
        if len(parts) != 5 or parts[4] not in ("causal", "full"):
            raise ValueError(f"--rows item {item!r}: expected head_dim/query heads/kv heads/keys/causal|full, "
                             "e.g. 64/32/8/2048/causal")
        rows.append(tuple(int(x) for x in parts[:4]) + (parts[4] == "causal",))
    return rows


def summary(rows: list[dict], baseline: str = "cuDNN") -> list[dict]:
    """Per probed row and contender: the median TFLOP/s, SM clock and power over its turns, and
    the TFLOP/s ÷ ``baseline``'s median on the same row. Raises nothing."""
    out = []
    shapes = dict.fromkeys((r["head_dim"], r["heads"], r["seq"], r["causal"]) for r in rows)
    for shape in shapes:
        mine = [r for r in rows if (r["head_dim"], r["heads"], r["seq"], r["causal"]) == shape]
        base = [r["tflops"] for r in mine if r["contender"] == baseline]
        for name in dict.fromkeys(r["contender"] for r in mine):
            turns = [r for r in mine if r["contender"] == name]
            tflops = statistics.median(r["tflops"] for r in turns)
            clocks = [r["clock_mhz"] for r in turns if r.get("clock_mhz") is not None]
            power = [r["power_w"] for r in turns if r.get("power_w") is not None]
            out.append(dict(zip(("head_dim", "heads", "seq", "causal"), shape), contender=name, tflops=tflops,
                            vs_baseline=tflops / statistics.median(base) if base else None,
                            clock_mhz=statistics.median(clocks) if clocks else None,
                            power_w=statistics.median(power) if power else None))
    return out


def turn(fn, calls: int, chunks: int = 5) -> tuple[list, float, float]:
    """Run ``fn`` ``calls`` times in ``chunks`` equal chunks, each timed by CUDA events: (µs per
    call of each chunk, host monotonic start, end after the last chunk finished)."""
    import torch

    per = max(1, calls // chunks)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(chunks + 1)]
    torch.cuda.synchronize()
    start = time.monotonic()
    events[0].record()
    for c in range(chunks):
        for _ in range(per):
            fn()
        events[c + 1].record()
    events[-1].synchronize()
    end = time.monotonic()
    return [events[c].elapsed_time(events[c + 1]) * 1000.0 / per for c in range(chunks)], start, end


def main() -> None:
    args_parser = harness.arguments(__doc__)
    args_parser.add_argument("--burst", type=float, default=1.0, help="seconds a turn runs (default 1.0)")
    args_parser.add_argument("--rounds", type=int, default=4)
    args_parser.add_argument("--rows", help="d/hq/hk/keys/causal|full, comma-separated (default: the table's)")
    args_parser.add_argument("--triton", action="store_true", help="the Triton forward called directly as well")
    args_parser.add_argument("--gluon", action="store_true", help="the Gluon forward called directly as well")
    args_parser.add_argument("--pairs", action="store_true", help="two query heads a Triton program (GQA rows)")
    args_parser.add_argument("--tile", help="BLOCK_M,BLOCK_N,warps,stages: the Triton forward with this tile too")
    args = args_parser.parse_args()
    rows_wanted = ROWS if not args.rows else parse_rows(args.rows)
    import torch
    from torch.nn.attention import SDPBackend

    fa = harness.shipped_kernel()
    triton_fwd = importlib.import_module(fa.__name__ + "._triton_fwd")
    gluon_fwd = importlib.import_module(fa.__name__ + "._gluon_fwd")
    sampler = Sampler(torch.cuda.current_device())
    sampler.start()
    rows = []
    try:
        harness.warm_gpu()
        for d, heads, heads_k, seq, causal in rows_wanted:
            b = TOKENS // seq
            q = torch.randn(b, seq, heads, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, seq, heads_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            contenders = {"ours": lambda: fa.flash_attn_func(q, k, v, causal=causal),
                          "cuDNN": harness.sdpa(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, causal)}
            if args.triton:
                contenders["ours Triton"] = lambda: triton_fwd.attention_forward(q, k, v, softmax_scale=d ** -0.5,
                                                                                 causal=causal)
            if args.gluon:
                contenders["ours Gluon"] = lambda: gluon_fwd.gluon_attention_forward(q, k, v, softmax_scale=d ** -0.5,
                                                                                    causal=causal)
            if args.tile:
                tile = tuple(int(x) for x in args.tile.split(","))
                contenders[f"ours Triton {args.tile}"] = lambda tile=tile: triton_fwd.attention_forward(
                    q, k, v, softmax_scale=d ** -0.5, causal=causal, heads_per_program=1, config=tile)
            if args.pairs and heads != heads_k:
                contenders["ours Triton 2 heads"] = lambda: triton_fwd.attention_forward(
                    q, k, v, softmax_scale=d ** -0.5, causal=causal, heads_per_program=2, config=(128, 64, 8, 3))
            flop = 4.0 * b * heads * seq * seq * d / (2 if causal else 1)
            calls = {}
            for name, fn in contenders.items():
                us = harness.time_us(fn, rep_ms=50)
                calls[name] = max(5, int(args.burst * 1e6 / us))
            for r in range(args.rounds):
                for name in harness.round_order(list(contenders), r):
                    chunks, start, end = turn(contenders[name], calls[name])
                    whole = statistics.fmean(chunks)
                    rows.append({"head_dim": d, "heads": f"{heads}/{heads_k}", "seq": seq, "causal": causal, "round": r, "contender": name,
                                 "tflops": flop / whole / 1e6, "first_tflops": flop / chunks[0] / 1e6,
                                 "last_tflops": flop / chunks[-1] / 1e6, "seconds": end - start,
                                 **summarise(sampler.samples, start, end)})
                    print(rows[-1], flush=True)
    finally:
        sampler.stop()
    harness.write_results(
        "power_probe", rows,
        title="Clock and power during back-to-back forwards, ours beside SDPA cuDNN (bf16, 16k tokens a batch)",
        columns=dict(head_dim="d", heads="heads", seq="seq", causal="causal", round="round", contender="contender",
                     tflops="TFLOP/s", first_tflops="first fifth TFLOP/s", last_tflops="last fifth TFLOP/s",
                     clock_mhz="SM MHz (median)", power_w="power W (median)", temp_max_c="hottest °C",
                     reasons="clock-event reasons seen", samples="samples", seconds="s"),
        out_dir=args.out, commit=args.commit,
        notes=[harness.table(summary(rows), dict(head_dim="d", heads="heads", seq="seq", causal="causal",
                                                 contender="contender", tflops="TFLOP/s (median)",
                                                 vs_baseline="÷ cuDNN", clock_mhz="SM MHz (median)",
                                                 power_w="power W (median)")),
               "",
               f"Turns of {args.burst} s, {args.rounds} rounds in balanced order after 2 s of matrix products; "
               "nvidia-smi sampled every 50 ms (see the script's docstring)."])


if __name__ == "__main__":
    main()
