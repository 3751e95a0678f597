"""What plain cannot do: the largest model 4 ranks load under a memory cap, plain vs patchload.

    .venv/bin/python benchmarks/bench_memcap.py                 # 8 GiB cap, N = 4 (about 30 min)
    .venv/bin/python benchmarks/bench_memcap.py --cap-gib 8 --no-search   # only the fixed runs

Needs root (it creates a memory cgroup). The ranks of each run (torchrun and every process it
starts) run inside a fresh memory cgroup capped at ``--cap-gib``: cgroup v2 ``memory.max`` where
the memory controller is on the unified hierarchy, else cgroup v1 ``memory.limit_in_bytes``
(printed at the start). The loopback hub and this script stay outside, so the kernel's OOM killer,
which only picks processes of the cgroup that went over its limit, never reaches them. After each
run every process left in the cgroup is killed and the cgroup removed.

1. Fixed runs, plain and patched under the same cap, each reporting whether every rank
   finished, which ranks the OOM killer killed (exit -9 in torchrun's summary), the peak of the
   cgroup's memory usage (v1 ``memory.max_usage_in_bytes``, v2 ``memory.peak``; page cache and
   the shared memfd included) and the time: a bf16 checkpoint loaded as fp32 and an fp32 one loaded
   as bf16 (``benchmarks/_load_worker.py``), of ``--fixed-gb`` GB of loaded weights, and the
   demo's training job (``examples/train_causal_lm_ddp.py`` on the demo's 491 MB bf16 Llama, as
   fp32, one DDP step).
2. A bisection over the synthetic Llama's size (hidden 1024, its number of layers) for the
   largest bf16 checkpoint each mode loads as fp32 under the cap, between ``--min-gb`` and
   ``--max-gb`` GB of loaded weights; the ratio patched / plain of those sizes.

The caches are warm (downloaded once outside the cgroup), so the figures are load figures.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_load import warm  # noqa: E402
from demo import measure  # noqa: E402
from demo.models import layers_for, llama_repo, llama_spec, param_count  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_load_worker.py"
EXAMPLE = measure.REPO_ROOT / "examples" / "train_causal_lm_ddp.py"
HIDDEN = 1024
_EXIT_RE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank[^)]*\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


class MemoryCgroup:
    """A fresh memory cgroup with a hard limit, for the processes of one run."""

    V1_ROOT = Path("/sys/fs/cgroup/memory")
    V2_ROOT = Path("/sys/fs/cgroup")

    def __init__(self, limit_bytes: int) -> None:
        name = f"patchload-bench-{uuid.uuid4().hex[:8]}"
        if (self.V2_ROOT / "cgroup.controllers").exists() and "memory" in (
                self.V2_ROOT / "cgroup.controllers").read_text().split():
            self.version = 2
            self.path = self.V2_ROOT / name
            self.path.mkdir()
            (self.path / "memory.max").write_text(str(limit_bytes))
            (self.path / "memory.swap.max").write_text("0")
        elif self.V1_ROOT.is_dir():
            self.version = 1
            self.path = self.V1_ROOT / name
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        else:
            raise RuntimeError("no memory cgroup controller found (v1 or v2)")

    @classmethod
    def describe(cls) -> str:
        probe = cls(1 << 40)
        try:
            return (f"cgroup v{probe.version} ("
                    f"{'memory.max' if probe.version == 2 else 'memory.limit_in_bytes'})")
        finally:
            probe.remove()

    def peak_bytes(self) -> int:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError):
            return -1

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def remove(self) -> None:
        """Kill every process left in the cgroup, then remove it (bounded: 30 s)."""
        deadline = time.time() + 30
        while self.pids() and time.time() < deadline:
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        while time.time() < deadline:
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"could not remove {self.path}: {self.pids()} still in it")


def run_capped(label: str, script: Path, args: list[str], *, nproc: int, env: dict[str, str],
               cap_bytes: int, timeout_s: float, release: Any = None) -> dict[str, Any]:
    """One torchrun job inside a fresh capped cgroup: finished?, OOM-killed ranks, peak, time."""
    cgroup = MemoryCgroup(cap_bytes)
    wrapper = ["sh", "-c", f'echo $$ > "{cgroup.path / "cgroup.procs"}" && exec "$@"', "sh"]
    try:
        run = measure.torchrun(label, script, args, nproc=nproc, env=env,
                               measure_dir=Path(env.get("PATCHLOAD_MEASURE_DIR", ".")),
                               timeout_s=timeout_s, during=release, wrapper=wrapper)
    finally:
        peak = cgroup.peak_bytes()  # the high-water mark outlives the processes
        cgroup.remove()
    rc = None if run.output.rstrip().endswith("timeout") else run.returncode
    output, elapsed = run.output, run.wall_s
    results = measure.results(run)
    killed = sorted({int(r) for r, code in _EXIT_RE.findall(output) if code == "-9"})
    return {"label": label, "finished": rc == 0 and sorted(results) == list(range(nproc)),
            "timed_out": rc is None, "oom_killed": killed, "peak": peak, "seconds": elapsed,
            "results": results, "tail": "\n".join(output.splitlines()[-8:])}


def load_job(label: str, repo_id: str, dtype: str, *, hub: Any, hf_home: Path, work: Path,
             patched: bool, nproc: int, cap_bytes: int) -> dict[str, Any]:
    shutil.rmtree(work, ignore_errors=True)
    sync = work / "sync"
    sync.mkdir(parents=True)
    env = measure.run_env(endpoint=hub.endpoint, hf_home=hf_home, measure_dir=work / "measure",
                          patchload_on=patched)

    def release(proc: Any, deadline: float) -> None:
        while not all((sync / f"imported-{r}").exists() for r in range(nproc)):
            if proc.poll() is not None or time.time() > deadline:
                return
            time.sleep(0.01)
        (sync / "go").write_text("go")

    return run_capped(label, WORKER, ["--model", repo_id, "--dtype", dtype, "--sync-dir",
                                      str(sync)], nproc=nproc, env=env, cap_bytes=cap_bytes,
                      timeout_s=900, release=release)


def _line(r: dict[str, Any]) -> str:
    return (f"{'finished' if r['finished'] else 'FAILED'}"
            f"{' (timed out)' if r['timed_out'] else ''}, OOM-killed ranks "
            f"{r['oom_killed'] or 'none'}, cgroup peak {r['peak'] / 2**30:.2f} GiB, "
            f"{r['seconds']:.1f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-gib", type=float, default=8.0)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--fixed-gb", type=float, default=2.0,
                        help="loaded size of the fixed converting runs, GB")
    parser.add_argument("--min-gb", type=float, default=0.25)
    parser.add_argument("--max-gb", type=float, default=6.0)
    parser.add_argument("--no-search", action="store_true")
    parser.add_argument("--out", type=Path, default=measure.REPO_ROOT / "demo-out")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_memcap needs root (it creates a memory cgroup)")
        return 2
    out = args.out.resolve()
    cap = int(args.cap_gib * 2**30)
    print(f"memory cap {args.cap_gib:g} GiB through {MemoryCgroup.describe()}, N = {args.nproc}",
          flush=True)

    def repo(loaded_gb: float, dtype: str, load_dtype: str) -> tuple[str, Path, float]:
        per_param = 4 if load_dtype == "float32" else 2
        layers = layers_for(loaded_gb * 1e9 / per_param, hidden=HIDDEN, dtype=dtype)
        spec = llama_spec(hidden=HIDDEN, layers=layers, dtype=dtype)
        name = f"llama-h{HIDDEN}-l{layers}-{dtype}"
        folder = llama_repo(out / "repos" / name, spec)
        return f"bench/{name}", folder, param_count(spec) * per_param / 1e9

    rows: list[list[str]] = []
    work = out / "bench-memcap"
    fixed = [("bf16 -> fp32", "bfloat16", "float32"), ("fp32 -> bf16", "float32", "bfloat16")]
    repos = {key: repo(args.fixed_gb, ckpt, load) for key, ckpt, load in fixed}
    from demo.run import LLAMA_ID  # the demo's own model
    demo_folder = llama_repo(out / "repos" / "llama-500m",
                             llama_spec(hidden=1024, layers=14, dtype="bfloat16"))
    served = {rid: folder for rid, folder, _ in repos.values()}
    served[LLAMA_ID] = demo_folder
    with measure.serve(served, out / "bench-memcap-hub.jsonl") as hub:
        hf_home = work / "hf"
        shutil.rmtree(hf_home, ignore_errors=True)
        warm(list(served), hub.endpoint, hf_home)
        for what, _, load in fixed:
            repo_id, _, loaded = repos[what]
            for patched in (False, True):
                mode = "patchload" if patched else "plain"
                r = load_job(f"{what} {mode}", repo_id, load, hub=hub, hf_home=hf_home,
                             work=work / "run", patched=patched, nproc=args.nproc, cap_bytes=cap)
                print(f"- {what}, {loaded:.2f} GB loaded, {mode}: {_line(r)}", flush=True)
                rows.append([f"{what}, {loaded:.2f} GB loaded", mode, *(_line(r).split(", ", 1))])
        for patched in (False, True):
            mode = "patchload" if patched else "plain"
            env = measure.run_env(endpoint=hub.endpoint, hf_home=hf_home,
                                  measure_dir=work / "measure", patchload_on=patched)
            r = run_capped(f"demo job {mode}", EXAMPLE, ["--model", LLAMA_ID, "--steps", "1",
                                                        "--seq-len", "16"],
                           nproc=args.nproc, env=env, cap_bytes=cap, timeout_s=900)
            print(f"- demo training job, {mode}: {_line(r)}", flush=True)
            rows.append(["demo training job (982 MB fp32)", mode, *(_line(r).split(", ", 1))])

        largest: dict[str, float] = {}
        if not args.no_search:
            lo_layers = layers_for(args.min_gb * 1e9 / 4, hidden=HIDDEN, dtype="bfloat16")
            hi_layers = layers_for(args.max_gb * 1e9 / 4, hidden=HIDDEN, dtype="bfloat16")
            for patched in (False, True):
                mode = "patchload" if patched else "plain"
                lo, hi, best = lo_layers, hi_layers, None
                while lo <= hi:
                    mid = (lo + hi) // 2
                    spec = llama_spec(hidden=HIDDEN, layers=mid, dtype="bfloat16")
                    name = f"llama-h{HIDDEN}-l{mid}-bfloat16"
                    repo_id, loaded = f"bench/{name}", param_count(spec) * 4 / 1e9
                    folder = llama_repo(out / "repos" / name, spec)
                    hub.add_repo(repo_id, folder)
                    warm([repo_id], hub.endpoint, hf_home)
                    r = load_job(f"search {mode} {loaded:.2f} GB", repo_id, "float32", hub=hub,
                                 hf_home=hf_home, work=work / "run", patched=patched,
                                 nproc=args.nproc, cap_bytes=cap)
                    # A step's checkpoint is on disk twice (repo, cache): a search of several
                    # GB-sized steps fills a disk unless each step removes its own.
                    shutil.rmtree(folder)
                    shutil.rmtree(hf_home / "hub" / f"models--bench--{name}")
                    print(f"- search, {mode}, {loaded:.2f} GB loaded (bf16 -> fp32): {_line(r)}",
                          flush=True)
                    if r["finished"]:
                        best, lo = loaded, mid + 1
                    else:
                        hi = mid - 1
                largest[mode] = best or 0.0
    print(f"\nMemory cap {args.cap_gib:g} GiB ({MemoryCgroup.describe()}), {args.nproc} ranks, "
          "warm cache:\n")
    print(measure.markdown_table(["job", "mode", "every rank finished", "OOM-killed, peak, time"],
                                 rows))
    if largest:
        ratio = largest["patchload"] / largest["plain"] if largest["plain"] else float("inf")
        print(f"\nLargest bf16 checkpoint loaded as fp32 by {args.nproc} ranks under "
              f"{args.cap_gib:g} GiB (bisection over {args.min_gb:g}-{args.max_gb:g} GB): plain "
              f"{largest['plain']:.2f} GB, patchload {largest['patchload']:.2f} GB "
              f"(patchload / plain {ratio:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
