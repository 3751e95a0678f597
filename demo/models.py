"""Llama-architecture repos of a chosen size for the demo and the benchmark, cached on disk.

The weights are random (seeded, so the same spec gives the same files) and the tokenizer is the
128-word :func:`patchload.testing.models.tiny_tokenizer`: the point is loading, not text. With
``fill="pattern"`` the safetensors files are written directly, each tensor a window of one seeded
random block repeated (seconds for GBs, where initialising the model takes minutes on 2 cores):
for benchmarks whose figures do not depend on the values (a load's time and memory).
"""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

VOCAB = 32000
_PATTERN_ELEMS = 1 << 22  # the repeated block of a pattern-filled checkpoint
_SAFETENSORS_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


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


def llama_repo(folder: Path, spec: dict, *, seed: int = 0, fill: str = "random",
               log=print) -> Path:
    """Writes (or reuses, if ``folder`` holds the same spec) a Llama repo with tokenizer.

    ``fill``: ``"random"``, the model's own initialisation (seeded), saved by
    ``save_pretrained``; ``"pattern"``, safetensors shards written directly, every tensor a
    window of one seeded random block (:func:`_write_pattern_checkpoint`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from patchload.testing.models import tiny_tokenizer

    if fill not in ("random", "pattern"):
        raise ValueError(f"fill {fill!r} is not 'random' or 'pattern'")
    marker = folder / "demo-spec.json"
    wanted = {**spec, "seed": seed, **({"fill": fill} if fill != "random" else {})}
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    start = time.time()
    dtype = getattr(torch, spec["dtype"])
    log(f"  generating {folder.name}: {param_count(spec) / 1e6:.0f} M parameters in "
        f"{spec['dtype']}{' (pattern fill)' if fill == 'pattern' else ''} ...")
    config = LlamaConfig(**{k: v for k, v in spec.items() if k != "dtype"})
    if fill == "pattern":
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        model.config.dtype = dtype
        model.config.architectures = [type(model).__name__]
        _write_pattern_checkpoint(folder, [(name, tuple(t.shape)) for name, t in
                                           model.state_dict().items()], spec["dtype"], seed)
        model.config.save_pretrained(folder)
    else:
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
    marker.write_text(json.dumps(wanted))
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    log(f"  wrote {folder} ({size / 1e6:.0f} MB of safetensors) in {time.time() - start:.0f} s")
    return folder


def _write_pattern_checkpoint(folder: Path, tensors: list[tuple[str, tuple[int, ...]]],
                              dtype: str, seed: int, max_shard_bytes: int = 2 * 10**9) -> None:
    """Safetensors shards of ``tensors`` (name, shape), all of ``dtype``, as ``save_pretrained``
    names them (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` and the index),
    at most ``max_shard_bytes`` a shard. Tensor ``i`` is the seeded random block (normal, std
    0.02, in ``dtype``) repeated from element ``7919 * i`` of it onwards."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    block = (torch.randn(_PATTERN_ELEMS, generator=generator) * 0.02).to(getattr(torch, dtype))
    size = block.element_size()
    raw = block.view(torch.uint8).numpy().tobytes()
    doubled = memoryview(raw + raw)
    shards: list[list[tuple[str, tuple[int, ...], int]]] = [[]]
    shard_bytes = 0
    for name, shape in tensors:
        nbytes = size
        for dim in shape:
            nbytes *= dim
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, shape, nbytes))
        shard_bytes += nbytes
    index = 0
    weight_map: dict[str, str] = {}
    total = 0
    for number, shard in enumerate(shards, 1):
        file = ("model.safetensors" if len(shards) == 1
                else f"model-{number:05d}-of-{len(shards):05d}.safetensors")
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, nbytes in shard:
            header[name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(folder / file, "wb") as out:
            out.write(struct.pack("<Q", len(encoded)))
            out.write(encoded)
            for name, shape, nbytes in shard:
                start = (7919 * index * size) % len(raw)
                while nbytes > 0:
                    chunk = min(nbytes, len(raw))
                    out.write(doubled[start:start + chunk])
                    nbytes -= chunk
                    start = 0
                index += 1
        total += offset
    if len(shards) > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))
