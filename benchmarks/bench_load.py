"""Load benchmark: plain ``from_pretrained`` vs patchload (collective, shm) under torchrun on CPU.

    .venv/bin/python benchmarks/bench_load.py                  # quick: ~250 MB fp32 model
    .venv/bin/python benchmarks/bench_load.py --size-mb 1000   # the ~1 GB (fp32) model
    .venv/bin/python benchmarks/bench_load.py --tiny           # ~8 MB + tokenizer, N=3, cold
    .venv/bin/python benchmarks/bench_load.py --size-mb 1080 --cases a --process-group --runs 5
                                    # issue 29's zero-copy case: process group first, barrier after

For N ranks in ``--nproc`` (2 and 4) and three cases, (a) fp32 checkpoint loaded as fp32, (b) bf16
checkpoint loaded as fp32, (c) fp32 checkpoint loaded as bf16, runs ``benchmarks/_load_worker.py``
plain (``PATCHLOAD=0``) and with the default transport (shm; ``--modes`` adds ``collective``),
``--runs`` times each (3), the modes interleaved, and shows medians. The checkpoints are random
Llama-architecture repos (cached under ``demo-out/repos``) served by a loopback hub; the cache is
warmed once before the runs, so the figures are load figures, not download figures. ``--tiny``
instead loads a tiny bf16 Llama's tokenizer and then the model, 3 ranks, each run on a cold cache
(downloads included).

Columns (one markdown table):

* ready: seconds from releasing the ranks (all imported, waiting on a file barrier) until the last
  rank's ``from_pretrained`` returned (with ``--process-group``: until the ``dist.barrier()``
  after it returned on every rank); (ratio) patched / plain.
* peak mem: peak of node memory in use (``MemTotal - MemAvailable``, sampled every 50 ms) during
  the load, minus its value at the release, divided by the loaded model's bytes. Clean page-cache
  pages (a zero-copy mapping of the checkpoint file) are reclaimable and do not count here.
* PSS: the growth of the ranks' summed proportional set size (``psutil.memory_full_info().pss``)
  from just before the load to once every rank has loaded and read all of its weights (hashed
  them), divided by the loaded model's bytes: shared pages, file-backed ones included, count once
  in all.
* follower lag p50: how long after the leader's ``from_pretrained`` returned (it publishes its
  outcome just before) each follower's returned, median over the followers of every run.
* read/rank: checkpoint tensor bytes each rank materialised from safetensors, in MiB.
* requests: hub requests per rank (the warm cache still makes plain ranks check for updates).
* same: every rank's weights hash equals the plain run's.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from demo import measure  # noqa: E402
from demo.models import checkpoint_bytes, layers_for, llama_repo, llama_spec  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_load_worker.py"
CASES = [("a", "float32", "float32"), ("b", "bfloat16", "float32"), ("c", "float32", "bfloat16")]
MODES = {"plain": {"PATCHLOAD": "0"}, "collective": {"PATCHLOAD_TRANSPORT": "collective"},
         "shm": {}}
TINY_REPO = "bench/llama-tiny-bf16"


def repos_for(size_mb: float, out: Path) -> dict[str, tuple[str, Path]]:
    """checkpoint dtype -> (repo id, folder) for a model of ~``size_mb`` MB in fp32."""
    params = size_mb * 1e6 / 4
    hidden = 1024 if params >= 150e6 else 512
    layers = layers_for(params, hidden=hidden, dtype="float32")
    repos = {}
    for dtype in ("float32", "bfloat16"):
        spec = llama_spec(hidden=hidden, layers=layers, dtype=dtype)
        name = f"llama-h{hidden}-l{layers}-{dtype}"
        repos[dtype] = (f"bench/{name}", llama_repo(out / "repos" / name, spec))
    return repos


def warm(repo_ids: list[str], endpoint: str, hf_home: Path) -> None:
    """Download every repo into ``hf_home`` once (in a child process: the hub env is frozen at
    huggingface_hub's import)."""
    import os
    import subprocess

    env = {**os.environ, "HF_HOME": str(hf_home), "HF_ENDPOINT": endpoint,
           "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PATCHLOAD": "0"}
    code = ("import sys\nfrom huggingface_hub import snapshot_download\n"
            "for r in sys.argv[1:]: snapshot_download(r)")
    subprocess.run([sys.executable, "-c", code, *repo_ids], env=env, check=True, timeout=600)


def one(label: str, repo_id: str, dtype: str, nproc: int, extra_env: dict[str, str], *,
        hub: Any, hf_home: Path, work: Path, sampler: measure.MemorySampler,
        timeout_s: float, tokenizer: bool = False, process_group: bool = False
        ) -> dict[str, Any]:
    shutil.rmtree(work, ignore_errors=True)
    sync = work / "sync"
    sync.mkdir(parents=True)
    env = measure.run_env(endpoint=hub.endpoint, hf_home=hf_home, measure_dir=work / "measure",
                          patchload_on=True, extra=extra_env)
    marks: dict[str, float] = {}

    release = measure.release_when_imported(sync, nproc, hub, marks)
    run = measure.torchrun(label, WORKER, ["--model", repo_id, "--dtype", dtype,
                                           "--sync-dir", str(sync)]
                           + (["--tokenizer"] if tokenizer else [])
                           + (["--process-group"] if process_group else []),
                           nproc=nproc, env=env, measure_dir=work / "measure",
                           timeout_s=timeout_s, during=release)
    results = measure.results(run)
    figures = measure.rank_figures(run)
    ok = run.returncode == 0 and sorted(results) == list(range(nproc)) and "go" in marks
    if not ok:
        (work / "output.log").write_text(run.output)
        print(f"    FAILED (exit {run.returncode}); log: {work / 'output.log'}")
        print("    " + "\n    ".join(run.output.splitlines()[-15:]))
        return {"ok": False}
    ready = max(r["ready_at"] for r in results.values())
    loaded = results[0]["loaded_bytes"]
    requests = {r: 0 for r in range(nproc)}
    for req in hub.requests():
        if req.rank is not None:
            requests[req.rank] = requests.get(req.rank, 0) + 1
    read = [figures.get(r, {}).get("checkpoint_tensor_bytes") for r in range(nproc)]
    readers = [r for r in range(nproc) if read[r]]
    lags = []
    if len(readers) == 1:  # one rank read the checkpoint: the others followed it
        leader_ready = results[readers[0]]["ready_at"]
        lags = [results[r]["ready_at"] - leader_ready for r in range(nproc) if r != readers[0]]
    return {
        "ok": True, "ready_s": ready - marks["go"],
        "peak_x": (sampler.peak(marks["go"], ready) - marks["baseline"]) / loaded,
        "pss_x": sum(r["pss"] - r["pss_before"] for r in results.values()) / loaded,
        "read": read, "requests": [requests[r] for r in range(nproc)], "lags": lags,
        "sha": [results[r]["weights_sha256"] for r in range(nproc)], "loaded": loaded,
    }


def _ratio(value: float, plain: float | None) -> str:
    return "" if plain is None or plain <= 0 else f" ({value / plain:.2f})"


def _row(what: str, nproc: int, mode: str, runs: list[dict[str, Any]],
         plain: dict[str, float] | None, plain_sha: Any) -> tuple[list[Any], bool]:
    """One table row of medians over ``runs``; ``plain``: the plain row's medians (ratios)."""
    ok = [r for r in runs if r["ok"]]
    if len(ok) < len(runs) or not ok:
        return [what, nproc, mode, f"{len(runs) - len(ok)} of {len(runs)} FAILED"] + [""] * 6, \
            False
    ready = statistics.median(r["ready_s"] for r in ok)
    peak = statistics.median(r["peak_x"] for r in ok)
    pss = statistics.median(r["pss_x"] for r in ok)
    lags = [lag for r in ok for lag in r["lags"]]
    same = all(r["sha"] == plain_sha for r in ok) if plain_sha is not None else True
    last = ok[-1]
    return [
        what, nproc, mode,
        f"{ready:.2f} s" + ("" if plain is None else _ratio(ready, plain["ready"])),
        f"{peak:.2f}x" + ("" if plain is None else _ratio(peak, plain["peak"])),
        f"{pss:.2f}x",
        f"{statistics.median(lags) * 1000:.0f} ms" if lags and mode != "plain" else "-",
        " / ".join("?" if b is None else f"{b / 2**20:.0f}" for b in last["read"]),
        " / ".join(str(n) for n in last["requests"]), "yes" if same else "NO"], same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=250,
                        help="model size in fp32, in MB (default 250; the full benchmark: 1000)")
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cases", nargs="+", default=[c[0] for c in CASES],
                        choices=[c[0] for c in CASES])
    parser.add_argument("--modes", nargs="+", default=["plain", "shm"], choices=list(MODES),
                        help="plain is always run (the ratios' reference)")
    parser.add_argument("--runs", type=int, default=3, help="runs per row (medians shown)")
    parser.add_argument("--tiny", action="store_true",
                        help="instead: a ~8 MB bf16 Llama plus its tokenizer, 3 ranks, cold cache")
    parser.add_argument("--process-group", action="store_true",
                        help="each rank joins a gloo process group before the load (patchload's "
                        "store is then the group's) and a barrier ends the timed load")
    parser.add_argument("--out", type=Path, default=measure.REPO_ROOT / "demo-out")
    parser.add_argument("--timeout", type=float, default=600, help="per run, in seconds")
    args = parser.parse_args()
    out = args.out.resolve()
    modes = ["plain"] + [m for m in args.modes if m != "plain"]

    if args.tiny:
        spec = llama_spec(hidden=64, layers=2, dtype="bfloat16")
        repos = {"bfloat16": (TINY_REPO, llama_repo(out / "repos" / "llama-tiny-bf16", spec))}
        configs = [("tiny bf16 -> bf16 + tokenizer, cold cache", repos["bfloat16"][0],
                    "bfloat16", 3)]
    else:
        repos = repos_for(args.size_mb, out)
        configs = [(f"({case}) {ckpt} -> {load}", repos[ckpt][0], load, nproc)
                   for case, ckpt, load in CASES if case in args.cases for nproc in args.nproc]
    sizes = {d: checkpoint_bytes(folder) for d, (_, folder) in repos.items()}
    print("checkpoints: " + ", ".join(f"{d} {b / 1e6:.1f} MB" for d, b in sizes.items()),
          flush=True)
    rows = []
    failed = False
    bench = out / "bench"
    with measure.serve({rid: folder for rid, folder in repos.values()},
                       out / "bench-hub.jsonl") as hub, measure.MemorySampler() as sampler:
        warm_home = bench / "hf"
        if not args.tiny:
            shutil.rmtree(warm_home, ignore_errors=True)
            warm([rid for rid, _ in repos.values()], hub.endpoint, warm_home)
        for what, repo_id, load, nproc in configs:
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
            for i in range(args.runs):  # modes interleaved: drift spreads over all of them
                for mode in modes:
                    label = f"{what} N={nproc} {mode} run {i + 1}"
                    print(f"- {label}", flush=True)
                    hf_home = warm_home
                    if args.tiny:  # a cold cache per run
                        hf_home = bench / "hf-cold"
                        shutil.rmtree(hf_home, ignore_errors=True)
                    r = one(label, repo_id, load, nproc, MODES[mode], hub=hub, hf_home=hf_home,
                            work=bench / "run", sampler=sampler, timeout_s=args.timeout,
                            tokenizer=args.tiny, process_group=args.process_group)
                    runs[mode].append(r)
                    time.sleep(0.5)
                    if r["ok"]:
                        print(f"    ready {r['ready_s']:.2f} s, peak {r['peak_x']:.2f}x, "
                              f"PSS {r['pss_x']:.2f}x, lags "
                              f"{[round(x * 1000) for x in r['lags']]} ms", flush=True)
            plain_ok = [r for r in runs["plain"] if r["ok"]]
            plain = None
            plain_sha = plain_ok[0]["sha"] if plain_ok else None
            if plain_ok:
                plain = {"ready": statistics.median(r["ready_s"] for r in plain_ok),
                         "peak": statistics.median(r["peak_x"] for r in plain_ok)}
            for mode in modes:
                row, same = _row(what, nproc, mode, runs[mode],
                                 None if mode == "plain" else plain, plain_sha)
                failed |= not same or "FAILED" in str(row[3])
                rows.append(row)
    print("\nCheckpoints: " + ", ".join(f"{d} {b / 1e6:.1f} MB" for d, b in sizes.items())
          + f"; medians of {args.runs} runs per row; (ratio) = patched / plain; memory figures "
          "are multiples of the loaded model's bytes.\n")
    print(measure.markdown_table(
        ["case", "N", "mode", "ready", "peak mem", "PSS", "follower lag p50", "read/rank (MiB)",
         "requests/rank", "same"], rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
