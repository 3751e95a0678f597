"""Rank worker: diffusers models and pipelines, peft adapters (see tests/test_libraries.py).

Usage: ``libraries.py [--reference] [--steps a,b,...]`` (default: every step)

Each step (barriers around it) makes one user-level call and records a fingerprint of every model
it produced (sha256 of every named parameter and buffer, dtypes, ties, flags, config) and the
safetensors files the rank opened. ``--reference``: the same calls in a ``PATCHLOAD=0`` process.

The report also says which of diffusers' and peft's module-level hub functions hold patchload's
wrappers: in a job, patchload is installed at import, before diffusers and peft are imported; the
reference installs it at the end, after them (then uninstalls it).
"""

from __future__ import annotations

import os

os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{os.environ.get('RANK', '0')}"

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import _common  # noqa: E402

import patchload  # noqa: E402, F401 - installs the patches (unless PATCHLOAD=0)
import torch  # noqa: E402
import transformers  # noqa: E402
import diffusers  # noqa: E402
import peft  # noqa: E402
from diffusers import DDPMPipeline, DiffusionPipeline, DiTTransformer2DModel  # noqa: E402
from diffusers import UNet2DModel  # noqa: E402
from diffusers.loaders import single_file  # noqa: E402, F401 - binds snapshot_download by name
from peft import AutoPeftModelForCausalLM, PeftModel  # noqa: E402
from peft.utils import save_and_load  # noqa: E402, F401 - binds hf_hub_download, file_exists
from transformers import AutoModelForCausalLM  # noqa: E402

transformers.logging.set_verbosity_error()
diffusers.utils.logging.set_verbosity_error()

HUB_FUNCTIONS = ("hf_hub_download", "snapshot_download", "file_exists")


def fingerprint(model: Any) -> dict[str, Any]:
    """The tensors, ties and training flags (``_common.module_fingerprint``) and the model's
    config as JSON."""
    config = model.config.to_dict() if hasattr(model.config, "to_dict") else dict(model.config)
    # A pipeline's components load from the snapshot folder: the cache differs between jobs.
    config_json = json.dumps(config, default=str, sort_keys=True).replace(
        os.environ["HF_HOME"], "$HF_HOME")
    return {**_common.module_fingerprint(model), "config": json.loads(config_json)}


def _wrapped_aliases() -> dict[str, bool]:
    """``module.function`` -> holds patchload's wrapper, for every diffusers/peft module that
    bound a hub function by name."""
    out = {}
    for name, module in sorted(sys.modules.items()):
        if module is None or not name.startswith(("diffusers", "peft")):
            continue
        for function in HUB_FUNCTIONS:
            value = vars(module).get(function)
            if value is not None:
                out[f"{name}.{function}"] = bool(getattr(value, "_self_patchload", False))
    return out


def _pipeline(pipe: Any) -> dict[str, Any]:
    """Fingerprints of a pipeline's model components and its scheduler's config."""
    components = {}
    for name, component in sorted(pipe.components.items()):
        if isinstance(component, torch.nn.Module):
            components[name] = fingerprint(component)
        elif hasattr(component, "config"):
            components[name] = {"class": type(component).__name__,
                                "config": json.loads(json.dumps(dict(component.config),
                                                                default=str, sort_keys=True))}
    return {"class": type(pipe).__name__, "components": components}


def _calls() -> list[tuple[str, Any]]:
    """(step name, call returning what to fingerprint), in order."""

    def peft_from_pretrained() -> dict[str, Any]:
        base = AutoModelForCausalLM.from_pretrained("org/llama-peft-base")
        model = PeftModel.from_pretrained(base, "lora/a")
        model.load_adapter("lora/b", adapter_name="b")  # PeftModel.load_adapter
        return {"model": fingerprint(model), "adapters": sorted(model.peft_config)}

    def peft_cache_dir() -> dict[str, Any]:
        # A cache of the calls' own: peft asks file_exists (which takes no cache_dir) whether
        # the adapter has safetensors weights before downloading them into that cache.
        cache = os.path.join(os.environ["HF_HOME"], "own-cache")
        base = AutoModelForCausalLM.from_pretrained("org/llama-peft-base3", cache_dir=cache)
        model = PeftModel.from_pretrained(base, "lora/e", cache_dir=cache)
        return {"model": fingerprint(model), "adapters": sorted(model.peft_config)}

    def hf_load_adapter() -> dict[str, Any]:
        model = AutoModelForCausalLM.from_pretrained("org/llama-peft-base2")
        model.load_adapter("lora/c", adapter_name="c")  # transformers' PeftAdapterMixin
        return {"model": fingerprint(model), "adapters": sorted(model.peft_config)}

    return [
        ("unet", lambda: {"model": fingerprint(
            UNet2DModel.from_pretrained("dif/ddpm", subfolder="unet"))}),
        ("dit_bf16", lambda: {"model": fingerprint(DiTTransformer2DModel.from_pretrained(
            "dif/dit", subfolder="transformer", torch_dtype=torch.bfloat16))}),
        ("auto_vae", lambda: {"model": fingerprint(diffusers.AutoModel.from_pretrained(
            "dif/dit", subfolder="vae"))}),
        ("ddpm_pipeline", lambda: _pipeline(DDPMPipeline.from_pretrained("dif/ddpm-pipe"))),
        ("dit_pipeline", lambda: _pipeline(DiffusionPipeline.from_pretrained("dif/dit-pipe"))),
        ("peft", peft_from_pretrained),
        ("peft_cache_dir", peft_cache_dir),
        ("hf_load_adapter", hf_load_adapter),
        # loads the adapter's base model (base_model_name_or_path), then the adapter
        ("auto_peft", lambda: {"model": fingerprint(
            AutoPeftModelForCausalLM.from_pretrained("lora/d"))}),
        # the leader's error, on every rank
        ("missing_pipeline", lambda: {"loaded": repr(DiffusionPipeline.from_pretrained(
            "dif/missing"))}),
        ("missing_adapter", lambda: {"loaded": repr(PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained("org/llama-peft-base"), "lora/missing"))}),
    ]


def body(report: dict) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--steps", default="")
    args = parser.parse_args()
    report["installed"] = patchload.is_installed()
    report["versions"] = {"diffusers": diffusers.__version__, "peft": peft.__version__}
    report["aliases"] = _wrapped_aliases()
    barrier = _common.Barrier()
    counter = _common.SafetensorsCounter()
    wanted = set(filter(None, args.steps.split(",")))
    for name, call in _calls():
        if wanted and name not in wanted:
            continue
        with _common.step(report, name, barrier) as record:
            mark = counter.snapshot()
            result = _common.attempt(call)
            record["checkpoint"] = counter.since(mark)
        if result["ok"]:
            record.update(result["value"])
        else:
            record["error"] = result["error"]
    if args.reference:
        patchload.install()  # now that diffusers and peft are imported
        report["aliases_installed_later"] = _wrapped_aliases()
        patchload.uninstall()


if __name__ == "__main__":
    _common.main(body)
