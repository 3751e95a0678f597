"""One rank of ``benchmarks/bench_load.py``: import, wait for "go", load, measure, report.

With ``--tokenizer`` the timed load is the repo's tokenizer, then its model. With
``--process-group`` the rank joins a gloo process group before it imports patchload's
transports (so patchload's store is the group's), and its load ends at a ``dist.barrier()``
after every rank's ``from_pretrained`` returned: ``ready_at`` is when that barrier returned (an
independent benchmark's case, issue 29).

Run under torchrun by the benchmark (with ``demo/site/sitecustomize.py`` injected). Protocol,
through files in ``--sync-dir``: write ``imported-RANK`` once the libraries are imported, wait for
``go`` (the benchmark takes its memory baseline in between), load, write ``loaded-RANK``, wait
until every rank has loaded, hash the weights (touching every page), write ``hashed-RANK`` and
wait for every rank's, read this process's PSS (also read once before the load), print
``RESULT {json}``, write ``done-RANK`` and wait for every rank's before exiting (so every mapping
stays alive while the others measure).

Each rank's own peak during the load: at "go" the rank resets its peak RSS (``VmHWM``, by
writing ``5`` to ``/proc/self/clear_refs``) and reads its RSS; right after the load (before the
hash touches the weights) it reads ``VmHWM`` again. ``own_peak`` = that peak - the RSS at "go",
bytes: the process's resident pages of every kind (anonymous, its shared-memory mappings, the
checkpoint files it mapped). With ``--sample-rss`` a thread also samples ``RssAnon + RssShmem``
every 5 ms during the load (``own_peak_anon_shmem``, the same difference): the file-backed pages,
the checkpoint's page cache, left out. The kernel's ``VmHWM`` misses a peak whose pages were
reclaimed rather than unmapped; the samples miss what lasted under 5 ms.
"""

import argparse
import gc
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import psutil
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import patchload  # noqa: F401  - PATCHLOAD=0 turns it off
from _sync import touch, wait_for  # benchmarks/: the script's own folder


def _status(*names: str) -> dict[str, int]:
    """Fields of ``/proc/self/status`` in bytes (``{}`` where unreadable)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in names:
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _AnonShmemPeak:
    """Samples ``RssAnon + RssShmem`` every ``period_s`` seconds in a daemon thread."""

    def __init__(self, period_s: float = 0.005) -> None:
        self.peak = 0
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    @staticmethod
    def now() -> int:
        fields = _status("RssAnon", "RssShmem")
        return fields.get("RssAnon", 0) + fields.get("RssShmem", 0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            self._stop.wait(self._period_s)

    def __enter__(self) -> "_AnonShmemPeak":
        self.peak = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], required=True)
    parser.add_argument("--sync-dir", type=Path, required=True)
    parser.add_argument("--tokenizer", action="store_true",
                        help="load the repo's tokenizer first (timed with the model)")
    parser.add_argument("--process-group", action="store_true",
                        help="join a gloo process group first; a barrier ends the timed load")
    parser.add_argument("--sample-rss", action="store_true",
                        help="also sample RssAnon + RssShmem every 5 ms during the load")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sync = args.sync_dir
    if args.process_group:
        import torch.distributed as dist

        dist.init_process_group("gloo")

    # Import what from_pretrained would import lazily, so the baseline holds every library.
    import transformers.models.llama.modeling_llama  # noqa: F401
    import patchload.transport.job_collective  # noqa: F401
    import patchload.patches.transformers.modeling  # noqa: F401
    import patchload.transport.collective  # noqa: F401
    import patchload.transport.shm  # noqa: F401

    # A full garbage collection first, in both modes, as pyperf does between runs: a collection
    # owed by the process's earlier allocations would otherwise land in whichever call crosses
    # CPython's threshold first (docs/benchmarks.md: 0.2-0.3 s in every patched warm
    # load_dataset, in no plain one). A collection the call's own allocations cause still counts.
    gc.collect()
    pss_before = psutil.Process().memory_full_info().pss
    touch(sync / f"imported-{rank}")
    wait_for([sync / "go"])
    peak_reset = _reset_peak_rss()
    rss_go = _status("VmRSS").get("VmRSS", 0)
    sampler = _AnonShmemPeak() if args.sample_rss else None
    if sampler is not None:
        sampler.__enter__()
    anon_shmem_go = sampler.peak if sampler is not None else 0
    start = time.time()
    if args.tokenizer:
        AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    if args.process_group:
        dist.barrier()
    ready = time.time()
    if sampler is not None:
        sampler.__exit__(None, None, None)
    hwm = _status("VmHWM").get("VmHWM", 0)
    touch(sync / f"loaded-{rank}")
    wait_for([sync / f"loaded-{r}" for r in range(world)])

    digest = hashlib.sha256()
    loaded_bytes = 0
    seen = set()
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            loaded_bytes += tensor.numel() * tensor.element_size()
        flat = tensor.detach().contiguous().reshape(-1)
        digest.update(f"{name}:{flat.dtype}:{tuple(flat.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy().data)
    # The hash touched every weight page; once every rank has, PSS splits shared pages fairly.
    touch(sync / f"hashed-{rank}")
    wait_for([sync / f"hashed-{r}" for r in range(world)])
    pss = psutil.Process().memory_full_info().pss
    print("RESULT " + json.dumps({
        "rank": rank, "start": start, "ready_at": ready, "load_s": ready - start, "pss": pss,
        "pss_before": pss_before,
        "loaded_bytes": loaded_bytes, "weights_sha256": digest.hexdigest(),
        "rss_go": rss_go, "own_peak": hwm - rss_go if peak_reset and hwm else None,
        "own_peak_anon_shmem": (sampler.peak - anon_shmem_go) if sampler is not None else None,
    }), flush=True)
    touch(sync / f"done-{rank}")
    wait_for([sync / f"done-{r}" for r in range(world)])
    if args.process_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
