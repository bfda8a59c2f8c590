"""What bounds the packed-sequence ratio on the GPU, from a model of its block dispatch (CPU).

``bench/varlen.py`` compares the packed call with SDPA on the zero-padded batch. This script
counts, for the same sequence lengths: how much more work the padded batch holds than the real
scores (the ratio the packed call reaches if it runs as fast per FLOP as cuDNN does on dense rows),
the extra the packed call computes on each sequence's partial last tile, and what the order of the
packed call's tiles costs at the end of the launch.

The dispatch model: 132 SMs (H100 / H200), one program each, a free SM taking the next program;
a tile of 128 query rows costs one step per 128-key block it reads (up to the diagonal when
causal) plus one for its load and store; a program past its sequence's end costs 0.03. Orders
beside each other: program order as the packed call launches today (row blocks fastest, then
heads, then sequences); longest tile first; and a persistent call whose 132 programs take the live
tiles in a deal fixed at launch, either round-robin in program order or sorted longest first and
dealt in a snake (program 0 to 131, then 131 back to 0, ...: what a launch can build on the GPU
from ``cu_seqlens`` with one sort, without a run-time counter). Figures are makespan ÷ (total
work / SMs)::

    python bench/varlen_schedule.py [--out DIR]
"""

from __future__ import annotations

import heapq
import math

import harness

SMS, HEADS, TILE_M, BLOCK_N, TILE_EXTRA, DEAD = 132, 16, 128, 128, 1.0, 0.03


def tile_cost(n: int, m: int, causal: bool) -> float:
    """Steps of row block ``m`` of a sequence of ``n`` tokens (``DEAD`` past its end)."""
    if m * TILE_M >= n:
        return DEAD
    keys = min(n, (m + 1) * TILE_M) if causal else n
    return math.ceil(keys / BLOCK_N) + TILE_EXTRA


def makespan(costs: list) -> float:
    """When the last SM finishes, programs taken in the given order by whichever SM is free."""
    free = [0.0] * SMS
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def round_robin(costs: list) -> float:
    """When the last of SMS persistent programs finishes, the tiles dealt out in turn."""
    loads = [0.0] * SMS
    for i, c in enumerate(costs):
        loads[i % SMS] += c
    return max(loads)


def snake(costs: list) -> float:
    """When the last of SMS persistent programs finishes, the tiles dealt out in a snake: round r
    goes from program 0 up when r is even, from the last program down when it is odd."""
    loads = [0.0] * SMS
    for i, c in enumerate(costs):
        r, k = divmod(i, SMS)
        loads[k if r % 2 == 0 else SMS - 1 - k] += c
    return max(loads)


def row(lens: list, causal: bool) -> dict:
    """One table row: the order figures for ``lens`` (see the module docstring)."""
    n_m = math.ceil(max(lens) / TILE_M)
    launched = [tile_cost(n, m, causal) for n in lens for _ in range(HEADS) for m in range(n_m)]
    live = [c for c in launched if c > DEAD]
    balanced = sum(launched) / SMS
    return dict(causal=causal, program_order=makespan(launched) / balanced,
                longest_first=makespan(sorted(launched, reverse=True)) / balanced,
                persistent_round_robin=round_robin(live) / balanced,
                persistent_sorted_snake=snake(sorted(live, reverse=True)) / balanced)


def main() -> None:
    args = harness.arguments(__doc__).parse_args()
    lens = harness.packed_lengths()
    real = sum(n * n for n in lens)
    padded = len(lens) * max(lens) ** 2
    computed = sum(math.ceil(n / TILE_M) * TILE_M * n for n in lens)
    rows = [row(lens, causal) for causal in (False, True)]
    path = harness.write_results(
        "varlen_schedule", rows, title="Packed sequences: a model of the block dispatch (head_dim 128 tiles)",
        columns=dict(causal="causal", program_order="program order", longest_first="longest tile first",
                     persistent_round_robin="persistent, round-robin",
                     persistent_sorted_snake="persistent, longest first, snake"),
        out_dir=args.out, commit=args.commit,
        notes=[f"Lengths of bench/varlen.py (harness.packed_lengths): {lens}, {HEADS} heads. Padded work ÷ real work: "
               f"{padded / real:.3f}; work the packed call computes ÷ real (partial last tiles): {computed / real:.3f}.",
               "Makespan ÷ (total work / 132 SMs): 1.000 is perfect balance."],
        extra=dict(lengths=lens, padded_over_real=padded / real, computed_over_real=computed / real))
    print(path.read_text())


if __name__ == "__main__":
    main()
