"""Rank worker: one slow download and one config, for the log lines each rank prints."""

from __future__ import annotations

import os

os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{os.environ.get('RANK', '0')}"

from _common import main  # noqa: E402


def body(report: dict) -> None:
    import patchload  # noqa: F401 - installs the patches
    from huggingface_hub import hf_hub_download
    from transformers import AutoConfig

    report["path"] = hf_hub_download("sig/slow", "model.safetensors")
    report["config"] = AutoConfig.from_pretrained("sig/slow").to_dict()


main(body)
