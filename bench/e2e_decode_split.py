"""Where a transformers decode step's time goes: the attention call's own host time inside a
real ``generate``, for the shipped kernel (through kernel_loader's bridge) and for sdpa, and the
step time with the shipped decode's two choices that trade host time for GPU time.

Why: end to end (``bench/results/e2e_transformers_llama_3_8b.md``) a decode step through the
bridge can come out a few percent slower than sdpa, while the attention call timed alone costs
the host what sdpa's does (``host_overhead.md``, at a one-slice shape). This measures the call
where it runs, in the model, at the Llama-3-8B shape, where the shipped decode splits the keys
into slices and merges them in the same launch.

Rows (interleaved rounds of one greedy ``generate`` each, after a prefill of the prompt):

* ``sdpa`` (PyTorch's choice of backend),
* ``ours`` (``kernels-community/flash-attn2`` through the bridge, the shipped decode),
* ``ours, capture query asked``: the CUDA-graph capture check asked of the driver on every sliced
  call, the default stream too (the shipped call answers it there without asking),
* ``ours, one slice``: every row read whole by one program (``choose_num_splits`` -> 1),
* ``ours, launcher key each call``: every call works the launcher's key out
  (``KEEP_LAUNCHES = False``) instead of repeating the launch the first call of its shape kept,
* ``ours, timed by part``: the shipped decode with a clock on each part of the call
  (``harness.decode_parts``: the call after the entry checks, its allocations, the launcher, Triton's
  C launch function), to set beside the same parts timed alone (``bench/decode_host.py``); the
  clocks add a little host time of their own.

Columns: ms per decode step (median over the steps of a generate, a sync at each step; then the
median over rounds), paired against sdpa per round (sdpa ÷ row, above 1: faster), and the host
µs spent inside the attention function per decode call (no sync inside: the host's own time).

    HF_HUB_OFFLINE=1 PYTHONPATH=. python bench/e2e_decode_split.py            # on a GPU
    HF_HUB_OFFLINE=1 PYTHONPATH=. python bench/e2e_decode_split.py --smoke --out /tmp/x   # tiny, any machine
"""

from __future__ import annotations

import contextlib
import statistics
import sys

import harness

KERNEL = "kernels-community/flash-attn2"
SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
FULL = dict(batch=4, prompt=4096, new_tokens=64, rounds=7, layers=8)
SMOKE = dict(batch=2, prompt=32, new_tokens=4, rounds=2, layers=2)


def _decode_modules() -> list:
    """Every loaded copy of the shipped kernel's decode module (the bridge may load its own)."""
    return [m for name, m in list(sys.modules.items())
            if name.endswith("._triton_decode") and hasattr(m, "MERGE_IN_KERNEL")]


class _Variant:
    """Sets a decode variant on every loaded copy of the decode module, and puts it back;
    ``parts``: the clocks of the 'timed by part' variant while it is set (else None)."""

    def __init__(self) -> None:
        self.saved: list = []
        self.stack = contextlib.ExitStack()
        self.parts: list | None = None

    def set(self, variant: str) -> None:
        self.reset()
        if variant == "timed by part":
            self.parts = [self.stack.enter_context(harness.decode_parts(m)) for m in _decode_modules()]
        for m in _decode_modules():
            self.saved.append((m, m.MERGE_IN_KERNEL, m.choose_num_splits, m.KEEP_LAUNCHES, m._capturing))
            if variant == "capture query asked":
                m._capturing = lambda stream, m=m: m.torch.cuda.is_current_stream_capturing()
            elif variant == "two kernels":
                m.MERGE_IN_KERNEL = False
            elif variant == "one slice":
                m.choose_num_splits = lambda *a, **k: 1
            elif variant == "launcher key each call":
                m.KEEP_LAUNCHES = False

    def reset(self) -> None:
        self.stack.close()
        self.parts = None
        for m, merge, choose, keep, capturing in self.saved:
            m.MERGE_IN_KERNEL, m.choose_num_splits, m.KEEP_LAUNCHES, m._capturing = merge, choose, keep, capturing
        self.saved = []


def _decode_clock(fn, query_at: int) -> harness.PartClock:
    """A clock on ``fn``, which takes the query ``[B, H, S, D]`` at position ``query_at``: host
    seconds spent inside it on decode calls (one query token)."""
    return harness.PartClock(fn, when=lambda *args, **kwargs: args[query_at].shape[2] == 1)


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for a check on any machine")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL

    import torch
    import transformers
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import kernel_loader.attention.backends.flash as flash_backend
    import kernel_loader.integrations.transformers as klt

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = SHAPE if not args.smoke else dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=64)
    config = transformers.LlamaConfig(**shape, num_hidden_layers=sizes["layers"], vocab_size=128256,
                                      max_position_embeddings=8192, tie_word_embeddings=True)
    klt.enable()
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).eval()
    ids = torch.randint(3, config.vocab_size, (sizes["batch"], sizes["prompt"]),
                        generator=torch.Generator().manual_seed(1)).to(device)
    mask = torch.ones_like(ids)

    # host clocks: transformers looks sdpa up by name on every layer (fn(module, query, ...)); the
    # bridge's attention function calls the flash backend's _forward(kernel, module, query, ...),
    # looked up as a module global on every call
    sdpa_fn, inner_forward = ALL_ATTENTION_FUNCTIONS["sdpa"], flash_backend._forward
    sdpa_clock, ours_clock = _decode_clock(sdpa_fn, 1), _decode_clock(inner_forward, 2)
    ALL_ATTENTION_FUNCTIONS["sdpa"], flash_backend._forward = sdpa_clock, ours_clock

    rows_spec = {"sdpa": ("sdpa", None), "ours": (KERNEL, None),
                 "ours, capture query asked": (KERNEL, "capture query asked"), "ours, one slice": (KERNEL, "one slice"),
                 "ours, launcher key each call": (KERNEL, "launcher key each call"), "ours, timed by part": (KERNEL, "timed by part")}
    variant = _Variant()
    steps: dict = {name: [] for name in rows_spec}
    host: dict = {name: [] for name in rows_spec}
    parts: list = []  # per round: host µs per decode call in each part (the 'timed by part' row)

    def before(name: str) -> None:
        impl, choice = rows_spec[name]
        model.set_attn_implementation(impl)
        variant.set(choice or "")

    def run(name: str) -> None:
        clock = harness.StepClock(device)
        hc = sdpa_clock if name == "sdpa" else ours_clock
        hc.seconds, hc.calls = 0.0, 0
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=sizes["new_tokens"],
                           min_new_tokens=sizes["new_tokens"], do_sample=False, pad_token_id=0,
                           stopping_criteria=transformers.StoppingCriteriaList([clock]))
        steps[name].append(clock.median_step_ms())
        host[name].append(hc.seconds / max(hc.calls, 1) * 1e6)
        if variant.parts is not None:  # every loaded copy's clocks: only the bridge's copy runs
            summed = {part: harness.PartClock(None) for part in harness.DECODE_PARTS}
            for clocks in variant.parts:
                for part, c in clocks.items():
                    summed[part].seconds += c.seconds
            parts.append(harness.parts_us(summed, hc.calls))

    contenders = {name: (lambda name=name: run(name)) for name in rows_spec}
    try:
        harness.paired(contenders, rounds=sizes["rounds"], calls=1, device=device, before=before)
    finally:
        variant.reset()
        ALL_ATTENTION_FUNCTIONS["sdpa"], flash_backend._forward = sdpa_fn, inner_forward
        klt.disable()

    rounds = sizes["rounds"]
    timed_parts = parts[-rounds:]
    by_part = {part: statistics.median(r[part] for r in timed_parts) for part in harness.DECODE_PARTS}
    rows = []
    for name in rows_spec:
        timed = steps[name][-rounds:]  # the timed rounds', not the warm-up's
        row = {"attention": name, "decode_ms": statistics.median(timed),
               "vs_sdpa": str(harness.ratio(steps["sdpa"][-rounds:], timed)) if name != "sdpa" else "—",
               "host_us": statistics.median(host[name][-rounds:]),
               "parts": " / ".join(f"{part} {us:.1f}" for part, us in by_part.items())
               if name == "ours, timed by part" else "—"}
        print(row)
        rows.append(row)
    harness.write_results(
        "e2e_decode_split", rows,
        title="A transformers decode step: the attention call's host time in the model, and the decode's slice choices",
        columns={"attention": "attention", "decode_ms": "decode ms/step", "vs_sdpa": "vs sdpa, paired (sdpa ÷ row)",
                 "host_us": "host µs inside the attention call, per decode call",
                 "parts": "host µs per decode call, by part (median over rounds)"},
        out_dir=args.out, commit=args.commit,
        notes=[f"Llama shape {shape}, {sizes['layers']} layers, random weights, {str(dtype).split('.')[-1]}; "
               f"batch {sizes['batch']} × {sizes['prompt']} prompt tokens, {sizes['new_tokens']} greedy tokens; "
               f"{rounds} interleaved rounds (one generate each) after a warm-up round. 'capture query asked': the "
               "CUDA-graph capture check asked of the driver on every sliced call (the shipped call skips it on the "
               "default stream); 'one slice': each row read whole by one program; 'launcher key each call': "
               "every call works the launcher's key out instead of repeating the launch the first call of its shape kept; 'timed by part': "
               "a clock on each part of the shipped call, nested (decode_attention holds _alloc and _SPLIT, "
               "_SPLIT holds the C launch)."],
        extra={"steps_ms": steps, "host_us": host, "parts_us": parts, "sizes": sizes,
               "decode_modules": [m.__name__ for m in _decode_modules()]})


if __name__ == "__main__":
    main()
