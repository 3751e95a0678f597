"""Rank worker: one slow download and one config, for the log lines each rank prints.

``--without-rank0``: rank 0 makes no call at all (it stays alive, in no collective, until the
others made theirs); the others load one config (timed).

``--interrupt <repo>``: one ``AutoModelForCausalLM.from_pretrained(repo)`` that the test
interrupts on some rank (SIGINT, or SIGTERM with a handler that raises ``SystemExit(3)``, as
graceful-shutdown code does). Nothing is caught: the rank's exit status is the interpreter's
(-2 for a ``KeyboardInterrupt``, 3 for the ``SystemExit``); the report says what was raised
and when (``t_raised``, wall clock), or the model's fingerprint. ``$OUT/loading-<rank>`` marks
that the rank is about to load. ``PLT_OWN_CACHE=1``: each rank uses a hub cache of its own
(``$HF_HOME/rank-<rank>``), so that plain ranks do not race for one download.
``--basic-config``: the script calls ``logging.basicConfig(level=logging.INFO)`` after
``import patchload``, as ``run_clm.py`` does.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{os.environ.get('RANK', '0')}"
# Ctrl-C raises KeyboardInterrupt, as in a script started from a terminal: a test run started
# in the background by a non-interactive shell hands its processes SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
if os.environ.get("PLT_OWN_CACHE") == "1":
    os.environ["HF_HOME"] = os.path.join(os.environ["HF_HOME"], f"rank-{os.environ['RANK']}")

from _common import OUT, RANK, fingerprint, main, write_report  # noqa: E402


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
            (OUT / f"called-{RANK}").touch()
            return
        # Alive, in no collective, until the others made theirs (an exited rank 0 is seen).
        deadline = time.monotonic() + 120
        while not all((OUT / f"called-{r}").exists() for r in (1, 2)) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        return
    report["path"] = hf_hub_download("sig/slow", "model.safetensors")
    report["config"] = AutoConfig.from_pretrained("sig/slow").to_dict()


def interrupted(repo: str) -> None:
    """See the module docstring (``--interrupt``)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(3))
    report: dict = {"rank": RANK, "pid": os.getpid()}
    import patchload  # noqa: F401 - installs the patches (unless PATCHLOAD=0)
    from transformers import AutoModelForCausalLM

    (OUT / f"loading-{RANK}").write_text("")
    try:
        model = AutoModelForCausalLM.from_pretrained(repo)
    except BaseException as exc:
        report["raised"] = {"type": type(exc).__name__, "code": getattr(exc, "code", None),
                            "t_raised": time.time()}
        write_report(report)
        raise
    report["fingerprint"] = fingerprint(model)
    write_report(report)
    # A gloo group's teardown at finalization can abort a finished process (see _common.main).
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if "--interrupt" in sys.argv:
    interrupted(sys.argv[sys.argv.index("--interrupt") + 1])
else:
    main(body)
