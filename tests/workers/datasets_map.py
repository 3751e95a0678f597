"""Rank worker: ``Dataset.map`` / ``filter`` calls (see tests/test_datasets_map.py).

Usage: ``datasets_map.py --steps name,name,...`` (``PLT_PER_RANK_DATASETS_CACHE=1``:
``HF_DATASETS_CACHE=$HF_HOME/datasets-rank-<RANK>``, one hub cache). Every rank loads ``org/ds-map`` (a parquet
repo of the loopback hub) once, then runs each step of :data:`STEPS` between test barriers. The
report holds, per step, what the step returned (each split's fingerprint, rows, features,
content hash and cache files with ``HF_HOME`` replaced by ``<home>``) or the exception, how many
times this rank's process called the step's function (counted in ``$PLT_OUT/calls-<rank>``, a
file the function appends to: its fingerprint must not depend on the rank, so it reads the
path from the environment), how many times ``datasets`` hashed the ``hashed`` step's argument
(:class:`Suffix`), and patchload's INFO lines.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{os.environ.get('RANK', '0')}"

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import _common  # noqa: E402

CALLS = _common.OUT / f"calls-{_common.RANK}"
os.environ["PLT_CALLS_FILE"] = str(CALLS)
HASHES = _common.OUT / f"hashes-{_common.RANK}"
os.environ["PLT_HASHES_FILE"] = str(HASHES)
_UNHASHABLE = (i for i in range(1))
# patchload's INFO lines a step records: its call's and its map's.
_LOGGERS = ("patchload.coordination.call", "patchload.patches.datasets_map")


def _count(n: int) -> None:
    with open(os.environ["PLT_CALLS_FILE"], "a", encoding="utf-8") as f:
        f.write(f"{n}\n")


def tokenize(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """A character-level tokenizer, batched: ids and a length per text."""
    _count(len(batch["text"]))
    ids = [[ord(c) % 97 for c in text] for text in batch["text"]]
    return {"input_ids": ids, "length": [len(i) for i in ids]}


def keep_even(example: dict[str, Any]) -> bool:
    _count(1)
    return example["label"] % 2 == 0


def upper(example: dict[str, Any]) -> dict[str, Any]:
    _count(1)
    return {"text": example["text"].upper()}


def shout(example: dict[str, Any]) -> dict[str, Any]:
    _count(1)
    return {"text": example["text"] + "!"}


def lower(example: dict[str, Any]) -> dict[str, Any]:
    _count(1)
    return {"text": example["text"].lower()}


def inspect_only(example: dict[str, Any]) -> None:
    """Returns nothing: ``datasets`` keeps the dataset as it is and writes no cache file."""
    _count(1)


def kill_rank0(example: dict[str, Any]) -> dict[str, Any]:
    """SIGKILLs rank 0 (the node's leader) a second into its map, once the others wait; the
    time of the kill goes to ``$PLT_OUT/killed-at``."""
    _count(1)
    killed_at = Path(os.environ["PLT_CALLS_FILE"]).with_name("killed-at")
    if os.environ.get("RANK") == "0":
        time.sleep(1.0)
        killed_at.write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    # The others write their cache file only once rank 0 is dead: a plain rank 0 seconds late
    # would otherwise load theirs and never run this (patched followers compute after the kill).
    deadline = time.monotonic() + 120
    while not killed_at.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"k": len(example["text"])}


def raises(example: dict[str, Any]) -> dict[str, Any]:
    _count(1)
    time.sleep(1.0)  # the other ranks are waiting by then: they follow this attempt
    raise ValueError(f"bad example {example['text']!r}")


def unhashable(example: dict[str, Any]) -> dict[str, Any]:
    """Holds a generator in its globals, which ``datasets`` cannot hash (dill pickles no
    generator): a random fingerprint."""
    assert _UNHASHABLE is not None
    _count(1)
    return {"n": len(example["text"])}


class Suffix:
    """A map argument (``fn_kwargs``) that counts how often ``datasets`` pickles it: once for
    each fingerprint of the map (its hash). The count goes to ``$PLT_OUT/hashes-<rank>``, a path
    read from the environment, so that the state hashed is the same on every rank."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __getstate__(self) -> dict[str, Any]:
        with open(os.environ["PLT_HASHES_FILE"], "a", encoding="utf-8") as f:
            f.write("1\n")
        return {"text": self.text}


def add_suffix(example: dict[str, Any], suffix: Suffix) -> dict[str, Any]:
    _count(1)
    return {"text": example["text"] + suffix.text}


def _trainer_first() -> Any:
    """A Trainer script's preprocessing (``run_clm.py``'s shape): ``load_dataset`` of a repo
    not loaded before and a tokenizer map inside ``TrainingArguments.main_process_first()``,
    whose ``dist.barrier()`` holds the other ranks until rank 0 is done (its arguments build
    the process group, gloo on CPU)."""
    import datasets
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(_common.OUT / f"trainer-{_common.RANK}"),
                             report_to=[], use_cpu=True)
    with args.main_process_first(desc="dataset map pre-processing"):
        train = datasets.load_dataset("org/ds-first")["train"]
        return train.map(tokenize, batched=True, batch_size=4)


def _steps(dd: Any) -> dict[str, Any]:
    import datasets

    train = dd["train"]
    return {
        "tokenize": lambda: train.map(tokenize, batched=True, batch_size=4),
        "filter": lambda: train.filter(keep_even),
        "dict_map": lambda: dd.map(upper),
        "hashed": lambda: train.map(add_suffix, fn_kwargs={"suffix": Suffix("#")}),
        "chained": lambda: train.map(upper).map(tokenize, batched=True),
        "unhashable": lambda: train.map(unhashable),
        "in_memory": lambda: datasets.Dataset.from_dict(
            {"text": ["p", "qq", "rrr"], "label": [1, 2, 3]}).map(upper),
        "no_cache_reuse": lambda: train.map(upper, load_from_cache_file=False),
        "num_proc": lambda: train.map(shout, num_proc=2, desc="upper, 2 processes"),
        "after_rank0": lambda: train.map(lower),
        "no_update": lambda: train.map(inspect_only),
        "leader_killed": lambda: train.map(kill_rank0),
        "raises": lambda: train.map(raises),
        "trainer_first": _trainer_first,
    }


def _one(dataset: Any, home: str) -> dict[str, Any]:
    rows = dataset.to_dict()
    return {"fingerprint": dataset._fingerprint, "num_rows": dataset.num_rows,
            "rows": rows, "features": dataset.features.to_dict(),
            "content": hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest(),
            "split": str(dataset.split),
            "files": [f["filename"].replace(home, "<home>") for f in dataset.cache_files]}


def _describe(result: Any, home: str) -> dict[str, Any]:
    import datasets

    if isinstance(result, datasets.Dataset):
        return {"dataset": _one(result, home)}
    return {"splits": {name: _one(split, home) for name, split in result.items()}}


def _calls(path: Path = CALLS) -> int:
    try:
        return sum(int(line) for line in path.read_text().split())
    except FileNotFoundError:
        return 0


def body(report: dict[str, Any]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", default="tokenize")
    args = parser.parse_args()

    if os.environ.get("PLT_PER_RANK_DATASETS_CACHE") == "1":  # one hub cache, one each
        os.environ["HF_DATASETS_CACHE"] = str(Path(os.environ["HF_HOME"])
                                              / f"datasets-rank-{_common.RANK}")

    import patchload
    import datasets

    datasets.disable_progress_bars()
    report["installed"] = patchload.is_installed()
    report["map_patched"] = type(vars(datasets.Dataset)["map"]).__name__ == "FunctionWrapper"
    home = str(Path(os.environ["HF_HOME"]))
    barrier = _common.Barrier()
    with _common.step(report, "load", barrier) as record:
        dd = datasets.load_dataset("org/ds-map")
        record["ok"] = True
    steps = _steps(dd)
    for name in [s for s in args.steps.split(",") if s]:
        if name == "leader_killed":  # rank 0 dies in it: no barrier after it (the last step)
            barrier()
        with _common.step(report, name, None if name == "leader_killed" else barrier) as record:
            if name == "after_rank0":
                _after_rank0()
            before, hashed_before = _calls(), _calls(HASHES)
            with _common.patchload_lines(_LOGGERS) as lines:
                record.update(_common.attempt(lambda: _describe(steps[name](), home)))
            record["calls"] = _calls() - before
            record["hashes"] = _calls(HASHES) - hashed_before
            record["lines"] = lines
            if name == "after_rank0" and _common.RANK == 0:
                (_common.OUT / "after-rank0-done").write_text("")


def _after_rank0() -> None:
    """Ranks other than 0 start ``after_rank0``'s map once rank 0's returned: its cache file
    exists when they name it (a rank seconds late, as on a real cluster)."""
    deadline = time.monotonic() + 120
    while _common.RANK != 0 and not (_common.OUT / "after-rank0-done").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 did not finish its after_rank0 map within 120 s")
        time.sleep(0.05)


if __name__ == "__main__":
    _common.main(body)
