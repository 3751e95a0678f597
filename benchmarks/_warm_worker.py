"""One rank of ``benchmarks/bench_warm.py``: many small calls on a warm cache, timed per kind.

Prints ``RESULT {json}`` with the seconds each loop took on this rank (after a file barrier, so
every rank starts each loop together) and a digest of what the calls returned.
"""

import argparse
import gc
import hashlib
import json
import os
import time
from pathlib import Path

from huggingface_hub import hf_hub_download
from transformers import AutoConfig, AutoTokenizer

import patchload  # noqa: F401  - PATCHLOAD=0 turns it off


def barrier(sync: Path, name: str, rank: int, world: int, timeout_s: float = 600.0) -> None:
    (sync / f"{name}-{rank}").write_text("")
    deadline = time.time() + timeout_s
    while not all((sync / f"{name}-{r}").exists() for r in range(world)):
        if time.time() > deadline:
            raise TimeoutError(f"barrier {name}: waited {timeout_s:.0f} s")
        time.sleep(0.002)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--sync-dir", type=Path, required=True)
    parser.add_argument("--configs", type=int, default=200)
    parser.add_argument("--tokenizers", type=int, default=200)
    parser.add_argument("--downloads", type=int, default=100)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    loops = {
        "AutoConfig": (args.configs, lambda: AutoConfig.from_pretrained(args.model).to_json_string()),
        "AutoTokenizer": (args.tokenizers,
                          lambda: repr(AutoTokenizer.from_pretrained(args.model)("hello world"))),
        "hf_hub_download": (args.downloads,
                            lambda: Path(hf_hub_download(args.model, "config.json")).read_text()),
    }
    seconds, digests = {}, {}
    for kind, (n, call) in loops.items():
        call()  # untimed: the first call imports what the later ones reuse
        gc.collect()  # as in the other workers: no full collection owed from before the loop
        barrier(args.sync_dir, kind, rank, world)
        digest = hashlib.sha256()
        start = time.perf_counter()
        for _ in range(n):
            digest.update(call().encode())
        seconds[kind] = time.perf_counter() - start
        digests[kind] = digest.hexdigest()
    print("RESULT " + json.dumps({"rank": rank, "seconds": seconds, "digests": digests}),
          flush=True)


if __name__ == "__main__":
    main()
