"""Sentence embeddings with all-MiniLM-L6-v2 on every rank (e.g. to embed a sharded corpus).

    torchrun --nproc_per_node 2 examples/embed_minilm.py

No process group is needed: ``import patchload`` coordinates through torchrun's store, so one rank
downloads and loads the model and the others map its weights. Each rank embeds the same fixed
sentences and prints ``RESULT {json}`` with a hash of the embeddings and of the weights.
"""

import argparse
import hashlib
import json
import os

import torch
from sentence_transformers import SentenceTransformer

import patchload  # noqa: F401  - rank-aware downloads and loading

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "Distributed training loads the same weights on every rank.",
]


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
    parser.add_argument("--model", default=os.environ.get(
        "MODEL", "sentence-transformers/all-MiniLM-L6-v2"))
    args = parser.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    model = SentenceTransformer(args.model, device="cpu")
    embeddings = model.encode(SENTENCES, convert_to_tensor=True, normalize_embeddings=True)
    result = {"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
              "model": args.model, "dim": int(embeddings.shape[1]),
              "weights_sha256": weights_sha256(model),
              "embedding_sha256": hashlib.sha256(embeddings.contiguous().numpy().data).hexdigest(),
              "first_loss": None}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
