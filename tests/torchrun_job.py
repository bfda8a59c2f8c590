"""A torchrun job (CPU): every rank builds a 1-layer Llama from a config whose attention is a
kernel id, loads it from the shared cache with no network, runs one forward and writes what it
saw to ``OUT_DIR/rank<N>.json``; the test compares the ranks.

The ranks take no process group: what is under test is eight processes cold-loading one kernel
from one cache at once, and gloo's teardown aborted a rank now and then at exit on a loaded
two-core machine ("terminate called without an active exception"), which said nothing about
the loader.

Run by tests/test_cluster.py::test_torchrun_ranks_use_a_hub_kernel_from_the_shared_cache as
``torchrun --standalone --nproc-per-node 8 torchrun_job.py OUT_DIR``.
"""

import json
import os
import sys
from pathlib import Path

import torch

import kernel_loader.integrations.transformers as klt

KERNEL = "kernels-community/flash-attn2"


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from transformers import AutoModelForCausalLM, LlamaConfig

    klt.enable()
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )
    torch.manual_seed(0)  # same weights on every rank
    model = AutoModelForCausalLM.from_config(config, attn_implementation=KERNEL, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.arange(8).reshape(1, 8)).logits
    from kernel_loader.loader import get_kernel

    res = get_kernel(KERNEL).__kernel_resolution__
    out = Path(sys.argv[1]) / f"rank{rank}.json"
    partial = out.with_suffix(".partial")
    partial.write_text(json.dumps({
        "sum": float(logits.double().sum()), "source": res.source, "sha": res.sha,
        "attn": model.config._attn_implementation, "world": world,
    }))
    partial.replace(out)  # the test never reads half a file


if __name__ == "__main__":
    main()
