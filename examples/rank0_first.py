"""The "rank 0 first" pattern: rank 0 loads, the others wait at a barrier, then load.

    torchrun --nproc_per_node 2 examples/rank0_first.py --model HuggingFaceTB/SmolLM2-135M

Many scripts do this by hand to keep N ranks from downloading at once. It keeps working with
``import patchload`` (no deadlock): rank 0 leads, and the others, arriving after the barrier,
find its outcome already published and map its weights instead of reading the checkpoint.
Each rank prints ``RESULT {json}`` with a weights hash and the loss on a fixed sentence.
"""

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

import patchload  # noqa: F401  - rank-aware downloads and loading

TEXT = "the quick brown fox jumps over the lazy dog ."


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes), without copying."""
    digest = hashlib.sha256()
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        tensor = tensor.detach().contiguous().reshape(-1)
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def load(repo: str):
    tokenizer = AutoTokenizer.from_pretrained(repo)
    model = AutoModelForCausalLM.from_pretrained(repo)
    return tokenizer, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.environ.get("MODEL", "HuggingFaceTB/SmolLM2-135M"))
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        tokenizer, model = load(args.model)
        dist.barrier()
    else:
        dist.barrier()
        tokenizer, model = load(args.model)

    model.eval()
    batch = tokenizer(TEXT, return_tensors="pt")
    with torch.no_grad():
        loss = model(**batch, labels=batch.input_ids).loss.item()
    result = {"rank": rank, "world_size": dist.get_world_size(), "model": args.model,
              "weights_sha256": weights_sha256(model), "first_loss": loss}
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
