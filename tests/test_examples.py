"""Runs every script in ``examples/`` with 2 ranks under torchrun against a loopback hub.

Each example must print one ``RESULT {json}`` line per rank; the ranks' weights hashes must agree
with each other and with a plain single-process load, exactly one rank (the leader) may talk to
the hub, and the other rank may read no checkpoint tensor bytes (measured by
``demo/site/sitecustomize.py``, injected through ``PYTHONPATH``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from demo import measure  # noqa: E402
from patchload.testing.hub import LoopbackHub  # noqa: E402

EXAMPLES = REPO_ROOT / "examples"
NPROC = 2
RUN_TIMEOUT_S = 120

# (script, repo id, factory name in patchload.testing.models[:dtype of the saved weights])
CASES = [
    # bf16 on disk, loaded as fp32: the weights go through the node's shared blob, and DDP's
    # construction must copy them out before its broadcast writes them
    ("train_causal_lm_ddp.py", "tiny/llama-bf16", "tiny_llama:bfloat16"),
    ("fsdp_t5.py", "tiny/t5", "tiny_t5"),
    ("rank0_first.py", "tiny/llama", "tiny_llama"),
    ("embed_minilm.py", "sentence-transformers/all-MiniLM-L6-v2", "minilm"),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """repo id -> folder, written once per module by the tiny-model factories."""
    import torch

    from patchload.testing import models

    root = tmp_path_factory.mktemp("repos")
    folders = {}
    for repo_id, factory in {c[1]: c[2] for c in CASES}.items():
        name, _, dtype = factory.partition(":")
        kwargs = {"dtype": getattr(torch, dtype)} if dtype else {}
        folders[repo_id] = getattr(models, name)(root / repo_id.replace("/", "--"), **kwargs)
    return folders


@pytest.fixture(scope="module")
def hub(folders: dict[str, Path]):
    with LoopbackHub() as hub:
        for repo_id, folder in folders.items():
            hub.add_repo(repo_id, folder)
        yield hub


def _example_module(script: str):
    spec = importlib.util.spec_from_file_location("example_" + script[:-3], EXAMPLES / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plain_sha(script: str, folder: Path) -> str:
    """The weights hash of a plain, single-process load of the repo folder (no patchload)."""
    import torch

    module = _example_module(script)
    if script == "embed_minilm.py":
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(folder), device="cpu")
    elif script == "fsdp_t5.py":
        from transformers import T5ForConditionalGeneration

        model = T5ForConditionalGeneration.from_pretrained(folder)
    else:
        from transformers import AutoModelForCausalLM

        dtype = torch.float32 if script == "train_causal_lm_ddp.py" else "auto"
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return module.weights_sha256(model)


def _plain_torchrun(hub: LoopbackHub, base: Path, script: str,
                    repo_id: str) -> dict[int, dict]:
    env = measure.run_env(endpoint=hub.endpoint, hf_home=base / "hf",
                          measure_dir=base / "measure", patchload_on=False)
    run = measure.torchrun(script, EXAMPLES / script, ["--model", repo_id], nproc=NPROC, env=env,
                           measure_dir=base / "measure", timeout_s=RUN_TIMEOUT_S)
    assert run.returncode == 0, f"plain torchrun exited {run.returncode}:\n{run.output[-4000:]}"
    return measure.results(run)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script,repo_id,factory", CASES, ids=[c[0][:-3] for c in CASES])
def test_example(hub: LoopbackHub, folders: dict[str, Path], tmp_path: Path, script: str,
                 repo_id: str, factory: str) -> None:
    hub.clear_requests()
    env = measure.run_env(endpoint=hub.endpoint, hf_home=tmp_path / "hf",
                          measure_dir=tmp_path / "measure", patchload_on=True,
                          extra={"PATCHLOAD_LOG_LEVEL": "INFO"})
    run = measure.torchrun(script, EXAMPLES / script, ["--model", repo_id], nproc=NPROC, env=env,
                           measure_dir=tmp_path / "measure", timeout_s=RUN_TIMEOUT_S)
    tail = run.output[-4000:]
    assert run.returncode == 0, f"torchrun exited {run.returncode}:\n{tail}"

    results = measure.results(run)
    assert sorted(results) == list(range(NPROC)), f"missing RESULT lines:\n{tail}"
    hashes = {r["weights_sha256"] for r in results.values()}
    assert len(hashes) == 1, f"ranks disagree on the weights: {results}"
    assert hashes == {_plain_sha(script, folders[repo_id])}, "differs from a plain load"
    if script == "embed_minilm.py":
        assert len({r["embedding_sha256"] for r in results.values()}) == 1
    if script == "rank0_first.py":
        assert len({r["first_loss"] for r in results.values()}) == 1
    figures = measure.rank_figures(run)
    assert sorted(figures) == list(range(NPROC)), "a rank left no measurement"
    readers = [r for r, f in figures.items() if f["checkpoint_tensor_bytes"] > 0]
    assert len(readers) == 1, f"ranks that read checkpoint tensors: {readers} (want one)"
    leader = readers[0]
    if script == "rank0_first.py":
        assert leader == 0

    by_rank: dict[int | None, list[str]] = {}
    for req in hub.requests():
        by_rank.setdefault(req.rank, []).append(f"{req.method} {req.path}")
    assert by_rank.get(leader), "the leader made no hub request"
    followers = {r: reqs for r, reqs in by_rank.items() if r is not None and r != leader}
    assert not followers, f"followers made hub requests: {followers}"

    if script == "train_causal_lm_ddp.py":  # last: the plain run adds its own hub requests
        copied = run.output.count("shared copy of the weights ended on this rank (wrapped in "
                                  "DistributedDataParallel")
        assert copied == NPROC, f"{copied} ranks copied their weights out before DDP:\n{tail}"
        plain = _plain_torchrun(hub, tmp_path / "plain", script, repo_id)
        assert {r: v["losses"] for r, v in results.items()} == \
            {r: v["losses"] for r, v in plain.items()}, "training differs from a plain run"
