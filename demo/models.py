"""Llama-architecture repos of a chosen size for the demo and the benchmark, cached on disk.

The weights are random (seeded, so the same spec gives the same files) and the tokenizer is the
128-word :func:`patchload.testing.models.tiny_tokenizer`: the point is loading, not text.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

VOCAB = 32000


def llama_spec(*, hidden: int, layers: int, dtype: str, vocab: int = VOCAB) -> dict:
    """Config values of a Llama with ``hidden`` width and ``layers`` layers (MLP = 2.75x)."""
    return {"vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": (int(hidden * 2.75) + 255) // 256 * 256,
            "num_hidden_layers": layers, "num_attention_heads": max(1, hidden // 64),
            "num_key_value_heads": max(1, hidden // 64), "max_position_embeddings": 512,
            "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": 2, "dtype": dtype}


def param_count(spec: dict) -> int:
    h, i, v, n = (spec["hidden_size"], spec["intermediate_size"], spec["vocab_size"],
                  spec["num_hidden_layers"])
    kv = h * spec["num_key_value_heads"] // spec["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return 2 * v * h + n * per_layer + h


def layers_for(target_params: float, *, hidden: int, dtype: str) -> int:
    """The number of layers that brings a ``hidden``-wide Llama closest to ``target_params``."""
    best = min(range(1, 129), key=lambda n: abs(
        param_count(llama_spec(hidden=hidden, layers=n, dtype=dtype)) - target_params))
    return best


def llama_repo(folder: Path, spec: dict, *, seed: int = 0, log=print) -> Path:
    """Writes (or reuses, if ``folder`` holds the same spec) a random Llama repo with tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from patchload.testing.models import tiny_tokenizer

    marker = folder / "demo-spec.json"
    if marker.is_file() and json.loads(marker.read_text()) == {**spec, "seed": seed}:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    start = time.time()
    dtype = getattr(torch, spec["dtype"])
    log(f"  generating {folder.name}: {param_count(spec) / 1e6:.0f} M parameters in "
        f"{spec['dtype']} ...")
    config = LlamaConfig(**{k: v for k, v in spec.items() if k != "dtype"})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    model.config.dtype = dtype
    model.save_pretrained(folder, max_shard_size="2GB")
    model.generation_config.save_pretrained(folder)
    tok = tiny_tokenizer()
    tok.model_max_length = 512
    tok.save_pretrained(folder)
    del model
    marker.write_text(json.dumps({**spec, "seed": seed}))
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    log(f"  wrote {folder} ({size / 1e6:.0f} MB of safetensors) in {time.time() - start:.0f} s")
    return folder


def checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))
