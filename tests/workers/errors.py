"""Rank worker: calls whose leader meets an error (see tests/test_download.py, test_load.py).

Usage: ``errors.py [--steps a,b]``

Every step is one call (barriers around it) expected to fail; the report holds, per rank, the
exception's class, bases, message, leader rank, elapsed seconds and the wall time it was raised.
Faults are attached to the repo ids by the test's hub (all ranks alike: followers never reach the
network anyway). ``closed_port_model`` expects the job's ``HF_ENDPOINT`` to name a port nobody
listens on.

``PLT_HUB_WAIT_SCALE``: huggingface_hub's sleeps between its retries scaled (see
``_common.shorten_hub_waits``): a 500 or a closed port costs 23 s a file by default, all of it
asleep.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{os.environ.get('RANK', '0')}"

import argparse  # noqa: E402

import _common  # noqa: E402

ALL_STEPS = ("missing_model", "missing_file", "gated_model", "gated_file", "server_error_model",
             "corrupt_model", "truncated_model")


def body(report: dict) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", default=",".join(ALL_STEPS))
    args = parser.parse_args()

    import patchload  # noqa: F401
    import transformers
    from huggingface_hub import hf_hub_download

    _common.shorten_hub_waits()
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    calls = {
        "missing_model": lambda: AutoModelForCausalLM.from_pretrained("err/does-not-exist"),
        "missing_file": lambda: hf_hub_download("err/does-not-exist", "config.json"),
        "gated_model": lambda: AutoModelForCausalLM.from_pretrained("err/gated"),
        "gated_file": lambda: hf_hub_download("err/gated", "config.json"),
        "server_error_model": lambda: AutoModelForCausalLM.from_pretrained("err/server-error"),
        "closed_port_model": lambda: AutoModelForCausalLM.from_pretrained("org/llama-tied"),
        "corrupt_model": lambda: AutoModelForCausalLM.from_pretrained("err/corrupt"),
        "truncated_model": lambda: AutoModelForCausalLM.from_pretrained("err/truncated"),
    }
    barrier = _common.Barrier()
    for name in [s for s in args.steps.split(",") if s]:
        with _common.step(report, name, barrier) as record:
            record.update(_common.attempt(calls[name]))
        record.pop("value", None)


if __name__ == "__main__":
    _common.main(body)
