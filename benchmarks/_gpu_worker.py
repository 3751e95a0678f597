"""One rank of ``benchmarks/gpu_check.py``: load a model onto the device, hash it, report.

Run under torchrun by the check (``demo/site/sitecustomize.py`` injected, ``PATCHLOAD=0/1``).
Every rank joins a gloo process group (its barriers time the load from the same instant), loads
``--model`` as ``--case`` says, waits for the device (``torch.cuda.synchronize``), then:

* hashes every named parameter and buffer (sha256 of the bytes, copied back to the host; name,
  dtype, shape and device included);
* with ``--nccl-broadcast``, sends rank 0's on-device weights to every rank through patchload's
  collective transport on an NCCL group (``patchload.transport.collective.private_group(...,
  backend="nccl")`` and ``broadcast(..., device=cuda)``) and checks, on the device, that what
  arrived equals the rank's own load bit for bit;
* prints ``RESULT {json}``: load time (seconds, barrier to on-device), the device's peak memory
  allocated during the load (bytes), the hash, the devices seen, the broadcast's outcome.

``--device cpu`` runs the same steps on the CPU (gloo instead of NCCL, ``device_map="cpu"``): a
dry run of this script where no GPU is lent; it proves nothing about CUDA.
"""

import argparse
import datetime
import hashlib
import json
import logging
import os
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import patchload  # noqa: F401  - PATCHLOAD=0 turns it off

CASES = ("to-cuda", "device-map", "bf16-to-cuda")


def load(repo: str, case: str, device: torch.device) -> torch.nn.Module:
    """The user's call of ``case`` (names say "cuda"; ``device`` may be the CPU in a dry run)."""
    if case == "to-cuda":  # a CPU load (shared by patchload), then a copy to the device
        return AutoModelForCausalLM.from_pretrained(repo).to(device)
    if case == "device-map":  # transformers materialises straight onto the device
        return AutoModelForCausalLM.from_pretrained(repo, device_map=device.type)  # "cuda"
    if case == "bf16-to-cuda":  # a converting load (fp32 checkpoint as bf16), then the copy
        return AutoModelForCausalLM.from_pretrained(repo, dtype=torch.bfloat16).to(device)
    raise ValueError(f"unknown case {case!r}: one of {CASES}")


def tensors_of(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False))


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 1-D ``uint8`` tensor on its device (a bitwise view, no cast)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def nccl_broadcast(model: torch.nn.Module, device: torch.device, rank: int, world: int,
                   backend: str) -> dict:
    """Rank 0's weights to every rank through patchload's collective transport; each rank
    compares them with its own on the device. Collective over every rank; skipped (a reason
    returned) where NCCL would have to put two ranks on one device."""
    from patchload.transport import meta_of
    from patchload.transport.collective import broadcast, private_group

    if backend == "nccl" and torch.cuda.device_count() < world:
        # NCCL refuses two ranks of one communicator on one device ("Duplicate GPU detected")
        return {"skipped": f"NCCL needs a GPU per rank: {world} ranks, "
                           f"{torch.cuda.device_count()} GPUs"}
    own = [t for _, t in tensors_of(model)]
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=datetime.timedelta(seconds=120))
    start = time.time()
    group = private_group(store, group_rank=rank, group_size=world, tag="gpu-check",
                          timeout_s=120, backend=backend)
    try:
        got = broadcast(group, own if rank == 0 else [meta_of(t) for t in own], src_group_rank=0,
                        is_src=rank == 0, bucket_bytes=64 * 2**20, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        group.close()
    seconds = time.time() - start
    differ = sum(not torch.equal(bytes_of(a), bytes_of(b)) for a, b in zip(got, own))
    return {"tensors": len(own), "differ": differ, "seconds": seconds,
            "devices": sorted({str(t.device) for t in got})}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--case", choices=CASES, required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--nccl-broadcast", action="store_true")
    args = parser.parse_args()
    # An entry script may configure logging: patchload's INFO lines and every WARNING.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("patchload").setLevel(logging.INFO)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":  # ranks beyond the device count share devices
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("gloo")
    import transformers.models.llama.modeling_llama  # noqa: F401  - not inside the timed load

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    dist.barrier()
    start = time.time()
    model = load(args.model, args.case, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    load_s = time.time() - start
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
    dist.barrier()

    digest = hashlib.sha256()
    for name, tensor in tensors_of(model):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}:{tensor.device.type}"
                      .encode())
        digest.update(bytes_of(tensor).cpu().numpy().data)
    result = {"rank": rank, "load_s": load_s, "peak_device_bytes": peak,
              "weights_sha256": digest.hexdigest(),
              "devices": sorted({str(t.device) for _, t in tensors_of(model)})}
    if args.nccl_broadcast:
        result["broadcast"] = nccl_broadcast(model, device, rank, world,
                                             "nccl" if device.type == "cuda" else "gloo")
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
