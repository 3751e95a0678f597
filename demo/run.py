"""The patchload demo: the same torchrun job, plain and with patchload, side by side.

    make demo            # creates .venv (make env), then runs this
    .venv/bin/python demo/run.py [--nproc 4] [--out demo-out]

1. Generates (once, cached under ``demo-out/``) a ~500 MB Llama-architecture checkpoint stored in
   bf16 with a tokenizer, and copies the real all-MiniLM-L6-v2 repo; serves both through a
   loopback Hugging Face Hub in this process as ``demo/llama-500m`` and
   ``sentence-transformers/all-MiniLM-L6-v2``. Nothing touches the internet.
2. Runs the unmodified ``examples/train_causal_lm_ddp.py`` (loads the bf16 checkpoint as fp32,
   then one DDP SGD step) with ``torchrun --nproc_per_node 4`` on a cold cache, once with
   ``PATCHLOAD=0`` and once with patchload on; with ``--minilm``, then the same for
   ``examples/embed_minilm.py`` (the real all-MiniLM-L6-v2, 4 ranks, no process group).
3. Measures each run from the outside (``demo/measure.py`` and ``demo/site/sitecustomize.py``)
   and prints a markdown table. Exits 1 if the patched run is not correct: a rank's weights hash
   or first loss differs from the plain run, or a follower made hub requests or read checkpoint
   tensors.
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
from demo.models import checkpoint_bytes, llama_repo, llama_spec  # noqa: E402

LLAMA_ID = "demo/llama-500m"
MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"
EXAMPLES = measure.REPO_ROOT / "examples"


def prepare(out: Path) -> dict[str, Path]:
    from patchload.testing.models import minilm

    repos = out / "repos"
    llama = llama_repo(repos / "llama-500m",
                       llama_spec(hidden=1024, layers=14, dtype="bfloat16"))
    mini = repos / "all-MiniLM-L6-v2"
    if not (mini / "model.safetensors").is_file():
        minilm(mini)
    return {LLAMA_ID: llama, MINILM_ID: mini}


def one_run(label: str, script: str, args: list[str], *, on: bool, hub: Any, out: Path,
            nproc: int, sampler: measure.MemorySampler, timeout_s: float) -> dict[str, Any]:
    """Run one job on a cold cache and collect its figures."""
    base = out / "runs" / ("patchload" if on else "plain") / Path(script).stem
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    env = measure.run_env(endpoint=hub.endpoint, hf_home=base / "hf",
                          measure_dir=base / "measure", patchload_on=on)
    hub.clear_requests()
    print(f"- {label}: torchrun --nproc_per_node {nproc} examples/{script} {' '.join(args)} "
          f"(PATCHLOAD={int(on)}, cold HF_HOME)", flush=True)
    run = measure.torchrun(label, EXAMPLES / script, args, nproc=nproc, env=env,
                           measure_dir=base / "measure", timeout_s=timeout_s, sampler=sampler)
    (base / "output.log").write_text(run.output)
    results = measure.results(run)
    figures = measure.rank_figures(run)
    baseline, baseline_kind = measure.joined_baseline(run, figures, sampler)
    # When the model is in the rank's hands: the example's own RESULT timestamp (after the
    # outermost, Auto-class from_pretrained, patchload's sharing included), else the
    # sitecustomize's record of PreTrainedModel.from_pretrained returning.
    joined = [figures.get(r, {}).get("process_group_ready_at") for r in range(nproc)]
    ready = [results.get(r, {}).get("loaded_at") or measure.model_ready_at(figures.get(r, {}))
             for r in range(nproc)]
    all_ready = max(ready) if all(ready) else None
    # The first weight loaded on any rank (transformers 5): what the node held above the baseline
    # until then is the job's own (imports, tokenizer, download), not weights.
    started = [f["weights_started_at"] for f in figures.values() if f.get("weights_started_at")]
    first_weight = min(started) if started else None
    # After the load (the training example): until DDP is built, until the last step, until
    # torchrun exited; each from the end of the phase before, as the slowest rank ends it.
    ddp = [f.get("ddp_ready_at") for f in figures.values()]
    steps = [max(f["steps_done_at"]) for f in figures.values() if f.get("steps_done_at")]
    phases = None
    if all_ready and ddp and all(ddp) and len(steps) == len(ddp):
        phases = (max(ddp) - all_ready, max(steps) - max(ddp), run.ended_at - max(steps))
    requests = {r: 0 for r in range(nproc)}
    downloaded = 0
    for req in hub.requests():
        if req.rank is not None:
            requests[req.rank] = requests.get(req.rank, 0) + 1
        downloaded += req.bytes_sent
    summary = {
        "label": label, "ok": run.returncode == 0 and sorted(results) == list(range(nproc)),
        "returncode": run.returncode, "wall_s": run.wall_s, "results": results,
        "requests": requests, "downloaded": downloaded,
        "read": {r: figures.get(r, {}).get("checkpoint_tensor_bytes") for r in range(nproc)},
        "ready_s": (all_ready - run.launched_at) if all_ready else None,
        "to_ddp_s": phases[0] if phases else None, "to_step_s": phases[1] if phases else None,
        "to_exit_s": phases[2] if phases else None,
        "ready_after_join_s": (all_ready - max(joined)) if all_ready and all(joined) else None,
        "load_peak": (sampler.peak(run.launched_at, all_ready) - baseline) if all_ready else None,
        "before_weights": (sampler.at(first_weight) - baseline) if first_weight else None,
        # What the weights themselves added: the peak from the first weight on, above that point.
        "weights_peak": (sampler.peak(first_weight, all_ready) - sampler.at(first_weight))
        if first_weight and all_ready else None,
        "run_peak": sampler.peak(run.launched_at, run.ended_at) - baseline,
        "imports": baseline - run.baseline_bytes, "baseline_kind": baseline_kind,
        "log": base / "output.log",
    }
    status = "ok" if summary["ok"] else f"FAILED (exit {run.returncode}; see {summary['log']})"
    print(f"  {status} in {run.wall_s:.1f} s", flush=True)
    if not summary["ok"]:
        print("  " + "\n  ".join(run.output.splitlines()[-25:]))
    return summary


def per_rank(values: dict[int, Any], fmt=str) -> str:
    return " / ".join("?" if v is None else fmt(v) for _, v in sorted(values.items()))


def compare(plain: dict[str, Any], patched: dict[str, Any], nproc: int,
            model_bytes: int) -> tuple[str, list[str]]:
    """The side-by-side table, and what is wrong with the patched run (empty: correct)."""
    problems: list[str] = []
    if not plain["ok"] or not patched["ok"]:
        problems.append("a run failed: " + ", ".join(
            f"{s['label']} (exit {s['returncode']}, log {s['log']})"
            for s in (plain, patched) if not s["ok"]))
    pr, qr = plain["results"], patched["results"]
    same_sha = [pr.get(r, {}).get("weights_sha256") is not None
                and pr.get(r, {}).get("weights_sha256") == qr.get(r, {}).get("weights_sha256")
                for r in range(nproc)]
    key = "first_loss" if any(v.get("first_loss") is not None for v in pr.values()) \
        else "embedding_sha256"
    same_out = [r in pr and r in qr and pr[r].get(key) == qr[r].get(key) for r in range(nproc)]
    if not all(same_sha):
        problems.append(f"weights hash differs from the plain run on ranks "
                        f"{[r for r in range(nproc) if not same_sha[r]]}")
    if not all(same_out):
        problems.append(f"{key} differs from the plain run on ranks "
                        f"{[r for r in range(nproc) if not same_out[r]]}")
    readers = [r for r, b in patched["read"].items() if b]
    leader = readers[0] if len(readers) == 1 else None
    if leader is None:
        problems.append(f"want exactly one rank reading the checkpoint, got ranks {readers}")
    else:
        talkers = [r for r, n in patched["requests"].items() if n and r != leader]
        if talkers:
            problems.append(f"followers {talkers} made hub requests "
                            f"({ {r: patched['requests'][r] for r in talkers} })")
    if any(b is None for b in patched["read"].values()):
        problems.append("a rank left no measurement")

    def fig(s: dict[str, Any]) -> list[str]:
        return [
            per_rank(s["requests"]),
            measure.mib(s["downloaded"]),
            per_rank(s["read"], measure.mib),
            "?" if s["ready_s"] is None else f"{s['ready_s']:.1f} s",
            "-" if s["ready_after_join_s"] is None else f"{s['ready_after_join_s']:.1f} s",
            "?" if s["load_peak"] is None else
            f"{measure.gib(s['load_peak'])} ({s['load_peak'] / model_bytes:.2f}x)",
            "?" if s["before_weights"] is None else
            f"{measure.gib(s['before_weights'])} ({s['before_weights'] / model_bytes:.2f}x)",
            "?" if s["weights_peak"] is None else
            f"{measure.gib(s['weights_peak'])} ({s['weights_peak'] / model_bytes:.2f}x)",
            f"{measure.gib(s['run_peak'])}",
            f"{measure.gib(s['imports'])} ({s['baseline_kind']})",
            f"{s['wall_s']:.1f} s",
            *("-" if s[k] is None else f"{s[k]:.1f} s"
              for k in ("to_ddp_s", "to_step_s", "to_exit_s")),
        ]

    names = ["hub requests per rank", "bytes downloaded (all ranks)",
             "checkpoint tensor bytes read per rank", "time until every rank holds its model",
             "  of which after every rank joined the process group",
             "peak node memory until then (x loaded model)",
             "  of which held before the first weight was loaded",
             "  added from the first weight on (x loaded model)",
             "peak node memory, whole run",
             "baseline: memory of the started ranks",
             "wall time of the job",
             "  after the load: until DDP is built (it writes every parameter)",
             "  then until the optimizer step is done",
             "  then until the job ended"]
    ratio_of = [None, None, None, "ready_s", "ready_after_join_s", "load_peak",
                "before_weights", "weights_peak", "run_peak", None, "wall_s",
                "to_ddp_s", "to_step_s", "to_exit_s"]
    rows = [[n, a, b, _ratio(plain, patched, k)]
            for n, a, b, k in zip(names, fig(plain), fig(patched), ratio_of)]
    rows.append(["weights sha256 equal to plain, per rank", "-",
                 " / ".join("yes" if s else "NO" for s in same_sha), ""])
    rows.append([f"{key} equal to plain, per rank", "-",
                 " / ".join("yes" if s else "NO" for s in same_out), ""])
    table = measure.markdown_table(["", plain["label"], patched["label"], "patchload / plain"],
                                   rows)
    return table, problems


def _ratio(plain: dict[str, Any], patched: dict[str, Any], key: str | None) -> str:
    if key is None or not plain.get(key) or patched.get(key) is None:
        return ""
    return f"{patched[key] / plain[key]:.2f}"


_MEDIAN_KEYS = ("wall_s", "ready_s", "ready_after_join_s", "load_peak", "before_weights",
                "weights_peak", "run_peak", "imports", "to_ddp_s", "to_step_s", "to_exit_s")


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The last run, with each figure of ``_MEDIAN_KEYS`` replaced by its median over ``runs``
    (counts, bytes read and results are the last run's; every run is checked on its own)."""
    out = dict(runs[-1])
    for key in _MEDIAN_KEYS:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    out["ok"] = all(r["ok"] for r in runs)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description="patchload demo: plain vs patched torchrun")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--out", type=Path, default=measure.REPO_ROOT / "demo-out")
    parser.add_argument("--timeout", type=float, default=900, help="per run, in seconds")
    parser.add_argument("--runs", type=int, default=1,
                        help="plain/patched pairs per job; the table shows medians (default 1)")
    parser.add_argument("--minilm", action="store_true",
                        help="also compare examples/embed_minilm.py (real all-MiniLM-L6-v2)")
    args = parser.parse_args()
    out = args.out.resolve()

    print("patchload demo: preparing repos under", out, flush=True)
    repos = prepare(out)
    llama_bytes = checkpoint_bytes(repos[LLAMA_ID])
    loaded_bytes = llama_bytes * 2  # bf16 checkpoint loaded as fp32
    jobs = [("train_causal_lm_ddp.py", ["--model", LLAMA_ID, "--steps", "1", "--seq-len", "16"],
             loaded_bytes, f"{LLAMA_ID} ({llama_bytes / 1e6:.0f} MB bf16 checkpoint, "
                           f"loaded as fp32: {loaded_bytes / 1e6:.0f} MB)")]
    if args.minilm:
        mini_bytes = checkpoint_bytes(repos[MINILM_ID])
        jobs.append(("embed_minilm.py", ["--model", MINILM_ID], mini_bytes,
                     f"{MINILM_ID} ({mini_bytes / 1e6:.0f} MB fp32, loaded as stored)"))

    failed = False
    reports = []
    with measure.serve(repos, out / "hub.jsonl") as hub, measure.MemorySampler() as sampler:
        print(f"loopback hub at {hub.endpoint} serving {', '.join(repos)}", flush=True)
        for script, script_args, model_bytes, title in jobs:
            runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
            problems = []
            for _ in range(args.runs):
                for label, on in (("plain (PATCHLOAD=0)", False), ("patchload", True)):
                    runs[on].append(one_run(label, script, script_args, on=on, hub=hub, out=out,
                                            nproc=args.nproc, sampler=sampler,
                                            timeout_s=args.timeout))
                    time.sleep(1.0)  # let freed memory settle before the next baseline
                problems += compare(runs[False][-1], runs[True][-1], args.nproc, model_bytes)[1]
            table, _ = compare(median_run(runs[False]), median_run(runs[True]), args.nproc,
                               model_bytes)
            if args.runs > 1:
                title += f"; medians of {args.runs} runs each"
            reports.append((script, title, table, problems))
            failed |= bool(problems)

    for script, title, table, problems in reports:
        print(f"\n### examples/{script}, {args.nproc} ranks on CPU: {title}\n")
        print(table)
        print()
        if problems:
            print("PATCHED RUN NOT CORRECT:\n  - " + "\n  - ".join(problems))
        else:
            print("patched run correct: every rank's weights and outputs equal the plain run's; "
                  "followers made no hub request and read no checkpoint bytes")
    print("\nMemory: MemTotal - MemAvailable sampled every 50 ms, minus the baseline: its value "
          "when the last rank's init_process_group returned (every rank has imported torch and "
          "transformers and joined; 'joined'), or just before torchrun started ('pre-launch') "
          "for scripts without a process group. The baseline row shows that value minus the "
          "pre-launch one. 'Held before the first weight was loaded' is the node's memory above "
          "the baseline when the first rank entered transformers' weight-loading step: the "
          "job's own (imports after the join, tokenizer, download), which the rest of the peak "
          "comes on top of; 'added from the first weight on' is that rest: the peak from then "
          "until every rank holds its model, above the node's memory at that point.")
    print("Time: from torchrun's start (and from the last rank's init_process_group) until the "
          "last rank's from_pretrained returned (the example's loaded_at). The whole-run peak "
          "includes DDP and the SGD step, which write every parameter: with patchload each rank "
          "copies its weights out of the node's shared copy when DDP is built, so from then on "
          "each rank holds private weights and gradients, as a plain run does.")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
