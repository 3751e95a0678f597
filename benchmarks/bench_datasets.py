"""Datasets: ``load_dataset`` then ``Dataset.map`` under torchrun, plain vs patchload in one run.

    .venv/bin/python benchmarks/bench_datasets.py                     # ~200 MB parquet, 4 ranks
    .venv/bin/python benchmarks/bench_datasets.py --mb 20 --nproc 2   # quick check
    .venv/bin/python benchmarks/bench_datasets.py --cache warm        # the warm cache alone
    .venv/bin/python benchmarks/bench_datasets.py --layout per-rank   # each rank its own HF_HOME

A dataset repo of parquet shards (random lowercase words in a ``text`` column, with ``id`` and
``label`` int64 columns; ``--mb`` MB of text in all, seed 0, made once under
``--out``/repos) is served as a dataset repo by a loopback hub. Each run launches
``benchmarks/_datasets_worker.py`` on ``--nproc`` ranks, all on one ``HF_HOME`` (made empty
before the run, shared by the run's ranks): ``datasets.load_dataset(repo)``, then
``train.map(tokenize, batched=True)`` (whitespace words, ids of the first 128; pure Python).

``--cache`` (default ``both``) picks the ``HF_HOME`` a run starts on. COLD: empty. WARM: right
before the measured launch, one plain (``PATCHLOAD=0``) launch of the same worker on 1 rank and
the same ``HF_HOME`` downloads and prepares the dataset and writes the map's cache file (not
measured; the hub's request log is cleared at the measured release), so the measured ranks
find the prepared Arrow files and the map's cache file. Plain and patched runs are
interleaved (per round: cold plain, cold patched, warm plain, warm patched), ``--runs``
rounds (1); medians.

``--layout`` (default ``shared``): ``per-rank`` gives each rank its own ``HF_HOME``
(``HF_HOME``/rank-N, all made empty before the run; the warm-up then launches ``--nproc`` plain
ranks, one filling each). Plain ranks then each download and prepare the dataset; so do
patchload's ranks: ranks whose caches differ never share a call (each would otherwise read
another cache than its own), so every rank is its own leader.

Figures (a markdown table per cache, the same figures in each; the ratio is patchload / plain,
of the totals over ranks where a figure is per rank):

* hub requests / rank: requests the loopback hub answered to each rank (``origin/rank-N`` in
  the User-Agent), from the release of the ranks to the end of the run.
* downloaded / rank: body bytes the hub sent each rank, in MB (10^6 bytes).
* datasets ready: seconds from the release of the ranks (all imported, waiting on a file
  barrier) until the last rank's ``load_dataset`` returned.
* map: seconds from the ranks leaving a file barrier after the load until the last rank's
  ``map`` returned.
* map calls / rank: how many times each rank's process called the map function (batches of
  1000 rows).
* peak node memory: the peak of node memory in use (``MemTotal - MemAvailable``, sampled every
  50 ms) from the release to the end of the run, minus its value at the release, in MiB.
  Page cache (the parquet and Arrow files, memory-mapped) does not count. The two rows below
  it are the same peak over the load alone (release to the last ``load_dataset`` return) and
  over the map alone (first ``map`` start to last return), both from the same baseline; a
  window that holds no sample (a warm map takes about 20 ms) counts the last one before it.
* same as plain: every rank's loaded train split and mapped dataset have the fingerprint, row
  count and sha256 of three rows of the same rank in the first plain run on the same cache.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from demo import measure  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_datasets_worker.py"
MODES = ("plain", "patchload")
CACHES = ("cold", "warm")


def parquet_repo(folder: Path, *, mb: float, shards: int = 4, seed: int = 0) -> Path:
    """A dataset repo folder of ``shards`` parquet files holding ``mb`` MB of text in all (made
    once: a complete folder holds a ``.done`` marker)."""
    if (folder / ".done").exists():
        return folder
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    shutil.rmtree(folder, ignore_errors=True)
    (folder / "data").mkdir(parents=True)
    # 26 letters and 6 spaces: words of ~4 letters; bytes straight into an Arrow string array
    # (a Python loop over 200 MB of words would take minutes on 2 cores).
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz      ", dtype=np.uint8)
    rng = np.random.default_rng(seed)
    per_shard = int(mb * 1e6 / shards)
    for s in range(shards):
        lengths = rng.integers(200, 1800, size=per_shard // 1000 + 1)  # ~1000 bytes a row
        lengths = lengths[np.cumsum(lengths) <= per_shard]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        text = alphabet[rng.integers(0, len(alphabet), size=int(offsets[-1]), dtype=np.uint8)]
        n = len(lengths)
        first = s * (per_shard // 200)  # unique ids across shards (rows are >= 200 bytes)
        table = pa.table({
            "id": pa.array(np.arange(first, first + n, dtype=np.int64)),
            "text": pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(text)),
            "label": pa.array(rng.integers(0, 10, size=n, dtype=np.int64)),
        })
        pq.write_table(table, folder / "data" / f"train-{s:05d}-of-{shards:05d}.parquet")
    (folder / ".done").write_text("")
    return folder


def _launch(label: str, repo_id: str, nproc: int, *, patchload_on: bool, hub: Any,
            hf_home: Path, folder: Path, log_dir: Path, timeout_s: float, per_rank: bool = False
            ) -> tuple[measure.Run, dict[int, dict[str, Any]], dict[str, float]] | None:
    """One torchrun launch of the worker on ``hf_home``, released by a file barrier in
    ``folder``/sync: the run, each rank's RESULT (by rank) and the release marks; None if it
    failed (its output then goes to ``log_dir``/LABEL.log)."""
    sync = folder / "sync"
    sync.mkdir(parents=True)
    env = measure.run_env(endpoint=hub.endpoint, hf_home=hf_home, measure_dir=folder / "measure",
                          patchload_on=patchload_on,
                          extra={"HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
                                 "BENCH_DS_PER_RANK_HOME": "1" if per_rank else "0"})
    marks: dict[str, float] = {}
    release = measure.release_when_imported(sync, nproc, hub, marks)
    run = measure.torchrun(label, WORKER, ["--dataset", repo_id, "--sync-dir", str(sync)],
                           nproc=nproc, env=env, measure_dir=folder / "measure",
                           timeout_s=timeout_s, during=release)
    results = measure.results(run)
    if run.returncode != 0 or sorted(results) != list(range(nproc)) or "go" not in marks:
        log = log_dir / f"{label.replace(' ', '-')}.log"
        log.write_text(run.output)
        print(f"- {label}: FAILED (exit {run.returncode}); log: {log}\n    "
              + "\n    ".join(run.output.splitlines()[-15:]))
        return None
    return run, results, marks


def one(mode: str, cache: str, label: str, repo_id: str, nproc: int, *, hub: Any, work: Path,
        sampler: measure.MemorySampler, timeout_s: float, per_rank: bool = False
        ) -> dict[str, Any] | None:
    """One measured torchrun launch on ``HF_HOME`` = ``work``/hf (one path for both modes, so
    that nothing a path decides differs), made empty first; for a ``"warm"`` cache, a plain
    launch of the worker on one rank fills it right before (not measured). Its figures, or None
    if a launch failed."""
    shutil.rmtree(work, ignore_errors=True)
    if cache == "warm" and _launch(f"{label} warm-up", repo_id, nproc if per_rank else 1,
                                   patchload_on=False, hub=hub, hf_home=work / "hf",
                                   folder=work / "warm-up", log_dir=work.parent,
                                   timeout_s=timeout_s, per_rank=per_rank) is None:
        return None
    launched = _launch(label, repo_id, nproc, patchload_on=mode == "patchload", hub=hub,
                       hf_home=work / "hf", folder=work, log_dir=work.parent,
                       timeout_s=timeout_s, per_rank=per_rank)
    if launched is None:
        return None
    run, results, marks = launched
    requests = {r: 0 for r in range(nproc)}
    sent = {r: 0 for r in range(nproc)}
    for req in hub.requests():
        requests[req.rank] = requests.get(req.rank, 0) + 1  # None: a request without a rank
        sent[req.rank] = sent.get(req.rank, 0) + req.bytes_sent
    ranks = [results[r] for r in range(nproc)]

    def peak(start: float, end: float) -> int:
        """Node peak over [start, end] above the release's baseline, in bytes (``at(end)``: a
        window shorter than the sampling period holds no sample; the one before it counts)."""
        return max(sampler.peak(start, end), sampler.at(end)) - marks["baseline"]

    figures = {
        "requests": requests, "bytes": sent,
        "ready_s": max(r["loaded_at"] for r in ranks) - marks["go"],
        "map_s": max(r["map_end"] for r in ranks) - min(r["map_start"] for r in ranks),
        "calls": [r["map_calls"] for r in ranks],
        "peak": peak(marks["go"], run.ended_at),
        "peak_load": peak(marks["go"], max(r["loaded_at"] for r in ranks)),
        "peak_map": peak(min(r["map_start"] for r in ranks), max(r["map_end"] for r in ranks)),
        "content": [(r["loaded"], r["mapped"]) for r in ranks],
    }
    shutil.rmtree(work / "hf", ignore_errors=True)  # a run's caches: ~3x the data on disk
    each = " / ".join(f"{r['loaded_at'] - marks['go']:.2f}" for r in ranks)
    print(f"- {label}: ready {figures['ready_s']:.2f} s (per rank {each}), "
          f"map {figures['map_s']:.2f} s, requests {list(requests.values())}, map calls {figures['calls']}", flush=True)
    return figures


def _per_rank(values: dict[Any, int] | list[int], fmt: Any = str) -> str:
    items = values.items() if isinstance(values, dict) else enumerate(values)
    text = " / ".join(fmt(v) for k, v in items if k is not None)
    if isinstance(values, dict) and values.get(None):
        text += f" (+{fmt(values[None])} without a rank)"
    return text


def _total(values: dict[Any, int] | list[int]) -> int:
    return sum(values.values() if isinstance(values, dict) else values)


def _table(runs: dict[str, list[dict[str, Any]]]) -> tuple[str, bool]:
    """The markdown table of one cache's runs (by mode) and whether every rank's datasets were
    plain's (its first run's rank 0)."""
    def med(mode: str, key: str, f: Any = lambda v: v) -> float:
        return statistics.median(f(r[key]) for r in runs[mode])

    reference = runs["plain"][0]["content"]  # rank by rank
    same = {m: all(r["content"] == reference for r in runs[m]) for m in MODES}
    last = {m: runs[m][-1] for m in MODES}  # per-rank figures: the last run's
    rows = []
    for what, key, shown, total in [
            ("hub requests / rank", "requests", lambda m: _per_rank(last[m]["requests"]), _total),
            ("downloaded / rank (MB)", "bytes",
             lambda m: _per_rank(last[m]["bytes"], lambda v: f"{v / 1e6:.1f}"), _total),
            ("datasets ready (s)", "ready_s", lambda m: f"{med(m, 'ready_s'):.2f}", None),
            ("map (s)", "map_s", lambda m: f"{med(m, 'map_s'):.2f}", None),
            ("map calls / rank", "calls", lambda m: _per_rank(last[m]["calls"]), _total),
            ("peak node memory (MiB)", "peak", lambda m: f"{med(m, 'peak') / 2**20:.0f}", None),
            ("  of it, during the load", "peak_load",
             lambda m: f"{med(m, 'peak_load') / 2**20:.0f}", None),
            ("  of it, during the map", "peak_map",
             lambda m: f"{med(m, 'peak_map') / 2**20:.0f}", None)]:
        plain, patched = (med(m, key, total or (lambda v: v)) for m in MODES)
        ratio = f"{patched / plain:.2f}" if plain > 0 else "-"
        rows.append([what, shown("plain"), shown("patchload"), ratio])
    rows.append(["same as plain", "yes" if same["plain"] else "NO",
                 "yes" if same["patchload"] else "NO", ""])
    table = measure.markdown_table(["figure", "plain", "patchload", "patchload / plain"], rows)
    return table, all(same.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0, help="MB of text in the parquet repo")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--cache", choices=("cold", "warm", "both"), default="both",
                        help="the HF_HOME a measured run starts on (both: a table for each)")
    parser.add_argument("--layout", choices=("shared", "per-rank"), default="shared",
                        help="one HF_HOME for the run's ranks, or one per rank")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    parser.add_argument("--out", type=Path, default=measure.REPO_ROOT / "demo-out")
    args = parser.parse_args()

    out = args.out.resolve()
    name = f"parquet-{args.mb:g}mb"
    folder = parquet_repo(out / "repos" / name, mb=args.mb)
    files = sorted((folder / "data").glob("*.parquet"))
    size = sum(f.stat().st_size for f in files)
    repo_id = f"bench/{name}"
    print(f"{repo_id}: {len(files)} parquet files, {size / 1e6:.1f} MB; {args.nproc} ranks, "
          f"{args.layout} HF_HOME", flush=True)
    work = out / "bench-datasets"
    caches = CACHES if args.cache == "both" else (args.cache,)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {c: {m: [] for m in MODES} for c in caches}
    failed = False
    with measure.serve({repo_id: folder}, out / "bench-datasets-hub.jsonl",
                       repo_type="dataset") as hub, measure.MemorySampler() as sampler:
        for i in range(args.runs):
            for cache in caches:
                for mode in MODES:
                    figures = one(mode, cache, f"{mode} {cache} run {i + 1}", repo_id,
                                  args.nproc, hub=hub, work=work / "run", sampler=sampler,
                                  timeout_s=args.timeout, per_rank=args.layout == "per-rank")
                    failed |= figures is None
                    if figures is not None:
                        runs[cache][mode].append(figures)
    for cache in caches:
        if not runs[cache]["plain"] or not runs[cache]["patchload"]:
            print(f"\n{cache} cache: no complete pair of runs: no table")
            failed = True
            continue
        table, same = _table(runs[cache])
        failed |= not same
        rows = runs[cache]["plain"][0]["content"][0][0]["num_rows"]
        print(f"\n{repo_id} ({size / 1e6:.0f} MB parquet, {rows} rows), {args.nproc} ranks, "
              f"{args.layout} HF_HOME, {cache} cache, medians of {args.runs} run(s); per-rank figures from the last run, "
              "ratios of their totals:\n")
        print(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
