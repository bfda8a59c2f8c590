"""A torchrun job (gloo, CPU): every rank builds a 1-layer Llama from a config whose attention is a
kernel id, loaded from the shared cache with no network, runs one forward, and the ranks compare.

Run by tests/test_cluster.py::test_torchrun_ranks_use_a_hub_kernel_from_the_shared_cache as
``torchrun --standalone --nproc-per-node 8 torchrun_job.py OUT.json``.
"""

import json
import sys

import torch
import torch.distributed as dist

import kernel_loader.integrations.transformers as klt

KERNEL = "kernels-community/flash-attn2"


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from transformers import AutoModelForCausalLM, LlamaConfig

    klt.enable()
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )
    torch.manual_seed(0)  # same weights on every rank
    model = AutoModelForCausalLM.from_config(config, attn_implementation=KERNEL, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.arange(8).reshape(1, 8)).logits
    total = torch.tensor([float(logits.double().sum())])
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, total)
    from kernel_loader.loader import get_kernel

    res = get_kernel(KERNEL).__kernel_resolution__
    if rank == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump({"sums": [float(g) for g in gathered], "source": res.source, "sha": res.sha,
                       "attn": model.config._attn_implementation, "world": dist.get_world_size()}, fh)
    # every rank done (rank 0 has written the file) before any tears gloo down. Without it a
    # rank sometimes aborted at exit under load ("terminate called without an active
    # exception"); that this was the cause is a guess
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
