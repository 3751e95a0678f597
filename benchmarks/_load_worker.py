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
"""

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import psutil
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import patchload  # noqa: F401  - PATCHLOAD=0 turns it off
from _sync import touch, wait_for  # benchmarks/: the script's own folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], required=True)
    parser.add_argument("--sync-dir", type=Path, required=True)
    parser.add_argument("--tokenizer", action="store_true",
                        help="load the repo's tokenizer first (timed with the model)")
    parser.add_argument("--process-group", action="store_true",
                        help="join a gloo process group first; a barrier ends the timed load")
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

    pss_before = psutil.Process().memory_full_info().pss
    touch(sync / f"imported-{rank}")
    wait_for([sync / "go"])
    start = time.time()
    if args.tokenizer:
        AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    if args.process_group:
        dist.barrier()
    ready = time.time()
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
        "loaded_bytes": loaded_bytes, "weights_sha256": digest.hexdigest()}), flush=True)
    touch(sync / f"done-{rank}")
    wait_for([sync / f"done-{r}" for r in range(world)])
    if args.process_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
