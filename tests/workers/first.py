"""Rank worker: patchload.main_process_first, in order and with the leader's error passed on."""

from __future__ import annotations

import time

from _common import main


def body(report: dict) -> None:
    import patchload

    with patchload.main_process_first(scope="node") as leads:
        entered = time.time()
        if leads:
            time.sleep(1.0)  # followers must not enter before this block is over
        report["ordered"] = {"leads": leads, "entered": entered, "left": time.time()}

    start = time.monotonic()
    try:
        with patchload.main_process_first(scope="job") as leads:
            if leads:
                raise ValueError("preprocessing failed: bad shard 7")
        report["failing"] = {"raised": None}
    except ValueError as err:
        report["failing"] = {"raised": type(err).__name__, "message": str(err),
                             "notes": [str(n) for n in getattr(err, "__notes__", None) or []],
                             "leader_failed": isinstance(err, patchload.LeaderFailedError),
                             "seconds": time.monotonic() - start}


main(body)
