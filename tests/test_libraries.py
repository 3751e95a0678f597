"""diffusers and peft through patchload: one download, leader's weights, bitwise equal to plain.

One torchrun job (3 ranks, CPU, gloo) runs ``tests/workers/libraries.py``: ``UNet2DModel`` and
``DiTTransformer2DModel`` (sharded, loaded as bf16) with ``subfolder=``, diffusers' ``AutoModel``,
``DDPMPipeline`` and ``DiffusionPipeline`` (DiT + VAE + scheduler), ``PeftModel.from_pretrained``
plus ``PeftModel.load_adapter``, transformers' ``load_adapter``, ``AutoPeftModelForCausalLM``, and
a missing pipeline and adapter (the leader's error on every rank). Each step fetches from repo ids
of its own on the session's loopback hub (``STEP_REPOS``), so the hub log says who fetched what.
The reference is the same worker in one ``PATCHLOAD=0`` process.
"""

from __future__ import annotations

import collections
import sys
from typing import Any

import pytest

_WHY = "not installed (in the [test] extra; .venv-tf4 has only test-core)"
pytest.importorskip("diffusers", reason=f"diffusers {_WHY}")
pytest.importorskip("peft", reason=f"peft {_WHY}")

from _launch import (Job, check_same_error_everywhere, diff_fingerprints,  # noqa: E402
                     gets_per_file, job_env, run_plain, run_torchrun, step_records)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="torchrun jobs with /proc and memfd: Linux only")

N = 3
JOB_TIMEOUT_S = 240

# step -> the only repo ids its requests may name (a cached repo may be reused by a later step)
STEP_REPOS = {
    "unet": ("dif/ddpm",),
    "dit_bf16": ("dif/dit",),
    "auto_vae": ("dif/dit",),
    "ddpm_pipeline": ("dif/ddpm-pipe",),
    "dit_pipeline": ("dif/dit-pipe",),
    "peft": ("org/llama-peft-base", "lora/a", "lora/b"),
    "peft_cache_dir": ("org/llama-peft-base3", "lora/e"),
    "hf_load_adapter": ("org/llama-peft-base2", "lora/c"),
    "auto_peft": ("lora/d", "org/llama-peft-base"),
}
ERROR_STEPS = ("missing_pipeline", "missing_adapter")
COLLECTIVE_STEPS = ("unet", "dit_bf16", "dit_pipeline")
MODEL_STEPS = ("unet", "dit_bf16", "auto_vae")
PIPELINE_STEPS = ("ddpm_pipeline", "dit_pipeline")


@pytest.fixture(scope="module")
def library_hub(hub: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The session hub, also serving the tiny diffusers pipelines and LoRA adapters."""
    from patchload.testing import models

    root = tmp_path_factory.mktemp("library-repos")
    ddpm = models.tiny_ddpm_pipeline(root / "ddpm")
    dit = models.tiny_dit_pipeline(root / "dit")
    llama = models.tiny_llama(root / "llama", seed=7)
    folders = {
        "dif/ddpm": ddpm, "dif/ddpm-pipe": ddpm, "dif/dit": dit, "dif/dit-pipe": dit,
        "org/llama-peft-base": llama, "org/llama-peft-base2": llama, "org/llama-peft-base3": llama,
    }
    for name, seed in (("a", 1), ("b", 2), ("c", 3), ("d", 4), ("e", 5)):
        folders[f"lora/{name}"] = models.tiny_lora(root / f"lora-{name}", llama, seed=seed,
                                                   base_repo_id="org/llama-peft-base")
    for repo_id, folder in folders.items():
        hub.add_repo(repo_id, folder)
    return hub


@pytest.fixture(scope="module")
def library_job(library_hub: Any, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """N=3, default transport (shm): every step, one after another, on a cold cache."""
    root = tmp_path_factory.mktemp("libraries")
    return run_torchrun(library_hub, "libraries", [], nproc=N,
                        env=job_env(library_hub.endpoint, root / "hf", root / "out"),
                        timeout_s=JOB_TIMEOUT_S).check_ok()


@pytest.fixture(scope="module")
def collective_job(library_hub: Any, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The diffusers steps again with ``PATCHLOAD_TRANSPORT=collective`` (gloo broadcast)."""
    root = tmp_path_factory.mktemp("libraries-collective")
    return run_torchrun(library_hub, "libraries", ["--steps", ",".join(COLLECTIVE_STEPS)],
                        nproc=N, timeout_s=JOB_TIMEOUT_S,
                        env=job_env(library_hub.endpoint, root / "hf", root / "out",
                                    PATCHLOAD_TRANSPORT="collective")).check_ok()


@pytest.fixture(scope="module")
def library_reference(library_hub: Any, tmp_path_factory: pytest.TempPathFactory
                      ) -> dict[str, Any]:
    """Plain calls: one process, ``PATCHLOAD=0``; every step (the error steps fail)."""
    root = tmp_path_factory.mktemp("libraries-reference")
    job = run_plain(library_hub, "libraries", ["--reference"],
                    env=job_env(library_hub.endpoint, root / "hf", root / "out", PATCHLOAD="0"),
                    timeout_s=JOB_TIMEOUT_S).check_ok()
    report = job.ranks[0]
    assert report["installed"] is False
    for name, record in report["steps"].items():
        assert ("error" in record) == (name in ERROR_STEPS), f"plain {name}: {record}"
    return report


def _models(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """name -> fingerprint of every model a step produced (pipelines: each module component)."""
    if "model" in record:
        return {"model": record["model"]}
    return {name: fp for name, fp in record["components"].items() if "tensors" in fp}


def _check_equal_to_plain(job: Job, reference: dict[str, Any], step: str) -> None:
    want = reference["steps"][step]
    for rank, record in step_records(job, step).items():
        got_models, want_models = _models(record), _models(want)
        assert sorted(got_models) == sorted(want_models) and want_models, (rank, step)
        for name in want_models:
            diffs = diff_fingerprints(got_models[name], want_models[name])
            assert diffs == [], f"rank {rank} {step} {name}:\n" + "\n".join(diffs)
        if step in PIPELINE_STEPS:
            assert record["components"] == want["components"], (rank, step)
        if "adapters" in want:
            assert record["adapters"] == want["adapters"], (rank, step)


def _check_read_once(job: Job, reference: dict[str, Any], step: str) -> None:
    """All ranks together open each checkpoint file the plain load opens, once: a model's
    followers open none (a pipeline's components may each have another leader)."""
    opened = {rank: record["checkpoint"]["files"] for rank, record in step_records(job, step).items()}
    everyone = sorted(name for files in opened.values() for name in files)
    assert everyone == sorted(reference["steps"][step]["checkpoint"]["files"]), (step, opened)
    assert everyone, step


@pytest.mark.timeout(600)
@pytest.mark.parametrize("step", list(STEP_REPOS))
def test_every_rank_equals_plain_load(library_job: Job, library_reference: dict[str, Any],
                                      step: str) -> None:
    _check_equal_to_plain(library_job, library_reference, step)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("step", COLLECTIVE_STEPS)
def test_collective_transport(collective_job: Job, library_reference: dict[str, Any],
                              step: str) -> None:
    """``PATCHLOAD_TRANSPORT=collective``: the same bitwise equality; weights read once."""
    _check_equal_to_plain(collective_job, library_reference, step)
    _check_read_once(collective_job, library_reference, step)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("step", list(STEP_REPOS))
def test_one_rank_downloads_each_file_once(library_job: Job, step: str) -> None:
    window = library_job.window(step)
    assert {r.repo_id for r in window} <= set(STEP_REPOS[step]) | {None}, \
        sorted({r.repo_id for r in window})
    ranks = collections.Counter(r.rank for r in window)
    assert len(ranks) == 1 and None not in ranks, f"{step}: requests per rank {dict(ranks)}"
    gets = gets_per_file(window)
    assert gets and max(gets.values()) == 1, f"{step}: {gets}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("step", MODEL_STEPS + PIPELINE_STEPS)
def test_weights_are_read_once(library_job: Job, library_reference: dict[str, Any],
                               step: str) -> None:
    """Diffusers weights come from the node leader: the others open no checkpoint file."""
    _check_read_once(library_job, library_reference, step)


@pytest.mark.timeout(600)
def test_cases_cover_what_they_claim(library_reference: dict[str, Any]) -> None:
    steps = library_reference["steps"]
    assert len(steps["dit_bf16"]["checkpoint"]["files"]) > 1  # sharded
    assert {t["dtype"] for t in steps["dit_bf16"]["model"]["tensors"].values()
            if t["kind"] == "param"} == {"torch.bfloat16"}
    assert steps["dit_bf16"]["model"]["tensors"]["pos_embed.pos_embed"]["kind"] == "buffer"
    assert set(_models(steps["dit_pipeline"])) == {"transformer", "vae"}
    assert "scheduler" in steps["dit_pipeline"]["components"]
    peft_names = steps["peft"]["model"]["tensors"]
    assert any(".lora_A.default." in n for n in peft_names)
    assert any(".lora_B.b." in n for n in peft_names)
    assert steps["peft"]["adapters"] == ["b", "default"]
    assert steps["hf_load_adapter"]["adapters"] == ["c"]
    assert any(".lora_B.default." in n for n in steps["auto_peft"]["model"]["tensors"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("step", ERROR_STEPS)
def test_leader_error_reaches_every_rank(library_job: Job, library_reference: dict[str, Any],
                                         step: str) -> None:
    """A missing pipeline repo or adapter: every rank raises the plain call's exception class
    (the followers a subclass naming the leader); only the ranks that led an attempt asked the
    hub (one that arrives after an attempt failed makes its own, as its plain call would)."""
    errors = check_same_error_everywhere(library_job, step)
    plain = library_reference["steps"][step]["error"]
    assert all(plain["mro"][0] in error["mro"] for error in errors.values()), (plain, errors)
    leaders = {rank for rank, error in errors.items() if not error["follower"]}
    assert {r.rank for r in library_job.window(step)} <= leaders


@pytest.mark.timeout(600)
def test_hub_functions_bound_by_name_are_wrapped_whatever_the_import_order(
        library_job: Job, library_reference: dict[str, Any]) -> None:
    """diffusers and peft bind hf_hub_download / snapshot_download / file_exists by name: each
    such binding holds patchload's wrapper, whether diffusers and peft are imported after
    patchload installed its patches (the job's ranks) or before (the reference installs them
    last)."""
    for order, aliases in (("patchload first", library_job.ranks[0]["aliases"]),
                           ("patchload last", library_reference["aliases_installed_later"])):
        for expected in ("diffusers.configuration_utils.hf_hub_download",
                         "diffusers.pipelines.pipeline_utils.snapshot_download",
                         "diffusers.loaders.single_file.snapshot_download",
                         "peft.utils.save_and_load.file_exists",
                         "peft.config.hf_hub_download"):
            assert expected in aliases, (order, expected, sorted(aliases))
        unwrapped = sorted(name for name, wrapped in aliases.items() if not wrapped)
        assert unwrapped == [], (order, unwrapped)
    assert not any(library_reference["aliases"].values())  # PATCHLOAD=0: nothing patched
