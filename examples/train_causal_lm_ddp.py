"""Fine-tune a causal language model for a few steps with DistributedDataParallel (CPU, gloo).

    torchrun --nproc_per_node 4 examples/train_causal_lm_ddp.py --model HuggingFaceTB/SmolLM2-135M

Every rank loads the same checkpoint; with ``import patchload`` one rank per node downloads and
reads it and the others map its weights. Each rank prints one line::

    RESULT {"rank": 0, "world_size": 4, "weights_sha256": "...", "first_loss": 10.4, ...}
"""

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForCausalLM, AutoTokenizer

import patchload  # noqa: F401  - rank-aware downloads and loading

TEXT = ("the quick brown fox jumps over the lazy dog . "
        "a journey of a thousand miles begins with a single step . ") * 8


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes), without copying."""
    digest = hashlib.sha256()
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        tensor = tensor.detach().contiguous().reshape(-1)
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.environ.get("MODEL", "HuggingFaceTB/SmolLM2-135M"))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    start = time.time()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    load_s = time.time() - start
    sha = weights_sha256(model)

    model.train()
    ddp = DDP(model, gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    ids = tokenizer(TEXT, return_tensors="pt").input_ids[:, : args.seq_len]
    # Each rank trains on its own window of the same text (batch 1).
    shift = rank % max(1, ids.shape[1] // 2)
    batch = torch.roll(ids, shifts=-shift, dims=1)

    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = ddp(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {len(losses)}: loss {losses[-1]:.6f}", flush=True)

    result = {"rank": rank, "world_size": world_size, "model": args.model,
              "weights_sha256": sha, "first_loss": losses[0] if losses else None,
              "losses": losses, "load_s": round(load_s, 3), "loaded_at": start + load_s}
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
