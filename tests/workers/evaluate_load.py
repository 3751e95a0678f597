"""Rank worker: ``evaluate.load`` calls (see tests/test_evaluate.py).

Usage: ``evaluate_load.py --steps name,name,...``; each step is one ``evaluate.load`` of
:data:`STEPS` and one ``compute()`` of the metric it returned, with test barriers around it so
the hub log cuts into per-step windows. The report holds, per step, the metric (its module and
class, name, module hash) and what ``compute()`` returned, or the exception; and every HTTP
request this rank's step sent through ``requests`` (the hub's and any other host's: evaluate's
download counter asks S3), by method and URL.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{os.environ.get('RANK', '0')}"

import argparse  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import _common  # noqa: E402

PREDICTIONS = [0, 1, 1, 0, 1]
REFERENCES = [0, 1, 0, 0, 1]
# step -> (args, kwargs) of evaluate.load
STEPS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "missing": (("no-such-metric",), {}),
    "accuracy": (("accuracy",), {}),
    "accuracy_again": (("accuracy",), {}),
    "community": (("org/exact_match",), {}),
}
# Seconds rank 0 waits before a step's call: the others reach it first and wait for rank 0's
# attempt (a leader's failure takes milliseconds; a rank arriving after it makes its own).
LATE = {"missing": 2.0}


def body(report: dict[str, Any]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", default=",".join(STEPS))
    args = parser.parse_args()

    import patchload
    import evaluate
    import evaluate.loading
    import requests.adapters

    report["installed"] = patchload.is_installed()
    report["factory_patched"] = \
        type(evaluate.loading.evaluation_module_factory).__name__ == "FunctionWrapper"
    sent: list[str] = []
    original_send = requests.adapters.HTTPAdapter.send

    def counting_send(self: Any, request: Any, *a: Any, **kw: Any) -> Any:
        sent.append(f"{request.method} {request.url}")
        return original_send(self, request, *a, **kw)

    requests.adapters.HTTPAdapter.send = counting_send
    barrier = _common.Barrier()
    for name in [s for s in args.steps.split(",") if s]:
        call_args, call_kwargs = STEPS[name]

        def call(call_args: tuple[Any, ...] = call_args,
                 call_kwargs: dict[str, Any] = call_kwargs, late: float = LATE.get(name, 0.0)
                 ) -> dict[str, Any]:
            if _common.RANK == 0:
                time.sleep(late)
            metric = evaluate.load(*call_args, **call_kwargs)
            return {"class": f"{type(metric).__module__}.{type(metric).__qualname__}",
                    "name": metric.name, "hash": metric._hash,
                    "computed": metric.compute(predictions=PREDICTIONS, references=REFERENCES)}

        with _common.step(report, name, barrier) as record:
            del sent[:]
            with _common.patchload_lines() as lines:
                record.update(_common.attempt(call))
            record["sent"] = list(sent)
            record["lines"] = lines


if __name__ == "__main__":
    _common.main(body)
