"""What plain cannot do: the largest model 4 ranks load under a memory cap, plain vs patchload.

    .venv/bin/python benchmarks/bench_memcap.py                 # 8 GiB cap, N = 4 (about 7 min)
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
   the shared memfd included), the time, and each rank's own peak during the load / the loaded
   model (rank 0, the node's leader when patched, and the largest of the other ranks'; two
   figures: the growth of ``VmHWM``, every resident page including the checkpoint file pages the
   rank mapped, and of sampled ``RssAnon + RssShmem``, without them; see
   ``benchmarks/_load_worker.py``): a bf16 checkpoint loaded as fp32 and an fp32 one loaded as
   bf16, of ``--fixed-gb`` GB of loaded weights, and the demo's training job
   (``examples/train_causal_lm_ddp.py`` on the demo's 491 MB bf16 Llama, as fp32, one DDP step).
2. A bisection over the synthetic Llama's size (hidden 1024, its number of layers) for the
   largest bf16 checkpoint each mode loads as fp32 under the cap, between ``--min-gb`` and
   ``--max-gb`` GB of loaded weights, to ``--tolerance-gb`` (0.25 GB, about 5 layers): the
   top of the range first while nothing failed, then the midpoint between the largest size that
   finished and the smallest that failed; the fixed bf16 -> fp32 run is one of its points. The
   ratio patched / plain of those sizes.

The whole default command took 403 s (6.7 min) on the 2-core, 23 GiB machine on 2026-12-06,
with a CI test run sharing it (load average 4-7); the former version took 30-35 min. The caches
are warm, so the figures are load figures. The checkpoints of the runs are written
directly as safetensors, each tensor a window of one seeded random block (``fill="pattern"`` of
:func:`demo.models.llama_repo`: the load's time and memory do not depend on the values); the
demo's model keeps its own initialisation. The loopback hub keeps its own copy of each; the
cache's blobs are hard links to that copy (a download through HTTP where they cannot be), and a
step's checkpoint is deleted (the hub's copy, the cache) after its runs. Where the time goes is
printed at the end. Nothing is left behind: cgroups, processes, checkpoints, the cache (the
demo's model is kept only if it was already in ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
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
    try:  # the ranks that read checkpoint bytes (demo/site/sitecustomize.py, written at exit)
        readers = sorted(r for r, f in measure.rank_figures(run).items()
                         if f.get("checkpoint_tensor_bytes"))
    except (OSError, ValueError, KeyError):
        readers = []
    return {"label": label, "finished": rc == 0 and sorted(results) == list(range(nproc)),
            "timed_out": rc is None, "oom_killed": killed, "peak": peak, "seconds": elapsed,
            "results": results, "readers": readers,
            "tail": "\n".join(output.splitlines()[-8:])}


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
                                      str(sync), "--sample-rss"], nproc=nproc, env=env,
                      cap_bytes=cap_bytes, timeout_s=600, release=release)


def own_peaks(r: dict[str, Any]) -> tuple[str, str]:
    """The leader's own peak during the load and the largest of the other ranks', each / the
    loaded model's bytes, as ``"<VmHWM growth>x / <RssAnon + RssShmem growth>x (rank R)"``
    (``benchmarks/_load_worker.py``). The leader: the one rank that read checkpoint bytes (a
    patched load); rank 0 where every rank read them (plain)."""
    results = r["results"]
    if not results or not all(x.get("loaded_bytes") for x in results.values()):
        return "-", "-"
    loaded = next(iter(results.values()))["loaded_bytes"]
    leader = r["readers"][0] if len(r["readers"]) == 1 else 0
    if leader not in results:
        return "-", "-"

    def cell(ranks: dict[int, dict[str, Any]]) -> str:
        if not ranks or any(x.get("own_peak") is None for x in ranks.values()):
            return "-"
        top = max(ranks, key=lambda k: ranks[k]["own_peak"])
        text = f"{ranks[top]['own_peak'] / loaded:.2f}x"
        anon = [x.get("own_peak_anon_shmem") for x in ranks.values()]
        if None not in anon:
            text += f" / {max(anon) / loaded:.2f}x"
        return f"{text} (rank {top})" if len(ranks) == 1 else text

    return cell({leader: results[leader]}), cell({k: v for k, v in results.items()
                                                  if k != leader})


def _line(r: dict[str, Any]) -> str:
    if not r["finished"] and not r["oom_killed"]:  # not the cap: say what happened
        print("    " + r["tail"].replace("\n", "\n    "), flush=True)
    line = (f"{'finished' if r['finished'] else 'FAILED'}"
            f"{' (timed out)' if r['timed_out'] else ''}, OOM-killed ranks "
            f"{r['oom_killed'] or 'none'}, cgroup peak {r['peak'] / 2**30:.2f} GiB, "
            f"{r['seconds']:.1f} s")
    leader, followers = own_peaks(r)
    if leader != "-":
        line += f", own peak / model (VmHWM / anon+shm): leader {leader}, others {followers}"
    return line


def _row(job: str, mode: str, r: dict[str, Any]) -> list[str]:
    return [job, mode, "yes" if r["finished"] else ("no (timed out)" if r["timed_out"] else "no"),
            ", ".join(map(str, r["oom_killed"])) or "none", f"{r['peak'] / 2**30:.2f} GiB",
            f"{r['seconds']:.1f} s", *own_peaks(r)]


class Timer:
    """Seconds spent per phase of the command (building checkpoints, the hub's copy, the cache,
    the runs)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def __call__(self, phase: str) -> Any:
        timer = self

        class _Span:
            def __enter__(self) -> None:
                self.start = time.time()

            def __exit__(self, *exc: object) -> None:
                timer.spent[phase] = timer.spent.get(phase, 0.0) + time.time() - self.start

        return _Span()


def cache_from_hub(hub: Any, repo_ids: list[str], hf_home: Path) -> str:
    """Put ``repo_ids`` into the Hugging Face cache at ``hf_home`` as a download from ``hub``
    would (``blobs/<etag>``, ``snapshots/<commit>/<path>`` links, ``refs/main``), the blobs
    hard links to the hub's own copies: no second copy of GBs through HTTP. Falls back to a real
    download (:func:`benchmarks.bench_load.warm`) where a link cannot be made (another file
    system). Returns how the cache was filled."""
    try:
        for repo_id in repo_ids:
            commit = hub.commit_of(repo_id)
            base = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
            (base / "blobs").mkdir(parents=True, exist_ok=True)
            (base / "refs").mkdir(parents=True, exist_ok=True)
            for path, (content, etag) in hub.files_of(repo_id).items():
                blob = base / "blobs" / etag
                if not blob.exists():
                    os.link(content, blob)
                pointer = base / "snapshots" / commit / path
                pointer.parent.mkdir(parents=True, exist_ok=True)
                if not pointer.is_symlink():
                    pointer.symlink_to(os.path.relpath(blob, pointer.parent))
            (base / "refs" / "main").write_text(commit)
        return "hard links to the hub's copies"
    except (OSError, KeyError) as err:
        for repo_id in repo_ids:
            shutil.rmtree(hf_home / "hub" / ("models--" + repo_id.replace("/", "--")),
                          ignore_errors=True)
        warm(repo_ids, hub.endpoint, hf_home)
        return f"downloaded through HTTP ({type(err).__name__}: {err})"


def main() -> int:
    began = time.time()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-gib", type=float, default=8.0)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--fixed-gb", type=float, default=2.0,
                        help="loaded size of the fixed converting runs, GB")
    parser.add_argument("--min-gb", type=float, default=0.25)
    parser.add_argument("--max-gb", type=float, default=6.0)
    parser.add_argument("--tolerance-gb", type=float, default=0.25,
                        help="the search stops when the largest size that loaded and the "
                             "smallest that failed are at most this far apart, GB")
    parser.add_argument("--no-search", action="store_true")
    parser.add_argument("--out", type=Path, default=measure.REPO_ROOT / "demo-out")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_memcap needs root (it creates a memory cgroup)")
        return 2
    out = args.out.resolve()
    cap = int(args.cap_gib * 2**30)
    cgroup_kind = MemoryCgroup.describe()
    print(f"memory cap {args.cap_gib:g} GiB through {cgroup_kind}, N = {args.nproc}", flush=True)
    timer = Timer()
    work = out / "bench-memcap"
    repos_dir = work / "repos"
    hf_home = work / "hf"
    shutil.rmtree(work, ignore_errors=True)
    from demo.run import LLAMA_ID  # the demo's own model
    demo_folder = out / "repos" / "llama-500m"  # the demo's own cache: kept if it was there
    demo_existed = (demo_folder / "demo-spec.json").is_file()
    made = [d for d in (out, out / "repos") if not d.exists()]
    try:
        return _main(args, out, cap, cgroup_kind, timer, work, repos_dir, hf_home, LLAMA_ID,
                     demo_folder, began)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # checkpoints, the cache, the runs' files
        if not demo_existed:
            shutil.rmtree(demo_folder, ignore_errors=True)
        for folder in reversed(made):  # the folders this run made, if empty
            with contextlib.suppress(OSError):
                folder.rmdir()


def _main(args: argparse.Namespace, out: Path, cap: int, cgroup_kind: str, timer: Timer,
          work: Path, repos_dir: Path, hf_home: Path, demo_id: str, demo_folder: Path,
          began: float) -> int:
    def spec_of(layers: int, dtype: str) -> dict[str, Any]:
        return llama_spec(hidden=HIDDEN, layers=layers, dtype=dtype)

    def loaded_gb(layers: int, load_dtype: str) -> float:
        return param_count(spec_of(layers, "bfloat16")) * (4 if load_dtype == "float32"
                                                          else 2) / 1e9

    def build(hub: Any, layers: int, dtype: str) -> str:
        """Write a pattern-filled checkpoint, hand it to the hub (its own copy), put it in the
        cache; the written folder is deleted at once (the hub's copy is what is served)."""
        name = f"memcap-llama-h{HIDDEN}-l{layers}-{dtype}"
        repo_id = f"bench/{name}"
        with timer("writing checkpoints"):
            folder = llama_repo(repos_dir / name, spec_of(layers, dtype), fill="pattern")
        with timer("the hub's copy (read, hash, copy)"):
            hub.add_repo(repo_id, folder)
        shutil.rmtree(folder)
        with timer("filling the cache"):
            how = cache_from_hub(hub, [repo_id], hf_home)
        if not how.startswith("hard links"):
            print(f"  cache: {how}", flush=True)
        return repo_id

    def drop(hub: Any, repo_id: str) -> None:
        hub.remove_repo(repo_id)  # a GB-sized step's copies, not kept to the end
        shutil.rmtree(hf_home / "hub" / ("models--" + repo_id.replace("/", "--")),
                      ignore_errors=True)

    def load(hub: Any, what: str, repo_id: str, load_dtype: str, patched: bool
             ) -> dict[str, Any]:
        mode = "patchload" if patched else "plain"
        with timer("the capped runs"):
            return load_job(f"{what} {mode}", repo_id, load_dtype, hub=hub, hf_home=hf_home,
                            work=work / "run", patched=patched, nproc=args.nproc, cap_bytes=cap)

    rows: list[list[str]] = []
    fixed = [("bf16 -> fp32", "bfloat16", "float32"), ("fp32 -> bf16", "float32", "bfloat16")]
    modes = ("plain", "patchload")
    with measure.serve({}, work / "hub.jsonl") as hub:
        with timer("writing checkpoints"):
            llama_repo(demo_folder, llama_spec(hidden=1024, layers=14, dtype="bfloat16"))
        with timer("the hub's copy (read, hash, copy)"):
            hub.add_repo(demo_id, demo_folder)
        with timer("filling the cache"):
            print(f"cache: {cache_from_hub(hub, [demo_id], hf_home)}", flush=True)

        known: dict[str, dict[int, bool]] = {mode: {} for mode in modes}  # search: layers -> ok
        fixed_layers = 0
        for what, ckpt, load_dtype in fixed:
            per_param = 4 if load_dtype == "float32" else 2
            layers = layers_for(args.fixed_gb * 1e9 / per_param, hidden=HIDDEN, dtype=ckpt)
            repo_id = build(hub, layers, ckpt)
            for mode in modes:
                r = load(hub, what, repo_id, load_dtype, mode == "patchload")
                size = loaded_gb(layers, load_dtype)
                print(f"- {what}, {size:.2f} GB loaded, {mode}: {_line(r)}", flush=True)
                rows.append(_row(f"{what}, {size:.2f} GB loaded", mode, r))
                if load_dtype == "float32" and not r["timed_out"]:
                    known[mode][layers] = r["finished"]  # a point of the search as well
                    fixed_layers = layers
            drop(hub, repo_id)
        for mode in modes:
            shutil.rmtree(work / "run", ignore_errors=True)
            env = measure.run_env(endpoint=hub.endpoint, hf_home=hf_home,
                                  measure_dir=work / "run" / "measure",
                                  patchload_on=mode == "patchload")
            with timer("the capped runs"):
                r = run_capped(f"demo job {mode}", EXAMPLE, ["--model", demo_id, "--steps", "1",
                                                             "--seq-len", "16"],
                               nproc=args.nproc, env=env, cap_bytes=cap, timeout_s=600)
            print(f"- demo training job, {mode}: {_line(r)}", flush=True)
            rows.append(_row("demo training job (982 MB fp32)", mode, r))

        summary = ""
        if not args.no_search:
            summary = search(args, hub, known, fixed_layers, build, drop, load, loaded_gb, rows)
    total = time.time() - began
    print(f"\nMemory cap {args.cap_gib:g} GiB ({cgroup_kind}), {args.nproc} ranks, warm cache. "
          "Own peak: a rank's growth from the release to the end of its load / the loaded "
          "model, as VmHWM (every resident page, the checkpoint's mapped file pages included) "
          "/ sampled RssAnon + RssShmem (without them); the leader is the rank that read the "
          "checkpoint, rank 0 in plain runs (every rank reads it):\n")
    print(measure.markdown_table(["job", "mode", "every rank finished", "OOM-killed ranks",
                                  "cgroup peak", "time", "leader's own peak",
                                  "others' largest own peak"], rows))
    if summary:
        print("\n" + summary)
    phases = ", ".join(f"{name} {spent:.0f} s" for name, spent in timer.spent.items())
    print(f"\nThe whole command: {total:.0f} s ({total / 60:.1f} min; {phases}); load average "
          f"at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


def search(args: argparse.Namespace, hub: Any, known: dict[str, dict[int, bool]],
           fixed_layers: int, build: Any, drop: Any, load: Any, loaded_gb: Any,
           rows: list[list[str]]) -> str:
    """The largest bf16 checkpoint each mode loads as fp32 under the cap.

    Over the layer count, between the sizes of ``--min-gb`` and ``--max-gb``, each mode
    separately: the largest size that finished (``ok``) and the smallest above it that failed
    (``fail``) bracket the limit; the top of the range is tried first if nothing failed yet, then
    the midpoint of the bracket, until the two are at most ``--tolerance-gb`` apart. The fixed
    bf16 -> fp32 run is a point of it when it is in the range. Where both modes want the same
    size in a round its checkpoint is built once."""
    lo = layers_for(args.min_gb * 1e9 / 4, hidden=HIDDEN, dtype="bfloat16")
    hi = layers_for(args.max_gb * 1e9 / 4, hidden=HIDDEN, dtype="bfloat16")
    for mode in known:  # the fixed run only counts inside the range
        known[mode] = {k: v for k, v in known[mode].items() if lo <= k <= hi}

    def bracket(points: dict[int, bool]) -> tuple[int, int | None]:
        ok = max((k for k, v in points.items() if v), default=lo - 1)
        fail = min((k for k, v in points.items() if not v and k > ok), default=None)
        return ok, fail

    def wanted(points: dict[int, bool]) -> int | None:
        ok, fail = bracket(points)
        if fail is None:
            return None if ok >= hi else hi
        if fail - ok <= 1 or loaded_gb(fail, "float32") - loaded_gb(ok, "float32") \
                <= args.tolerance_gb:
            return None
        return (ok + fail) // 2

    steps = {mode: 0 for mode in known}
    while True:
        todo = {mode: wanted(points) for mode, points in known.items()}
        todo = {mode: layers for mode, layers in todo.items() if layers is not None}
        if not todo:
            break
        for layers in sorted(set(todo.values())):
            repo_id = build(hub, layers, "bfloat16")
            size = loaded_gb(layers, "float32")
            for mode in [m for m, want in todo.items() if want == layers]:
                r = load(hub, f"search {size:.2f} GB", repo_id, "float32", mode == "patchload")
                known[mode][layers] = r["finished"]
                steps[mode] += 1
                print(f"- search, {mode}, {size:.2f} GB loaded (bf16 -> fp32): {_line(r)}",
                      flush=True)
                rows.append(_row(f"search: bf16 -> fp32, {size:.2f} GB loaded", mode, r))
            drop(hub, repo_id)

    largest, parts, open_top = {}, [], set()
    for mode, points in known.items():
        ok, fail = bracket(points)
        largest[mode] = loaded_gb(ok, "float32") if ok >= lo else 0.0
        if ok < lo:
            limit = f"none (failed at {loaded_gb(lo, 'float32'):.2f} GB)"
        elif fail is None:
            limit = f"at least {largest[mode]:.2f} GB (the top of the range finished)"
            open_top.add(mode)
        else:
            limit = f"{largest[mode]:.2f} GB (failed at {loaded_gb(fail, 'float32'):.2f} GB)"
        parts.append(f"{mode} {limit}, {steps[mode]} search runs")
    ratio = largest["patchload"] / largest["plain"] if largest["plain"] else float("inf")
    fixed = (f"; the fixed {loaded_gb(fixed_layers, 'float32'):.2f} GB run counted as a point"
             if fixed_layers and lo <= fixed_layers <= hi else "")
    return (f"Largest bf16 checkpoint loaded as fp32 by {args.nproc} ranks under "
            f"{args.cap_gib:g} GiB (bisection over {loaded_gb(lo, 'float32'):.2f}-"
            f"{loaded_gb(hi, 'float32'):.2f} GB to {args.tolerance_gb:g} GB{fixed}): "
            f"{'; '.join(parts)}. patchload / plain "
            f"{f'{ratio:.2f}' if largest['plain'] else 'n/a (plain loaded none)'}"
            f"{' or more (patchload limit above the range)' if open_top == {'patchload'} else ''}")


if __name__ == "__main__":
    sys.exit(main())
