"""Rank worker: ``datasets.load_dataset`` calls (see tests/test_datasets.py).

Usage: ``datasets_load.py --steps name,name,... [--per-rank-datasets-cache]``; each step is one
``load_dataset`` call of :data:`STEPS`, with test barriers around it so the hub log cuts into
per-step windows. The report
holds, per step, what the call returned (each split's rows, features, size, fingerprint, Arrow
files with ``HF_HOME`` replaced by ``<home>``, info) or the exception, and the Arrow files this
rank's call wrote (``ArrowWriter`` instances it created, by path).
"""

from __future__ import annotations

import os

os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{os.environ.get('RANK', '0')}"

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import _common  # noqa: E402

LOCAL_CSV = os.environ.get("PLT_LOCAL_CSV", "")
# step -> (args, kwargs) of load_dataset
STEPS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "parquet": (("org/ds-parquet",), {}),
    "csv": (("org/ds-csv",), {"split": "train"}),
    "json": (("org/ds-json",), {"data_files": {"train": "data/*.jsonl"}}),
    "text_config": (("org/ds-configs", "second"), {}),
    "revision": (("org/ds-csv",), {"revision": os.environ.get("PLT_CSV_COMMIT", "main"),
                                   "split": "train[:1]"}),
    "local": (("csv",), {"data_files": LOCAL_CSV}),
    "own_cache_dir": (("org/ds-parquet",), {"cache_dir": os.environ.get("PLT_DS_CACHE", "")}),
    "streaming": (("org/ds-csv",), {"split": "train", "streaming": True}),
    "missing_repo": (("org/ds-missing",), {}),
    "missing_file": (("org/ds-csv",), {"data_files": "nope.csv"}),
    "file_404": (("org/ds-404",), {}),
    # features= (datasets' Features of Value types: dataclasses, callable), built in body().
    "features": (("org/ds-csv",), {"split": "train", "features": "<Features>"}),
    # With --per-rank-cwd: one relative pattern, a folder per rank (rank 2's empty).
    "rank_glob": (("csv",), {"data_files": "sub/*.csv"}),
}


def _one(dataset: Any, home: str) -> dict[str, Any]:
    return {"rows": dataset.to_dict(), "features": dataset.features.to_dict(),
            "num_rows": dataset.num_rows, "fingerprint": dataset._fingerprint,
            "split": str(dataset.split),
            "files": [f["filename"].replace(home, "<home>") for f in dataset.cache_files],
            "info": _common._jsonable(dataset.info._to_yaml_dict())}


def _describe(result: Any, home: str) -> dict[str, Any]:
    import datasets

    if isinstance(result, datasets.IterableDataset):
        return {"streamed": list(result)}
    if isinstance(result, datasets.Dataset):
        return {"dataset": _one(result, home)}
    return {"splits": {name: _one(split, home) for name, split in result.items()}}


def body(report: dict[str, Any]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", default=",".join(STEPS))
    parser.add_argument("--per-rank-datasets-cache", action="store_true",
                        help="HF_DATASETS_CACHE=$HF_HOME/datasets-rank-<RANK> (one hub cache)")
    parser.add_argument("--per-rank-cwd", action="store_true",
                        help="work in $PLT_OUT/cwd-<RANK>, whose sub/ holds train.csv but on "
                             "rank 2")
    args = parser.parse_args()
    if args.per_rank_cwd:
        cwd = _common.OUT / f"cwd-{_common.RANK}"
        (cwd / "sub").mkdir(parents=True, exist_ok=True)
        if _common.RANK != 2:
            (cwd / "sub" / "train.csv").write_text("text,label\nx,1\ny,0\n")
        os.chdir(cwd)
    if args.per_rank_datasets_cache:
        os.environ["HF_DATASETS_CACHE"] = str(Path(os.environ["HF_HOME"])
                                              / f"datasets-rank-{_common.RANK}")

    import patchload
    import datasets
    from datasets import arrow_writer

    datasets.disable_progress_bars()
    report["installed"] = patchload.is_installed()
    report["load_dataset_patched"] = type(datasets.load_dataset).__name__ == "FunctionWrapper"
    home = str(Path(os.environ["HF_HOME"]))
    writes: list[str] = []
    original_init = arrow_writer.ArrowWriter.__init__

    def counting_init(self: Any, *a: Any, **kw: Any) -> None:
        writes.append(str(kw.get("path") or (a[2] if len(a) > 2 else "<stream>")))
        original_init(self, *a, **kw)

    arrow_writer.ArrowWriter.__init__ = counting_init
    barrier = _common.Barrier()
    for name in [s for s in args.steps.split(",") if s]:
        call_args, call_kwargs = STEPS[name]
        if call_kwargs.get("features") == "<Features>":
            call_kwargs = {**call_kwargs, "features": datasets.Features(
                {"text": datasets.Value("string"), "label": datasets.Value("int64")})}

        def call(call_args: tuple[Any, ...] = call_args,
                 call_kwargs: dict[str, Any] = call_kwargs) -> dict[str, Any]:
            return _describe(datasets.load_dataset(*call_args, **call_kwargs), home)

        with _common.step(report, name, barrier) as record:
            del writes[:]
            with _common.patchload_lines() as lines:
                record.update(_common.attempt(call))
            record["arrow_writes"] = [w.replace(home, "<home>") for w in writes]
            record["lines"] = lines


if __name__ == "__main__":
    _common.main(body)
