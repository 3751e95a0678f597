"""Rank worker: one slow download and one config, for the log lines each rank prints.

``--without-rank0``: rank 0 makes no call at all; the others load one config (timed).
``--basic-config``: the script calls ``logging.basicConfig(level=logging.INFO)`` after
``import patchload``, as ``run_clm.py`` does.
"""

from __future__ import annotations

import logging
import os
import sys
import time

os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{os.environ.get('RANK', '0')}"

from _common import RANK, main  # noqa: E402


def body(report: dict) -> None:
    import patchload  # noqa: F401 - installs the patches
    from huggingface_hub import hf_hub_download
    from transformers import AutoConfig

    if "--basic-config" in sys.argv:
        logging.basicConfig(level=logging.INFO)
    if "--without-rank0" in sys.argv:
        if RANK != 0:
            start = time.monotonic()
            report["config"] = AutoConfig.from_pretrained("sig/alone").to_dict()
            report["elapsed_s"] = time.monotonic() - start
        return
    report["path"] = hf_hub_download("sig/slow", "model.safetensors")
    report["config"] = AutoConfig.from_pretrained("sig/slow").to_dict()


main(body)
