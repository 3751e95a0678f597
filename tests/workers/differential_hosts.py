"""One simulated host of the differential tests: a user's script that starts its ranks with
``torch.multiprocessing.spawn`` and builds the process group by hand (see
``tests/workers/differential.py``, plan key ``init_process_group``).

Usage: ``differential_hosts.py HOST HOSTS PROCS PLAN.json``: rank ``HOST * PROCS + i`` of
``HOSTS * PROCS`` for each spawned index ``i``. The test starts one per host, each under
``srun``'s variables for a step of ``HOSTS`` tasks, one per node, and in namespaces of its own
(hostname, PIDs, boot id) so that it is another host to patchload.

The ranks are told their number by ``PLT_RANK`` / ``PLT_WORLD_SIZE`` (test-only names that
patchload never reads): a spawn script sets no launcher variable.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "differential.py"


def _rank(index: int, host: int, hosts: int, procs: int, plan: str) -> None:
    os.environ["PLT_RANK"] = str(host * procs + index)
    os.environ["PLT_WORLD_SIZE"] = str(hosts * procs)
    sys.argv = [str(WORKER), plan]
    runpy.run_path(str(WORKER), run_name="__main__")


if __name__ == "__main__":
    import torch.multiprocessing as mp

    host, hosts, procs = (int(a) for a in sys.argv[1:4])
    mp.spawn(_rank, args=(host, hosts, procs, sys.argv[4]), nprocs=procs, join=True)
