"""Rank worker: hub downloads through every entry point (see tests/test_download.py).

Usage: ``download.py [--steps a,b] [--prefix dl/] [--init never|before|after]
[--pattern concurrent|rank0first] [--per-rank-home]``

Each step is one call (``hf_hub_download:<file>`` is one file) on a repo of its own (``<prefix>pair`` for the model and its tokenizer,
``<prefix>file``, ``<prefix>snap``, ``<prefix>config``, ``<prefix>gen``), with test barriers
around it so the hub log cuts into per-step windows. The report holds what each call returned
(hashes of files, configs, model fingerprints) or the exception.

* ``--init``: ``init_process_group("gloo")`` before the calls, after them, or never.
* ``--pattern rank0first``: ``if rank == 0: call(); dist.barrier(); if rank != 0: call()``
  (needs ``--init before``).
* ``--per-rank-home``: ``HF_HOME=$HF_HOME/rank-<RANK>`` (set before huggingface_hub is imported).
* ``--no-barrier``: no test barriers between steps (for jobs that kill a rank).
"""

from __future__ import annotations

import os

os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{os.environ.get('RANK', '0')}"

import argparse
import sys  # noqa: E402
import hashlib  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import _common  # noqa: E402
from _common import RANK, WORLD_SIZE  # noqa: E402

FILES = ("config.json", "model.safetensors", "tokenizer.json")
ALL_STEPS = ("model", "tokenizer", *(f"hf_hub_download:{f}" for f in FILES), "snapshot", "config",
             "generation")


def _file_sha(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _steps(prefix: str) -> dict:
    from huggingface_hub import hf_hub_download, snapshot_download
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    def model() -> dict:
        return {"fingerprint": _common.fingerprint(
            AutoModelForCausalLM.from_pretrained(f"{prefix}pair"))}

    def tokenizer() -> dict:
        tok = AutoTokenizer.from_pretrained(f"{prefix}pair")
        return {"ids": tok("the water is hot")["input_ids"], "vocab": len(tok),
                "class": type(tok).__name__}

    def hub_download(name: str) -> Callable[[], dict]:
        def call() -> dict:
            return {"sha256": _file_sha(hf_hub_download(f"{prefix}file", name))}

        return call

    def snapshot() -> dict:
        folder = Path(snapshot_download(f"{prefix}snap"))
        return {"files": {str(p.relative_to(folder)): _file_sha(str(p))
                          for p in sorted(folder.rglob("*")) if p.is_file()}}

    def config() -> dict:
        return {"config": _common._jsonable(AutoConfig.from_pretrained(f"{prefix}config")
                                            .to_dict())}

    def generation() -> dict:
        return {"generation": _common._jsonable(
            GenerationConfig.from_pretrained(f"{prefix}gen").to_dict())}

    return {"model": model, "tokenizer": tokenizer, "snapshot": snapshot, "config": config,
            "generation": generation, **{f"hf_hub_download:{f}": hub_download(f) for f in FILES}}


def body(report: dict) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", default=",".join(ALL_STEPS))
    parser.add_argument("--prefix", default="dl/")
    parser.add_argument("--init", choices=("never", "before", "after"), default="never")
    parser.add_argument("--pattern", choices=("concurrent", "rank0first"), default="concurrent")
    parser.add_argument("--per-rank-home", action="store_true")
    parser.add_argument("--no-barrier", action="store_true",
                        help="no test barriers (a rank may be killed on purpose)")
    args = parser.parse_args()
    if args.per_rank_home:
        os.environ["HF_HOME"] = str(Path(os.environ["HF_HOME"]) / f"rank-{RANK}")

    import patchload
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    report["installed"] = patchload.is_installed()
    report["topology"] = str(patchload.topology())
    barrier = None if args.no_barrier else _common.Barrier()
    if args.init == "before":
        dist.init_process_group("gloo")
    calls = _steps(args.prefix)
    for name in [s for s in args.steps.split(",") if s]:
        with _common.step(report, name, barrier) as record:
            if args.pattern == "rank0first":
                if RANK == 0:
                    record.update(_common.attempt(calls[name]))
                dist.barrier()
                if RANK != 0:
                    record.update(_common.attempt(calls[name]))
            else:
                record.update(_common.attempt(calls[name]))
    if args.init == "after":
        dist.init_process_group("gloo")
    if dist.is_initialized():
        import torch

        total = torch.tensor([RANK + 1])
        dist.all_reduce(total)  # the user's group still works after patchload's calls
        report["all_reduce"] = int(total)
        report["expected_all_reduce"] = WORLD_SIZE * (WORLD_SIZE + 1) // 2
        dist.destroy_process_group()


if __name__ == "__main__":
    # A gloo process group ran (--init before|after): see _common.main.
    _common.main(body, skip_finalization="--init" in sys.argv and "never" not in sys.argv)
