"""Fine-tune T5 with FSDP, following pytorch/examples ``distributed/FSDP/T5_training.py``.

    torchrun --nproc_per_node 2 examples/fsdp_t5.py --model google-t5/t5-small

As in that example, every rank loads the model *before* ``init_process_group``. With
``import patchload`` one rank downloads and reads the checkpoint and the others map its weights:
patchload coordinates through torchrun's own store, so no process group is needed yet.

Sharding uses FSDP2 (``fully_shard``) on a CPU device mesh over gloo; if this torch build cannot
shard on CPU it falls back to DDP and says so. Each rank prints one line::

    RESULT {"rank": 0, "weights_sha256": "...", "first_loss": 5.1, "parallel": "fsdp2", ...}
"""

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from transformers import AutoTokenizer, T5ForConditionalGeneration

import patchload  # noqa: F401  - rank-aware downloads and loading

PAIRS = [
    ("summarize: the quick brown fox jumps over the lazy dog .", "a fox jumps ."),
    ("summarize: a journey of a thousand miles begins with a single step .", "start small ."),
    ("summarize: he said that water is good for all people .", "water is good ."),
    ("summarize: they came back from the long day of work .", "they came back ."),
]


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes), without copying."""
    digest = hashlib.sha256()
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        tensor = tensor.detach().contiguous().reshape(-1)
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def shard(model: torch.nn.Module, world_size: int) -> tuple[torch.nn.Module, str]:
    """FSDP2 on CPU when available, otherwise DDP."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in list(model.encoder.block) + list(model.decoder.block):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, "fsdp2"
    except Exception as err:  # noqa: BLE001 - an example: report and fall back
        print(f"FSDP on CPU is not available here ({type(err).__name__}: {err}); using DDP",
              flush=True)
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model), "ddp"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.environ.get("MODEL", "google-t5/t5-small"))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    # pytorch/examples: model and tokenizer come first, the process group after.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    start = time.time()
    model = T5ForConditionalGeneration.from_pretrained(args.model)
    load_s = time.time() - start
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sha = weights_sha256(model)

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model, parallel = shard(model, world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    source, target = PAIRS[rank % len(PAIRS)]
    batch = tokenizer([source], return_tensors="pt")
    labels = tokenizer([target], return_tensors="pt").input_ids
    model.train()
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                     labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    result = {"rank": rank, "world_size": world_size, "model": args.model, "parallel": parallel,
              "weights_sha256": sha, "first_loss": losses[0] if losses else None,
              "losses": losses, "load_s": round(load_s, 3)}
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
