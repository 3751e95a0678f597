"""Rank worker: load every model case and report fingerprints (see tests/test_load.py).

Usage: ``load.py --cases a,b,... [--extras] [--rank0-tail] [--reference]``

* Each case is one ``from_pretrained`` (a separate step, barriers around it); the report holds
  the model's fingerprint, the safetensors files it opened and tensors it read, and the time.
* ``--extras``: after the cases, ``init_process_group`` (gloo) and: one SGD step on identical
  inputs (fingerprint after it), then copy-on-write checks (a follower, then the leader, writes a
  parameter of a freshly loaded model; the others hash theirs before and after).
* ``--rank0-tail``: at the end, every rank but 0 exits; rank 0 alone loads one more model.
* ``--reference``: world size 1 with ``PATCHLOAD=0``: run the cases of every rank (the mismatch
  case differs by rank) plus the SGD step, as the plain-load reference.
* ``--slow-leader``: two steps loading ``org/llama`` (zero-copy on transformers 5 with the shm
  transport), each changing rank 0's ``GenerationConfig.from_pretrained`` (read after the
  weights): ``slow_after_weights``, rank 0 sleeps ``LEADER_DELAY_S`` after reading it;
  ``fails_after_weights``, rank 0 raises before reading it. Records (``time.time()``) when each
  rank read its generation config and when its load returned.
* ``--concurrent a,b,c --rounds R``: R steps ``concurrent-<i>``, each loading every listed repo
  (``AutoModelForCausalLM``) at once, the first in the main thread and each other one in a
  thread of its own (user code loading several models concurrently); ``record["repos"][repo]``
  holds each load's fingerprint (or error) and time.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{os.environ.get('RANK', '0')}"

import argparse  # noqa: E402
import time  # noqa: E402

import _common  # noqa: E402
from _common import RANK, WORLD_SIZE  # noqa: E402

import patchload  # noqa: E402, F401 - installs the patches (unless PATCHLOAD=0)
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM  # noqa: E402
from transformers import AutoModelForSeq2SeqLM  # noqa: E402

import patchload.testing.models  # noqa: E402, F401 - registers the patchload-toy Auto classes

transformers.logging.set_verbosity_error()

SENTENCES = ["the first sentence is here .", "people write many words", "water is hot"]


def _case(name: str, rank: int) -> tuple[str, object, str, dict]:
    """(reference name, class, repo, kwargs) of case ``name`` on ``rank``."""
    llama = (AutoModelForCausalLM, "org/llama")
    table = {
        "llama": (*llama, {}),
        "llama_tied": (AutoModelForCausalLM, "org/llama-tied", {}),
        "llama_sharded": (AutoModelForCausalLM, "org/llama-sharded", {}),
        "bf16_default": (AutoModelForCausalLM, "org/llama-bf16", {}),
        "bf16_bf16": (AutoModelForCausalLM, "org/llama-bf16", {"dtype": torch.bfloat16}),
        "bf16_auto": (AutoModelForCausalLM, "org/llama-bf16", {"dtype": "auto"}),
        "t5_fp16": (AutoModelForSeq2SeqLM, "org/t5", {"dtype": torch.float16}),
        "t5_bf16": (AutoModelForSeq2SeqLM, "org/t5", {"dtype": torch.bfloat16}),
        "gpt2": (AutoModelForCausalLM, "org/gpt2", {}),
        "bert": (AutoModelForMaskedLM, "org/bert", {}),
        "custom": (AutoModel, "org/custom", {}),
        "llama_f32": (*llama, {"dtype": torch.float32}),
        "llama_as_bf16": (*llama, {"dtype": torch.bfloat16}),
        "big_as_f32": (AutoModelForCausalLM, "org/llama-big-bf16", {"dtype": torch.float32}),
    }
    if name == "mismatch":  # rank 2 asks for bf16 while the others ask for fp32, at once
        name = "llama_as_bf16" if rank == 2 else "llama_f32"
    return (name, *table[name])


def _load_case(report: dict, barrier: _common.Barrier, counter: _common.SafetensorsCounter,
               step_name: str, case: str, rank: int) -> None:
    ref, cls, repo, kwargs = _case(case, rank)
    with _common.step(report, step_name, barrier) as record:
        mark = counter.snapshot()
        with _common.peak_memory() as memory, _common.patchload_lines() as lines, \
                _common.threads_started() as threads:
            result = _common.attempt(lambda: cls.from_pretrained(repo, **kwargs))
        record["checkpoint"] = counter.since(mark)
        record["threads"] = threads
        record["memory"] = memory
        record["patchload"] = lines
    record["ref"] = ref
    if result["ok"]:
        record["fingerprint"] = _common.fingerprint(result["value"])
        record["tied"] = _tied(result["value"])
    else:
        record["error"] = result["error"]


def _concurrent(report: dict, barrier: _common.Barrier, repos: list[str], rounds: int) -> None:
    """Each round: every repo loaded at once (the first in this thread, the others each in a
    thread of its own), one step."""
    import threading

    for number in range(rounds):
        with _common.step(report, f"concurrent-{number}", barrier) as record:
            results: dict[str, dict] = {}

            def load(repo: str) -> None:
                result = _common.attempt(lambda: AutoModelForCausalLM.from_pretrained(repo))
                if result["ok"]:
                    result["fingerprint"] = _common.fingerprint(result.pop("value"))
                results[repo] = result

            threads = [threading.Thread(target=load, args=(repo,), name=f"load-{repo}")
                       for repo in repos[1:]]
            for thread in threads:
                thread.start()
            load(repos[0])
            for thread in threads:
                thread.join()
            record["repos"] = results


LEADER_DELAY_S = 3.0


def _slow_leader(report: dict, barrier: _common.Barrier) -> None:
    """The ``--slow-leader`` steps (see the module docstring)."""
    from transformers import GenerationConfig

    patched = GenerationConfig.__dict__["from_pretrained"]  # patchload's wrapper
    for step_name in ("slow_after_weights", "fails_after_weights"):
        with _common.step(report, step_name, barrier) as record:
            def read(cls: type, *args: object, _record: dict = record, _step: str = step_name,
                     **kwargs: object) -> object:
                if RANK == 0 and _step == "fails_after_weights":
                    raise RuntimeError("injected: rank 0 fails after its weights")
                config = patched.__get__(None, cls)(*args, **kwargs)
                _record["generation_config_read"] = time.time()
                if RANK == 0:
                    time.sleep(LEADER_DELAY_S)
                return config

            GenerationConfig.from_pretrained = classmethod(read)
            try:
                with _common.patchload_lines() as lines:
                    result = _common.attempt(
                        lambda: AutoModelForCausalLM.from_pretrained("org/llama"))
            finally:
                GenerationConfig.from_pretrained = patched
            record["returned"] = time.time()
            record["patchload"] = lines
            if result["ok"]:
                record["fingerprint"] = _common.fingerprint(result["value"])
            else:
                record["error"] = result["error"]


def _tied(model: object) -> bool | None:
    """``lm_head.weight is input embedding weight`` for causal LMs, else None."""
    head = getattr(model, "lm_head", None)
    if head is None:
        return None
    return head.weight is model.get_input_embeddings().weight


def _sgd_step(model: torch.nn.Module) -> dict:
    model.train()
    ids = torch.tensor([[1, 7, 9, 11, 13, 2]])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    return {"loss": float(loss.detach()), "fingerprint": _common.fingerprint(model),
            "tied": _tied(model)}


def _minilm(report: dict, barrier: _common.Barrier, counter: _common.SafetensorsCounter) -> None:
    from sentence_transformers import SentenceTransformer

    repo = patchload.testing.models.MINILM_REPO_ID
    with _common.step(report, "minilm_st", barrier) as record:
        mark = counter.snapshot()
        st = SentenceTransformer(repo, device="cpu")
        record["checkpoint"] = counter.since(mark)
    with torch.no_grad():
        emb = st.encode(SENTENCES, convert_to_tensor=True)
    record["embeddings_sha256"] = _common.tensor_sha(emb)
    record["embeddings_head"] = emb[:, :4].tolist()
    record["fingerprint"] = _common.fingerprint(st[0].auto_model)
    del st
    with _common.step(report, "minilm_auto", barrier) as record:
        mark = counter.snapshot()
        model = AutoModel.from_pretrained(repo)
        record["checkpoint"] = counter.since(mark)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(repo)
    with torch.no_grad():
        batch = tok(SENTENCES, padding=True, return_tensors="pt")
        hidden = model(**batch).last_hidden_state
    record["hidden_sha256"] = _common.tensor_sha(hidden)
    record["fingerprint"] = _common.fingerprint(model)


def body(report: dict) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="")
    parser.add_argument("--extras", action="store_true")
    parser.add_argument("--rank0-tail", action="store_true")
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--minilm", action="store_true")
    parser.add_argument("--concurrent", default="")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--slow-leader", action="store_true")
    args = parser.parse_args()
    report["installed"] = patchload.is_installed()
    report["config"] = repr(patchload.load_config())
    barrier = _common.Barrier()
    counter = _common.SafetensorsCounter()
    report["safe_open_rebound"] = counter.rebound
    cases = [c for c in args.cases.split(",") if c]
    for case in cases:
        if args.reference and case == "mismatch":
            for rank in (0, 2):  # steps named after the reference cases they provide
                _load_case(report, barrier, counter, _case(case, rank)[0], case, rank)
        else:
            _load_case(report, barrier, counter, case, case, RANK)
    if args.minilm:
        _minilm(report, barrier, counter)
    if args.concurrent:
        _concurrent(report, barrier, args.concurrent.split(","), args.rounds)
    if args.slow_leader:
        _slow_leader(report, barrier)
    if args.reference:
        with _common.step(report, "sgd", None) as record:
            record.update(_sgd_step(AutoModelForCausalLM.from_pretrained("org/llama-tied")))
    if args.extras:
        _extras(report, barrier, counter)
    if args.rank0_tail:
        barrier()
        if RANK != 0:
            report["tail"] = "exited"
            return
        with _common.step(report, "tail", None) as record:
            model = AutoModelForCausalLM.from_pretrained("org/gpt2")
            record["fingerprint"] = _common.fingerprint(model)
        report["tail_done"] = time.time()


def _extras(report: dict, barrier: _common.Barrier, counter: _common.SafetensorsCounter) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")  # after the loads: patchload must not mind
    report["process_group"] = dist.get_world_size()

    with _common.step(report, "sgd", barrier) as record:
        model = AutoModelForCausalLM.from_pretrained("org/llama-tied")
        record.update(_sgd_step(model))
    dist.barrier()

    # Copy-on-write: in each round a fresh load, then one rank writes two parameters in place
    # (a follower in the first round, the leader of that load in the second); every rank hashes
    # its own copy before and after. The leader is the one rank that opened the checkpoint.
    cow = {}
    for round_name in ("follower_writes", "leader_writes"):
        mark = counter.snapshot()
        model = AutoModelForCausalLM.from_pretrained("org/llama")
        # The leader is the rank that read tensors (on transformers 4.x followers also open a
        # single-file checkpoint, for its metadata header).
        read = torch.tensor([counter.since(mark)["reads"]])
        gathered = [torch.zeros(1, dtype=torch.long) for _ in range(WORLD_SIZE)]
        dist.all_gather(gathered, read)
        readers = [r for r, t in enumerate(gathered) if int(t) > 0]
        leader = readers[0] if len(readers) == 1 else None
        followers = [r for r in range(WORLD_SIZE) if r != leader]
        writer = followers[0] if round_name == "follower_writes" else leader
        weight = model.model.embed_tokens.weight
        head = model.lm_head.weight
        before = {"embed": _common.tensor_sha(weight), "head": _common.tensor_sha(head)}
        dist.barrier()
        if RANK == writer:
            with torch.no_grad():
                weight.add_(1.0)
                head.mul_(-1.0)
        dist.barrier()
        after = {"embed": _common.tensor_sha(weight), "head": _common.tensor_sha(head)}
        cow[round_name] = {"writer": writer, "readers": readers, "before": before,
                           "after": after}
        dist.barrier()
        del model
    report["cow"] = cow
    dist.destroy_process_group()


if __name__ == "__main__":
    _common.main(body)
