"""Load benchmark: plain ``from_pretrained`` vs patchload (collective, shm) under torchrun on CPU.

    .venv/bin/python benchmarks/bench_load.py                  # quick: ~250 MB fp32 model
    .venv/bin/python benchmarks/bench_load.py --size-mb 1000   # the ~1 GB (fp32) model

For N ranks in ``--nproc`` (2 and 4) and three cases, (a) fp32 checkpoint loaded as fp32, (b) bf16
checkpoint loaded as fp32, (c) fp32 checkpoint loaded as bf16, runs ``benchmarks/_load_worker.py``
plain (``PATCHLOAD=0``), with ``PATCHLOAD_TRANSPORT=collective`` and with the default transport
(shm). The checkpoints are random Llama-architecture repos (cached under ``demo-out/repos``)
served by a loopback hub; the cache is warmed once before the runs, so the figures are load
figures, not download figures.

Columns (one markdown table):

* ready: seconds from releasing the ranks (all imported, waiting on a file barrier) until the last
  rank's ``from_pretrained`` returned.
* peak mem: peak of node memory in use (``MemTotal - MemAvailable``, sampled every 50 ms) during
  the load, minus its value at the release, divided by the loaded model's bytes. Clean page-cache
  pages (a zero-copy mapping of the checkpoint file) are reclaimable and do not count here.
* PSS: the growth of the ranks' summed proportional set size (``psutil.memory_full_info().pss``)
  from just before the load to once every rank has loaded and read all of its weights (hashed
  them), divided by the loaded model's bytes: shared pages, file-backed ones included, count once
  in all.
* read/rank: checkpoint tensor bytes each rank materialised from safetensors, in MiB.
* requests: hub requests per rank (the warm cache still makes plain ranks check for updates).
* same: every rank's weights hash equals the plain run's.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from demo import measure  # noqa: E402
from demo.models import checkpoint_bytes, layers_for, llama_repo, llama_spec  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_load_worker.py"
CASES = [("a", "float32", "float32"), ("b", "bfloat16", "float32"), ("c", "float32", "bfloat16")]
MODES = [("plain", {"PATCHLOAD": "0"}), ("collective", {"PATCHLOAD_TRANSPORT": "collective"}),
         ("shm (default)", {})]


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
        timeout_s: float) -> dict[str, Any]:
    shutil.rmtree(work, ignore_errors=True)
    sync = work / "sync"
    sync.mkdir(parents=True)
    env = measure.run_env(endpoint=hub.endpoint, hf_home=hf_home, measure_dir=work / "measure",
                          patchload_on=True, extra=extra_env)
    marks: dict[str, float] = {}

    def release(proc: Any, deadline: float) -> None:
        imported = [sync / f"imported-{r}" for r in range(nproc)]
        while not all(p.exists() for p in imported):
            if proc.poll() is not None or time.time() > deadline:
                return
            time.sleep(0.01)
        time.sleep(0.3)  # let the last imports' memory settle
        marks["baseline"] = measure.node_memory_used()
        marks["go"] = time.time()
        hub.clear_requests()
        (sync / "go").write_text("go")

    run = measure.torchrun(label, WORKER, ["--model", repo_id, "--dtype", dtype,
                                           "--sync-dir", str(sync)],
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
    return {
        "ok": True, "ready_s": ready - marks["go"],
        "peak_x": (sampler.peak(marks["go"], ready) - marks["baseline"]) / loaded,
        "pss_x": sum(r["pss"] - r["pss_before"] for r in results.values()) / loaded,
        "read": [figures.get(r, {}).get("checkpoint_tensor_bytes") for r in range(nproc)],
        "requests": [requests[r] for r in range(nproc)],
        "sha": [results[r]["weights_sha256"] for r in range(nproc)], "loaded": loaded,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=250,
                        help="model size in fp32, in MB (default 250; the full benchmark: 1000)")
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cases", nargs="+", default=[c[0] for c in CASES],
                        choices=[c[0] for c in CASES])
    parser.add_argument("--out", type=Path, default=measure.REPO_ROOT / "demo-out")
    parser.add_argument("--timeout", type=float, default=600, help="per run, in seconds")
    args = parser.parse_args()
    out = args.out.resolve()

    repos = repos_for(args.size_mb, out)
    sizes = {d: checkpoint_bytes(folder) for d, (_, folder) in repos.items()}
    print(f"checkpoints: fp32 {sizes['float32'] / 1e6:.0f} MB, "
          f"bf16 {sizes['bfloat16'] / 1e6:.0f} MB", flush=True)
    rows = []
    failed = False
    bench = out / "bench"
    with measure.serve({rid: folder for rid, folder in repos.values()},
                       out / "bench-hub.jsonl") as hub, measure.MemorySampler() as sampler:
        hf_home = bench / "hf"
        shutil.rmtree(hf_home, ignore_errors=True)
        warm([rid for rid, _ in repos.values()], hub.endpoint, hf_home)
        for case, ckpt, load in CASES:
            if case not in args.cases:
                continue
            repo_id = repos[ckpt][0]
            for nproc in args.nproc:
                plain_sha = None
                for mode, env in MODES:
                    label = f"({case}) {ckpt}->{load} N={nproc} {mode}"
                    print(f"- {label}", flush=True)
                    r = one(label, repo_id, load, nproc, env, hub=hub, hf_home=hf_home,
                            work=bench / "run", sampler=sampler, timeout_s=args.timeout)
                    time.sleep(0.5)
                    if not r["ok"]:
                        failed = True
                        rows.append([f"({case}) {ckpt} -> {load}", nproc, mode] + ["FAILED"] * 6)
                        continue
                    if mode == "plain":
                        plain_sha = r["sha"]
                    same = plain_sha is not None and r["sha"] == plain_sha
                    failed |= not same
                    rows.append([
                        f"({case}) {ckpt} -> {load}", nproc, mode, f"{r['ready_s']:.2f} s",
                        f"{r['peak_x']:.2f}x", f"{r['pss_x']:.2f}x",
                        " / ".join("?" if b is None else f"{b / 2**20:.0f}" for b in r["read"]),
                        " / ".join(str(n) for n in r["requests"]), "yes" if same else "NO"])
                    print(f"    ready {r['ready_s']:.2f} s, peak {r['peak_x']:.2f}x, "
                          f"PSS {r['pss_x']:.2f}x", flush=True)
    print(f"\nModel: fp32 checkpoint {sizes['float32'] / 1e6:.0f} MB, bf16 checkpoint "
          f"{sizes['bfloat16'] / 1e6:.0f} MB; memory figures are multiples of the loaded "
          f"model's bytes.\n")
    print(measure.markdown_table(
        ["case", "N", "mode", "ready", "peak mem", "PSS", "read/rank (MiB)", "requests/rank",
         "same"], rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
