"""One rank of ``benchmarks/bench_datasets.py``: ``load_dataset`` then a batched ``Dataset.map``.

Run under torchrun by the benchmark (with ``demo/site/sitecustomize.py`` injected, which puts
``origin/rank-N`` in the hub requests' User-Agent). Protocol, through files in ``--sync-dir``:
write ``imported-RANK`` once the libraries are imported, wait for ``go`` (the benchmark takes
its memory baseline and clears the hub's request log in between), ``load_dataset``, wait until
every rank has loaded (so the map is timed from a common start), map the train split, print
``RESULT {json}``, then wait for every rank's ``done-RANK`` before exiting (so every rank's
mappings stay alive while the others still work: the node's peak is the whole job's).
With ``BENCH_DS_PER_RANK_HOME=1`` (``--layout per-rank``) each rank uses ``$HF_HOME/rank-RANK``.

Times in the RESULT are ``time.time()`` seconds. ``map_calls`` is how many times this rank's
process called the map function (one line per batch in ``$BENCH_DS_CALLS_FILE``).
"""

import argparse
import contextlib
import gc
import hashlib
import json
import os
import time
from pathlib import Path

# --layout per-rank: each rank its own HF_HOME under the run's (before huggingface_hub and
# datasets read it at import).
if os.environ.get("BENCH_DS_PER_RANK_HOME") == "1":
    os.environ["HF_HOME"] = os.path.join(os.environ["HF_HOME"], f"rank-{os.environ['RANK']}")

import datasets  # noqa: E402

import patchload  # noqa: F401,E402  - PATCHLOAD=0 turns it off
from _sync import touch, wait_for  # noqa: E402  - benchmarks/: the script's own folder


def tokenize(batch: dict) -> dict:
    """A cheap stand-in for a tokenizer, batched: whitespace words, ids of the first 128 words
    (truncation, as ``max_length`` does), and the word count of each text.

    The call count goes to a file named by the environment, not by an argument or a global:
    ``datasets`` fingerprints the function with what it references, and a per-rank path there
    would give every rank its own fingerprint (and so its own cache file: no shared map).
    """
    with open(os.environ["BENCH_DS_CALLS_FILE"], "a", encoding="utf-8") as f:
        f.write(f"{len(batch['text'])}\n")
    words = [text.split() for text in batch["text"]]
    # Deterministic across processes (str hash() is salted per process).
    ids = [[len(w) * 997 + ord(w[0]) for w in ws[:128]] for ws in words]
    return {"input_ids": ids, "n_words": [len(ws) for ws in words]}


def describe(ds: datasets.Dataset) -> dict:
    """What identifies a dataset's content cheaply: fingerprint, rows, and a sha256 of three
    rows (first, middle, last; reading them touches the Arrow files the rank mapped)."""
    n = ds.num_rows
    picked = ds.select(sorted({0, n // 2, n - 1})).to_dict() if n else {}
    rows = hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()
    return {"fingerprint": ds._fingerprint, "num_rows": n, "rows_sha256": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--sync-dir", type=Path, required=True)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sync = args.sync_dir
    calls = sync / f"calls-{rank}"
    calls.write_text("")
    os.environ["BENCH_DS_CALLS_FILE"] = str(calls)

    # A training script has torch imported before it loads its data. patchload's store
    # (torch.distributed) needs it: without it here the patched ranks alone would pay torch's
    # import inside load_dataset (4 s and about 0.1 GiB a rank, profiled at 238e59e).
    import torch  # noqa: F401

    # What load_dataset imports lazily, so the memory baseline holds every library.
    with contextlib.suppress(ImportError):
        import datasets.packaged_modules.parquet.parquet  # noqa: F401
        import patchload.patches.datasets  # noqa: F401
        import patchload.patches.datasets_map  # noqa: F401

    # A full garbage collection first, in both modes, as pyperf does between runs: a collection
    # owed by the process's earlier allocations would otherwise land in whichever call crosses
    # CPython's threshold first (docs/benchmarks.md: 0.2-0.3 s in every patched warm
    # load_dataset, in no plain one). A collection the call's own allocations cause still counts.
    gc.collect()
    touch(sync / f"imported-{rank}")
    wait_for([sync / "go"])
    loaded = datasets.load_dataset(args.dataset)
    loaded_at = time.time()
    touch(sync / f"loaded-{rank}")
    wait_for([sync / f"loaded-{r}" for r in range(world)])

    map_start = time.time()
    mapped = loaded["train"].map(tokenize, batched=True)
    map_end = time.time()

    print("RESULT " + json.dumps({
        "rank": rank, "loaded_at": loaded_at, "map_start": map_start, "map_end": map_end,
        "map_calls": len(calls.read_text().splitlines()),
        "loaded": describe(loaded["train"]), "mapped": describe(mapped)}), flush=True)
    touch(sync / f"done-{rank}")
    wait_for([sync / f"done-{r}" for r in range(world)])


if __name__ == "__main__":
    main()
