"""Device check (issue 29): the CUDA paths, patched against plain, on a tiny model.

    .venv/bin/python benchmarks/gpu_check.py               # 2 ranks (processes may share a GPU)
    .venv/bin/python benchmarks/gpu_check.py --nproc 4

On a machine without CUDA it prints "no CUDA device" and exits 0. Otherwise a tiny sharded Llama
(fp32) is served by a loopback hub (``demo.measure.serve``) and, for each case, one torchrun job
(``demo.measure.torchrun``, ``benchmarks/_gpu_worker.py``) per mode loads it on a cold cache:
plain (``PATCHLOAD=0``), ``PATCHLOAD_TRANSPORT=shm`` and ``PATCHLOAD_TRANSPORT=collective``.

Cases: ``to-cuda`` (a CPU load, then ``model.to("cuda")``), ``device-map``
(``from_pretrained(..., device_map="cuda")``: patchload steps aside, one INFO line says why, every
rank loads the weights plainly, downloads still shared) and ``bf16-to-cuda`` (an fp32 checkpoint loaded as
bf16, then ``.to("cuda")``). In the patched jobs every rank also receives rank 0's on-device
weights through patchload's collective transport on an NCCL group and compares them with its
own (``from_pretrained``'s collective transport itself moves CPU tensors over gloo); NCCL needs
a GPU per rank, so with fewer GPUs than ranks that step is skipped and the table says so.

Per case and mode: whether every rank's weights (hashed with names, dtypes, shapes, device type)
equal the plain rank's bit for bit, hub requests per rank, the slowest rank's time from a barrier
to its weights on the device and the largest per-rank peak of device memory allocated during the
load, both as ratios to plain, and the NCCL broadcast's outcome. patchload's INFO and WARNING
lines of the patched jobs follow the table. Exit status 1 if a check failed.

``--device cpu`` is a dry run of the same jobs on the CPU (gloo, ``device_map="cpu"``), for
working on this script where no GPU is lent; it says nothing about CUDA.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WORKER = Path(__file__).resolve().parent / "_gpu_worker.py"
REPO = "gpu/llama-tiny-sharded"
CASES = ("to-cuda", "device-map", "bf16-to-cuda")
MODES = {"plain": None, "shm": "shm", "collective": "collective"}  # PATCHLOAD_TRANSPORT
JOB_TIMEOUT_S = 180


def check(out: Path, *, nproc: int = 2, device: str = "cuda", cases: tuple[str, ...] = CASES,
          echo: bool = False) -> tuple[list[list[str]], list[str], list[str]]:
    """Run every case in every mode. Returns the table's rows, the failed checks (empty: all
    passed) and patchload's log lines of the patched jobs."""
    from demo import measure
    from patchload.testing import models

    out.mkdir(parents=True, exist_ok=True)
    folder = models.tiny_llama(out / "repo", max_shard_size="200KB", hidden_size=64, seed=29)
    rows: list[list[str]] = []
    failures: list[str] = []
    log_lines: list[str] = []
    with measure.serve({REPO: folder}, out / "hub.jsonl") as hub:
        for case in cases:
            plain: dict[int, dict[str, Any]] = {}
            plain_total = 0  # hub requests of the plain job
            for mode, transport in MODES.items():
                work = out / case / mode
                shutil.rmtree(work, ignore_errors=True)
                env = measure.run_env(
                    endpoint=hub.endpoint, hf_home=work / "hf", measure_dir=work / "measure",
                    patchload_on=transport is not None,
                    extra={"PATCHLOAD_TRANSPORT": transport} if transport else None)
                args = ["--model", REPO, "--case", case, "--device", device]
                if transport:
                    args.append("--nccl-broadcast")
                since = time.time()
                run = measure.torchrun(f"{case} {mode}", WORKER, args, nproc=nproc, env=env,
                                       measure_dir=work / "measure", timeout_s=JOB_TIMEOUT_S,
                                       echo=echo)
                ranks = measure.results(run)
                requests = {r: v["requests"] for r, v in sorted(
                    measure.hub_figures(out / "hub.jsonl", since).items(), key=str)}
                what = f"{case}, {mode}"
                if run.returncode != 0 or sorted(ranks) != list(range(nproc)):
                    failures.append(f"{what}: the job failed (rc {run.returncode}):\n"
                                    + run.output[-3000:])
                    rows.append([case, mode, "job failed", str(requests), "", "", ""])
                    continue
                if transport is None:
                    plain, plain_total = ranks, sum(requests.values())
                else:
                    log_lines += [f"[{what}] {line}" for line in run.output.splitlines()
                                  if "patchload" in line and ("INFO" in line or "WARN" in line)]
                rows.append(_row(case, mode, ranks, plain, requests, plain_total, device,
                                 failures))
    return rows, failures, log_lines


def _row(case: str, mode: str, ranks: dict[int, dict[str, Any]], plain: dict[int, dict[str, Any]],
         requests: dict[Any, int], plain_total: int, device: str, failures: list[str]
         ) -> list[str]:
    what = f"{case}, {mode}"
    wrong_device = {r: v["devices"] for r, v in ranks.items()
                    if {d.split(":")[0] for d in v["devices"]} != {device}}
    if wrong_device:
        failures.append(f"{what}: weights not on {device}: {wrong_device}")
    equal = [r for r in ranks if plain and ranks[r]["weights_sha256"]
             == plain.get(r, {}).get("weights_sha256")]
    if plain and len(equal) != len(ranks):
        failures.append(f"{what}: ranks {sorted(set(ranks) - set(equal))} differ from plain")
    if mode != "plain" and plain:
        # every plain rank made its own requests; patched: fewer in all (followers none where
        # the call is shared), never more
        if sum(requests.values()) > plain_total:
            failures.append(f"{what}: more requests than plain: {requests}")
    broadcast = [v.get("broadcast") for v in ranks.values()]
    nccl = "-"
    skipped = {b["skipped"] for b in broadcast if b and "skipped" in b}
    if skipped:
        nccl = "skipped: " + "; ".join(sorted(skipped))
    elif all(broadcast):
        differ = sum(b["differ"] for b in broadcast)
        nccl = f"{'equal' if not differ else f'{differ} tensors differ'}, " \
               f"{max(b['seconds'] for b in broadcast):.2f} s"
        if differ:
            failures.append(f"{what}: NCCL broadcast: {differ} tensors differ from own load")
    load_s = max(v["load_s"] for v in ranks.values())
    peak = max(v["peak_device_bytes"] for v in ranks.values())
    plain_s = max(v["load_s"] for v in plain.values()) if plain else None
    plain_peak = max(v["peak_device_bytes"] for v in plain.values()) if plain else None
    return [case, mode, f"{len(equal) if plain else '-'}/{len(ranks)}", str(requests),
            f"{load_s:.2f} s" + (f" ({load_s / plain_s:.2f}x)" if plain_s else ""),
            f"{peak / 2**20:.1f} MiB" + (f" ({peak / plain_peak:.2f}x)" if plain_peak else ""),
            nccl]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a dry run of the same jobs without a GPU")
    parser.add_argument("--out", type=Path, default=Path("demo-out") / "gpu-check")
    parser.add_argument("--echo", action="store_true", help="print the ranks' output")
    args = parser.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (torch.cuda.is_available() is False)")
        return 0
    if args.device == "cuda":
        nccl = torch.cuda.nccl.version()  # a tuple on recent torch, an int on older ones
        print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch "
              f"{torch.__version__}, CUDA {torch.version.cuda}, NCCL "
              f"{'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}, "
              f"{args.nproc} ranks", flush=True)
    rows, failures, log_lines = check(args.out.resolve(), nproc=args.nproc, device=args.device,
                                      echo=args.echo)
    from demo import measure

    print(measure.markdown_table(["case", "mode", "ranks equal to plain", "requests per rank",
                                  "time (x plain)", "peak device memory (x plain)",
                                  "NCCL broadcast"], rows))
    print("\npatchload's log lines (patched jobs):")
    print("\n".join(log_lines) or "(none)")
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
