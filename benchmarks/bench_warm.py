"""Many small calls on a warm cache: plain vs patchload, as ratios in one run.

    .venv/bin/python benchmarks/bench_warm.py            # 3 ranks: 200 AutoConfig, 200 AutoTokenizer, 100 hf_hub_download

Each loop is what a script that reloads a config or tokenizer per step (or a library that
probes the hub per call) pays: every call goes through the coordination (a claim, the leader's
outcome) even when nothing is downloaded. ``benchmarks/_warm_worker.py`` runs each loop after a
file barrier; a loop's time is its slowest rank's. Plain (``PATCHLOAD=0``) and patched runs are
interleaved, ``--runs`` times each; medians, and the ratio patched / plain. The tiny Llama repo
is served by a loopback hub and the cache is warmed once first.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_load import warm  # noqa: E402
from demo import measure  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_warm_worker.py"
REPO = "bench/llama-tiny-warm"
KINDS = ("AutoConfig", "AutoTokenizer", "hf_hub_download")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the loop counts")
    parser.add_argument("--out", type=Path, default=measure.REPO_ROOT / "demo-out")
    args = parser.parse_args()
    from patchload.testing import models

    out = args.out.resolve()
    folder = models.tiny_llama(out / "repos" / "llama-tiny-warm", seed=0)
    counts = [str(max(1, round(n * args.scale))) for n in (200, 200, 100)]
    work = out / "bench-warm"
    failed = False
    times: dict[str, dict[str, list[float]]] = {m: {k: [] for k in KINDS} for m in ("plain", "patchload")}
    digests: dict[str, set[str]] = {k: set() for k in KINDS}
    with measure.serve({REPO: folder}, out / "bench-warm-hub.jsonl") as hub:
        hf_home = work / "hf"
        shutil.rmtree(hf_home, ignore_errors=True)
        warm([REPO], hub.endpoint, hf_home)
        for i in range(args.runs):
            for mode in ("plain", "patchload"):
                sync = work / "sync"
                shutil.rmtree(sync, ignore_errors=True)
                sync.mkdir(parents=True)
                env = measure.run_env(endpoint=hub.endpoint, hf_home=hf_home,
                                      measure_dir=work / "measure",
                                      patchload_on=mode == "patchload")
                run = measure.torchrun(f"{mode} run {i + 1}", WORKER,
                                       ["--model", REPO, "--sync-dir", str(sync),
                                        "--configs", counts[0], "--tokenizers", counts[1],
                                        "--downloads", counts[2]],
                                       nproc=args.nproc, env=env, measure_dir=work / "measure",
                                       timeout_s=900)
                results = measure.results(run)
                if run.returncode != 0 or sorted(results) != list(range(args.nproc)):
                    print(f"- {mode} run {i + 1}: FAILED (exit {run.returncode})\n"
                          + "\n".join(run.output.splitlines()[-15:]))
                    failed = True
                    continue
                for kind in KINDS:
                    times[mode][kind].append(max(r["seconds"][kind] for r in results.values()))
                    digests[kind].update(r["digests"][kind] for r in results.values())
                print(f"- {mode} run {i + 1}: " + ", ".join(
                    f"{k} {times[mode][k][-1]:.2f} s" for k in KINDS), flush=True)
    rows = []
    for kind, n in zip(KINDS, counts):
        plain, patched = (statistics.median(times[m][kind]) if times[m][kind] else float("nan")
                          for m in ("plain", "patchload"))
        same = "yes" if len(digests[kind]) == 1 else "NO"
        failed |= same != "yes"
        rows.append([f"{n} x {kind}", f"{plain:.2f} s", f"{patched:.2f} s",
                     f"{patched / plain:.2f}", same])
    print(f"\n{args.nproc} ranks, warm cache, medians of {args.runs} runs (a loop's time is its "
          "slowest rank's):\n")
    print(measure.markdown_table(["loop", "plain", "patchload", "patchload / plain",
                                  "same results"], rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
