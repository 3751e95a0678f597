"""Single-process checks: configuration, topology, errors, patch installation and removal."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from patchload import Config, ConfigError, LeaderFailedError, load_config
from patchload._errors import describe_exception, follower_exception
from patchload._topology import current_topology

pytestmark = pytest.mark.timeout(120)


def test_config_defaults_and_values():
    cfg = load_config({})
    assert (cfg.enabled, cfg.download_scope, cfg.broadcast, cfg.transport) == (True, "auto", True,
                                                                             "auto")
    assert (cfg.timeout_s, cfg.heartbeat_s, cfg.bucket_bytes) == (None, 5.0, 256 * 2**20)
    assert (cfg.claim_grace_s, cfg.exit_wait_s, cfg.arrival_window_s, cfg.group_timeout_s,
            cfg.progress_warning_s) == (120.0, 60.0, 5.0, 300.0, 60.0)
    cfg = load_config({"PATCHLOAD": "yes", "PATCHLOAD_DOWNLOAD_SCOPE": " JOB ",
                       "PATCHLOAD_BUCKET_MB": "1.5", "PATCHLOAD_TIMEOUT": "20",
                       "PATCHLOAD_CLAIM_GRACE": "0", "PATCHLOAD_EXIT_WAIT": "0",
                       "PATCHLOAD_ARRIVAL_WINDOW": "2.5", "PATCHLOAD_PROGRESS_WARNING": "none",
                       "PATCHLOAD_GROUP_TIMEOUT": "30", "PATCHLOAD_HEARTBEAT": ""})
    assert (cfg.enabled, cfg.download_scope, cfg.bucket_bytes, cfg.timeout_s) == (
        True, "job", int(1.5 * 2**20), 20.0)
    assert (cfg.claim_grace_s, cfg.exit_wait_s, cfg.arrival_window_s, cfg.group_timeout_s,
            cfg.progress_warning_s, cfg.heartbeat_s) == (0.0, 0.0, 2.5, 30.0, None, 5.0)


@pytest.mark.parametrize("raw", ["none", "None", " NONE ", "inf", "Infinity"])
def test_timeout_none_means_no_bound(raw):
    assert load_config({"PATCHLOAD_TIMEOUT": raw}).timeout_s is None


@pytest.mark.parametrize("raw,value", [(v, True) for v in ("1", "true", "YES", "On")]
                         + [(v, False) for v in ("0", "False", "no", "OFF")])
def test_switch_spellings(raw, value):
    assert load_config({"PATCHLOAD_BROADCAST": raw}).broadcast is value


@pytest.mark.parametrize("name,value,accepted", [
    ("PATCHLOAD", "maybe", "1 or 0 (also true/false, yes/no, on/off, any case)"),
    ("PATCHLOAD_DOWNLOAD_SCOPE", "cluster", "auto / node / job"),
    ("PATCHLOAD_TRANSPORT", "nccl", "auto / shm / collective"),
    ("PATCHLOAD_TIMEOUT", "-3", "a positive number of seconds, at most 1e9, or none (no bound; "
                                "also inf)"),
    ("PATCHLOAD_TIMEOUT", "0", "a positive number of seconds, at most 1e9, or none"),
    ("PATCHLOAD_TIMEOUT", "1e308", "a positive number of seconds, at most 1e9, or none"),
    ("PATCHLOAD_HEARTBEAT", "fast", "a positive finite number"),
    ("PATCHLOAD_HEARTBEAT", "inf", "a positive finite number"),
    ("PATCHLOAD_BUCKET_MB", "0", "a positive finite number of MiB, at least one byte"),
    # Rounds to 0 bytes: a broadcast could not be cut into buckets.
    ("PATCHLOAD_BUCKET_MB", "1e-9", "a positive finite number of MiB, at least one byte"),
    ("PATCHLOAD_CLAIM_GRACE", "-1", "a finite number >= 0 of seconds, at most 1e9"),
    # Longer waits overflow the store's timeout (datetime.timedelta) and the threads'.
    ("PATCHLOAD_CLAIM_GRACE", "1e14", "a finite number >= 0 of seconds, at most 1e9"),
    ("PATCHLOAD_GROUP_TIMEOUT", "1e308", "a positive finite number of seconds, at most 1e9"),
    ("PATCHLOAD_EXIT_WAIT", "none", "a finite number >= 0"),
    ("PATCHLOAD_ARRIVAL_WINDOW", "0", "a positive finite number"),
    ("PATCHLOAD_PROGRESS_WARNING", "soon", "a positive number of seconds, at most 1e9, or none"),
    ("PATCHLOAD_LOG_LEVEL", "LOUD", "DEBUG / INFO"),
])
def test_bad_config_names_variable_and_accepted_values(name, value, accepted):
    with pytest.raises(ConfigError) as info:
        load_config({name: value})
    assert name in str(info.value) and repr(value) in str(info.value)
    assert accepted in str(info.value)
    assert info.value.variable == name and isinstance(info.value, ValueError)


def test_bad_config_names_the_rank_in_a_distributed_job():
    env = {"PATCHLOAD_TRANSPORT": "nccl", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
           "LOCAL_WORLD_SIZE": "2"}
    with pytest.raises(ConfigError) as info:
        load_config(env)
    assert str(info.value) == ("PATCHLOAD_TRANSPORT='nccl' is not valid on rank 1: accepted "
                               "values are auto / shm / collective")
    assert info.value.rank == 1


def test_bad_config_fails_the_import():
    env = {**os.environ, "PATCHLOAD_TRANSPORT": "carrier-pigeon"}
    proc = subprocess.run([sys.executable, "-c", "import patchload"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "PATCHLOAD_TRANSPORT='carrier-pigeon' is not valid" in proc.stderr


_PLUGINS = Path(__file__).parent / "plugins"


def _with_plugin_path(tmp_path: Path, entry_points: str) -> dict[str, str]:
    """An environment where one more installed package registers ``entry_points``."""
    info = tmp_path / "plt_broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plt-broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)
    (tmp_path / "plt_broken.py").write_text("class NotATransport:\n    name = 'broken'\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), str(_PLUGINS), str(Path(__file__).parent.parent)])}


def test_a_transport_an_installed_package_registers_is_found_by_name(tmp_path):
    code = """
import json, patchload
from patchload.transport.registry import transports
t = transports().get(patchload._state.config().transport)
print(json.dumps({"names": transports().names(), "class": type(t).__name__, "scope": t.scope}))
"""
    env = {**_with_plugin_path(tmp_path, "[patchload.transports]\nbroken = plt_broken:NotATransport\n"),
           "PATCHLOAD_TRANSPORT": "copy"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {
        "names": ["shm", "collective", "broken", "copy"], "class": "CopyWeights", "scope": "node"}


def test_a_registered_object_that_is_not_a_transport_is_refused(tmp_path):
    code = """
from patchload.transport.registry import transports
try:
    transports().get("broken")
except TypeError as err:
    print(err)
"""
    env = _with_plugin_path(tmp_path, "[patchload.transports]\nbroken = plt_broken:NotATransport\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "the transport registered as 'broken' (entry point group 'patchload.transports') is " \
        "not a WeightTransport: missing ['verb', 'collective', 'scope'," in proc.stdout


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PATCHLOAD")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env},
                          capture_output=True, text=True, timeout=60)


def test_disabled_validates_nothing_else():
    assert load_config({"PATCHLOAD": "0", "PATCHLOAD_TIMEOUT": "abc",
                        "PATCHLOAD_TRANPORT": "shm"}) == Config(enabled=False)
    code = """
import patchload
print(patchload.is_installed())
try:
    patchload.patch()  # asking for the patches explicitly reads and validates everything
except patchload.ConfigError as err:
    print(err)
"""
    proc = _python(code, PATCHLOAD="0", PATCHLOAD_TIMEOUT="abc")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "False", "PATCHLOAD_TIMEOUT='abc' is not valid: accepted values are a positive number "
                 "of seconds, at most 1e9, or none (no bound; also inf)"]
    assert proc.stderr == ""


def test_unknown_variable_warns_once_with_the_closest_name(caplog, monkeypatch):
    from patchload import _config, _runtime

    monkeypatch.setattr(_runtime.current().part(_config._Warned), "names", set())
    env = {"PATCHLOAD_TRANPORT": "shm", "PATCHLOAD_XYZZY": "node", "PATCHLOAD_HUB_LOG_LEVEL": "x",
           "PATCHLOAD_MEASURE_DIR": "/m", "PATCHLOADER": "1", "PATCHLOAD": "1"}
    with caplog.at_level(logging.WARNING, logger="patchload"):
        assert load_config(env).transport == "auto"  # ignored
        load_config(env)  # once per install
    assert [(r.name, r.levelno) for r in caplog.records] == [("patchload._config",
                                                             logging.WARNING)] * 2
    assert sorted(r.getMessage() for r in caplog.records) == [
        "patchload [rank 0/1] unknown variable PATCHLOAD_TRANPORT (did you mean "
        "PATCHLOAD_TRANSPORT?): ignored",
        "patchload [rank 0/1] unknown variable PATCHLOAD_XYZZY: ignored (patchload reads PATCHLOAD, "
        "PATCHLOAD_DOWNLOAD_SCOPE, PATCHLOAD_BROADCAST, PATCHLOAD_TRANSPORT, PATCHLOAD_TIMEOUT, "
        "PATCHLOAD_HEARTBEAT, PATCHLOAD_CLAIM_GRACE, PATCHLOAD_EXIT_WAIT, "
        "PATCHLOAD_ARRIVAL_WINDOW, PATCHLOAD_GROUP_TIMEOUT, PATCHLOAD_PROGRESS_WARNING, "
        "PATCHLOAD_SCOPE_WAIT, PATCHLOAD_BUCKET_MB, PATCHLOAD_FS_READ_MB, PATCHLOAD_LOG_LEVEL)"]


def test_unknown_variable_is_reported_at_import():
    proc = _python("import patchload; print(patchload.load_config().transport)",
                   PATCHLOAD_TRANPORT="shm")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "auto\n"
    assert proc.stderr == ("patchload [rank 0/1] unknown variable PATCHLOAD_TRANPORT (did you "
                           "mean PATCHLOAD_TRANSPORT?): ignored\n")
    # Disabled: nothing is read, nothing reported.
    proc = _python("import patchload", PATCHLOAD="off", PATCHLOAD_TRANPORT="shm")
    assert (proc.returncode, proc.stderr) == (0, "")


@pytest.mark.parametrize("env,expected", [
    ({}, (0, 1, 0, 1, 0, "none")),
    ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
      "GROUP_RANK": "1"}, (5, 8, 1, 4, 1, "torchrun")),
    ({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2",
      "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1"}, (6, 8, 2, 4, 1, "slurm")),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     (3, 4, 1, 2, 1, "mpi")),
    # the deepspeed launcher: torchrun's rank names, its own for the node
    ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_SIZE": "4", "CROSS_RANK": "1",
      "CROSS_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, (5, 8, 1, 4, 1, "deepspeed")),
    # srun without --ntasks-per-node: the step's layout
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1",
      "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
      "SLURM_NODEID": "1"}, (3, 4, 1, 2, 1, "slurm")),
    # ranks started by hand with RANK and WORLD_SIZE only: one node
    ({"RANK": "2", "WORLD_SIZE": "3"}, (2, 3, 2, 3, 0, "torchrun")),
    # torchrun inside a SLURM allocation: torchrun's variables describe the process
    ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
      "GROUP_RANK": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
      "SLURM_NODEID": "1"}, (5, 8, 1, 4, 1, "torchrun")),
])
def test_topology_from_launcher_variables(env, expected):
    t = current_topology(env)
    assert (t.rank, t.world_size, t.local_rank, t.local_world_size, t.node, t.launcher) == expected


def test_follower_exception_keeps_class_and_pickles():
    from huggingface_hub.errors import EntryNotFoundError

    try:
        raise EntryNotFoundError("404 Client Error: entry not found")
    except EntryNotFoundError as err:
        description = describe_exception(err)
    json.dumps(description)  # crosses ranks as JSON, never pickle
    exc = follower_exception(description, rank=2, leader_rank=0, note="[rank 2/3] x failed")
    assert isinstance(exc, EntryNotFoundError) and isinstance(exc, LeaderFailedError)
    assert str(exc) == "404 Client Error: entry not found"  # the plain call's message
    assert exc.__notes__ == ["[rank 2/3] x failed"]  # printed under it in a traceback
    assert (exc.rank, exc.leader_rank) == (2, 0)
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is type(exc) and str(again) == str(exc)
    assert again.__notes__ == exc.__notes__
    assert describe_exception(exc)["qualname"] == "EntryNotFoundError"


def test_follower_exception_of_unknown_class_is_leader_failed():
    exc = follower_exception({"module": "not.imported", "qualname": "Boom", "message": "m"},
                             rank=1, leader_rank=0, note="p")
    assert type(exc) is LeaderFailedError and "p: m" in str(exc) and "not.imported.Boom" in str(exc)


def _two_rank_calls(name: str, config: Config | None = None):
    """A store server and a function giving rank 0's or 1's view of one job-scoped call."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from patchload._topology import Topology
    from patchload.coordination import protocol
    from patchload.coordination.store import JobStore

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))

    def call_of(rank: int) -> protocol.Call:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                               timeout=timedelta(seconds=30))
        return protocol.Call(f"t/{name}/", "load()", "job",
                             Topology(rank, 2, rank, 2, 0, "torchrun"), config or Config(),
                             JobStore(client, "agent", threading.RLock()))

    return server, call_of


@pytest.mark.timeout(60)
def test_a_follower_whose_leader_failed_after_announcing_its_files_runs_its_own_part():
    """A model load's follower that arrived before its leader failed, and looked only after
    (still in its ``idle`` work), runs its own part of the call as one that looked earlier does:
    what it raises (its own error where its own build fails, else the leader's at the reading
    step) must not depend on timing."""
    import threading

    from patchload.coordination import protocol

    server, call_of = _two_rank_calls("announced-then-failed")
    leader_failed = threading.Event()
    seen: dict[str, object] = {}

    def lead(call: protocol.Call):
        call.store.store.wait([call.keys.arrived(1)])  # the follower follows this attempt
        protocol.files_ready(call)
        raise ValueError("the leader's own __init__ failed")

    def leader() -> None:
        try:
            protocol.leader_first(call_of(0), lead, None, early=True)
        except ValueError as err:
            seen["leader"] = str(err)
        finally:
            leader_failed.set()

    def follow(call, role, leader):
        seen["followed"] = True
        try:
            leader.payload()
        except ValueError as err:  # the leader's error, at the reading step
            seen["payload"] = type(err).__mro__[1].__name__
        seen["failed_early"] = leader.failed_early()  # no: it announced its files first
        seen["failed"] = leader.failed()  # it published its error
        raise KeyError("this rank's own build failed")

    def follower() -> None:
        try:
            protocol.leader_first(call_of(1), None, follow, early=True,
                                  idle=lambda: leader_failed.wait(30))
        except Exception as err:  # noqa: BLE001 - recorded for the assertion
            seen["follower"] = repr(err)

    threads = [threading.Thread(target=follower), threading.Thread(target=leader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(45)
    # The leader's heartbeat thread ends once it beats no call (it looks every 0.1 s).
    for _ in range(50):
        if not any(t.name == "patchload-heartbeat" for t in threading.enumerate()):
            break
        threading.Event().wait(0.1)
    assert seen == {"leader": "the leader's own __init__ failed", "followed": True,
                    "payload": "ValueError", "failed_early": False, "failed": True,
                    "follower": "KeyError(\"this rank's own build failed\")"}, seen


@pytest.mark.timeout(60)
def test_a_leader_failed_only_where_it_published_an_error() -> None:
    """``LeaderView.failed``: true once the leader published an error outcome, false before
    any outcome (a leader that died or went silent publishes none: a zero-copy follower's own
    error then stands) and after a success."""
    import dataclasses

    from patchload.coordination import protocol
    from patchload.coordination.calls import Role

    _, call_of = _two_rank_calls("failed-or-not")
    role = Role(False, 0, 1, "node")
    for name, outcome, failed in (("none", None, False), ("ok", {"ok": True}, False),
                                  ("error", {"ok": False, "error": {"message": "m"}}, True)):
        zero, one = call_of(0), call_of(1)
        zero, one = (dataclasses.replace(c, key=f"{c.key}{name}/") for c in (zero, one))
        if outcome is not None:
            protocol.publish(zero, outcome)
        view = protocol.LeaderView(one, role)
        assert (view.failed(), view.failed_early()) == (failed, failed), name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("leader_ends", ["succeeds", "fails before announcing its files"])
def test_a_follower_that_starts_at_once_waits_only_for_the_leaders_same_hub_call(leader_ends):
    """A model load's follower starts its part at once; each of its hub calls waits for the
    leader's pin of that same file, not for the leader's outcome. A leader that fails before
    its files are announced ends every follower with its error, where it waits next."""
    import threading

    from patchload.coordination import protocol

    server, call_of = _two_rank_calls("pins-" + leader_ends.split()[0])
    weights_pinned = threading.Event()
    seen: dict[str, object] = {}

    def lead(call: protocol.Call):
        protocol.publish_pins(call, {"model:o/m:config.json": ["c0", "blob", 1]})
        # Goes on only once the follower is past its wait for that pin (it never waited for an
        # outcome that comes only after this).
        if not weights_pinned.wait(20):
            raise OSError("the follower's hub call waited for the leader's outcome")
        if leader_ends != "succeeds":
            raise OSError("the weights' download failed")
        protocol.files_ready(call)
        return "model", {"weights": None}, None

    def leader() -> None:
        try:
            protocol.leader_first(call_of(0), lead, None, early=True)
        except OSError as err:
            seen["leader"] = str(err)

    def follow(call, role, leader_view):
        leader_view.wait_pin("model:o/m:config.json")
        weights_pinned.set()  # the leader goes on only now
        leader_view.wait_pin("model:o/m:model.safetensors")
        return leader_view.payload()

    def follower() -> None:
        try:
            seen["follower"] = protocol.leader_first(call_of(1), None, follow, early=True)
        except OSError as err:
            seen["follower"] = f"{type(err).__mro__[1].__name__}: {str(err).splitlines()[0]}"

    threads = [threading.Thread(target=follower), threading.Thread(target=leader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(45)
    if leader_ends == "succeeds":
        assert seen["follower"] == {"weights": None}, seen
    else:
        assert seen["leader"] == "the weights' download failed", seen
        assert seen["follower"] == "OSError: the weights' download failed", seen


@pytest.mark.timeout(60)
def test_patchload_timeout_bounds_all_of_a_followers_waits_and_a_swallowed_one_stays_raised():
    """PATCHLOAD_TIMEOUT bounds a follower's waits for one leader together (a model load waits
    for several pins, then the outcome), not each of them; and once a wait timed out, a caller
    that swallowed the error (transformers falls back on the cache when a hub call raises) gets
    the same error at once from its next wait instead of a fresh timeout, unless the leader's
    outcome is published by then."""
    import threading
    import time

    from patchload import PatchloadTimeout
    from patchload.coordination import protocol

    server, call_of = _two_rank_calls("timeout-total", Config(timeout_s=2.0))
    release = threading.Event()
    seen: dict[str, object] = {}

    def lead(call: protocol.Call):
        time.sleep(1.4)
        protocol.publish_pins(call, {"a": ["c0"]})
        release.wait(30)  # alive and beating, but publishes nothing more
        return "model", {"weights": None}, None

    def follow(call, role, view):
        start = time.monotonic()
        view.wait_pin("a")
        seen["first"] = time.monotonic() - start
        for name, wait in (("pin", lambda: view.wait_pin("b")), ("payload", view.payload)):
            begun = time.monotonic()
            try:
                wait()
            except PatchloadTimeout as err:
                seen[name] = (time.monotonic() - begun, err)
        release.set()
        for _ in range(200):  # the leader publishes its success now
            with call.store.lock:
                if protocol._published(call) is not None:
                    break
            time.sleep(0.05)
        seen["later"] = view.payload()
        return None

    leader = threading.Thread(target=protocol.leader_first, args=(call_of(0), lead, None),
                              kwargs={"early": True})
    leader.start()
    protocol.leader_first(call_of(1), None, follow, early=True)
    release.set()
    leader.join(30)
    assert 1.0 < seen["first"] < 2.0, seen
    waited, error = seen["pin"]
    # The rest of the 2 s from the first wait (about 0.6 s), not another 2 s.
    assert waited < 1.5, seen
    assert "PATCHLOAD_TIMEOUT" in str(error)
    waited_again, again = seen["payload"]
    assert again is error and waited_again < 0.2, seen
    assert seen["later"] == {"weights": None}, seen


@pytest.mark.timeout(60)
def test_the_keys_of_a_small_call_are_deleted_off_the_callers_thread():
    """The last rank to finish a call that loads no model (a config, a warm download) leaves
    the deletion of its keys (about nine requests) to the key reaper's thread and client: in a
    warm loop the rank that finished last no longer pays them before its next call. The keys
    still go, soon after."""
    import dataclasses
    import threading
    import time

    from patchload.coordination import protocol

    server, call_of = _two_rank_calls("reaped-" + str(time.monotonic()))
    deleted_by: list[str] = []

    class Recording:  # the ranks' shared client; the reaper's clone() is not recorded
        def __init__(self, real):
            self._real = real

        def __getattr__(self, name):
            attr = getattr(self._real, name)
            if name != "delete_key":
                return attr

            def delete_key(key):
                deleted_by.append(threading.current_thread().name)
                return attr(key)
            return delete_key

    calls = [call_of(r) for r in range(2)]
    for call in calls:
        call.store.store = Recording(call.store.store)
    observer = call_of(0).store.store
    before = observer.num_keys()

    def one_call(i: int) -> None:
        mine = [dataclasses.replace(c, key=f"{c.key}{i}/") for c in calls]
        threads = [threading.Thread(target=protocol.leader_first, name=f"rank{r}", args=(
            mine[r], lambda c: (i, {"i": i}, None), lambda c, role, leader: leader.payload()))
            for r in (1, 0)]
        threads[0].start()
        time.sleep(0.01)  # rank 1 follows: rank 0 leads (no claim grace between threads)
        threads[1].start()
        for t in threads:
            t.join(20)

    for i in range(5):
        one_call(i)
    assert deleted_by == [], deleted_by  # neither rank's thread deleted a key
    deadline = time.monotonic() + 10
    while observer.num_keys() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert observer.num_keys() == before


@pytest.mark.timeout(60)
def test_a_heartbeat_under_way_when_the_call_ends_leaves_no_key(monkeypatch):
    """The heartbeat thread beats a led call at once; one still under way when the call ended
    and its last rank deleted its keys recreated two of them (the counter and its beat key), so
    a long job's store grew. Slowed here to make that overlap certain."""
    import dataclasses
    import threading
    import time

    from patchload.coordination import beats, protocol

    real_beat = beats.beat

    def slow_beat(call, **kwargs):
        if threading.current_thread().name == "patchload-heartbeat":
            time.sleep(0.03)
        real_beat(call, **kwargs)

    monkeypatch.setattr(beats, "beat", slow_beat)
    server, call_of = _two_rank_calls("beats-" + str(time.monotonic()))
    observer = call_of(0).store.store

    def one_call(i: int) -> None:
        calls = [dataclasses.replace(call_of(r), key=f"{call_of(r).key}{i}/") for r in range(2)]
        threads = [threading.Thread(target=protocol.leader_first, args=(
            calls[0], lambda c: (i, {"i": i}, None), None)), threading.Thread(
            target=protocol.leader_first, args=(calls[1], None,
                                                lambda c, role, leader: leader.payload()))]
        threads[1].start()
        time.sleep(0.01)  # rank 1 follows: rank 0 leads (no claim grace between threads)
        threads[0].start()
        for t in threads:
            t.join(20)

    one_call(-1)
    time.sleep(0.3)
    before = observer.num_keys()
    for i in range(10):
        one_call(i)
    time.sleep(0.3)  # the heartbeat thread ends once it leads nothing
    assert observer.num_keys() == before


def test_a_load_materialises_in_its_own_thread_only_in_a_new_threads_torch_state():
    """transformers' loading pool makes its tensors in new threads: a caller's inference mode,
    no_grad, default device or dispatch mode does not reach them, so patchload materialises in
    the calling thread only where none of these is on."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from patchload.patches.transformers.materialize import state_of_a_new_thread

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert state_of_a_new_thread()
    for context in (torch.inference_mode(), torch.no_grad(), torch.device("cpu"),
                    torch.autocast("cpu"), Passing()):
        with context:
            assert not state_of_a_new_thread(), context
    assert state_of_a_new_thread()


def test_where_no_thread_can_start_a_load_materialises_as_a_plain_one(monkeypatch):
    import threading

    from patchload.patches.transformers.materialize import state_of_a_new_thread

    def refuse(thread):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    assert state_of_a_new_thread() is False


_PATCHED_NAMES = """
import json, huggingface_hub, huggingface_hub.file_download as fd, huggingface_hub._snapshot_download as sd
import huggingface_hub.repocard as rc, transformers.utils.hub as th
from transformers import AutoModelForCausalLM, AutoTokenizer, AutoConfig, PreTrainedModel
def ours(f): return bool(getattr(f, "_self_patchload", False))
print(json.dumps({
  "fd": ours(fd.hf_hub_download), "sd": ours(sd.snapshot_download),
  "sd_alias": ours(sd.hf_hub_download), "rc": ours(rc.hf_hub_download),
  "th": ours(th.hf_hub_download), "th_snap": ours(th.snapshot_download),
  "top": ours(huggingface_hub.hf_hub_download),
  "auto": ours(vars(AutoModelForCausalLM)["from_pretrained"]),
  "tok": ours(vars(AutoTokenizer)["from_pretrained"]),
  "cfg": ours(vars(AutoConfig)["from_pretrained"]),
  "model": ours(vars(PreTrainedModel)["from_pretrained"]),
}))
"""


@pytest.mark.parametrize("order", ["patchload first", "libraries first"])
def test_import_order_does_not_matter(order):
    first = "import patchload\n" if order == "patchload first" else ""
    last = "" if first else "import patchload\n"
    code = first + "import transformers.utils.hub, huggingface_hub.repocard\n" + last
    code += _PATCHED_NAMES
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PATCHLOAD": "1"})
    assert proc.returncode == 0, proc.stderr
    flags = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(flags.values()), flags


def test_disabled_installs_nothing_and_unpatch_restores_identity():
    code = """
import json, huggingface_hub.file_download as fd, huggingface_hub._snapshot_download as sd
import transformers.utils.hub as th
from transformers import AutoModelForCausalLM, PreTrainedModel
import patchload
from patchload._patching import installed_patches
before = {"fd": fd.hf_hub_download, "th": th.hf_hub_download, "sd": sd.snapshot_download,
          "auto": vars(AutoModelForCausalLM)["from_pretrained"],
          "model": vars(PreTrainedModel)["from_pretrained"],
          "lpm": vars(PreTrainedModel)["_load_pretrained_model"]}
now = lambda: {"fd": fd.hf_hub_download, "th": th.hf_hub_download, "sd": sd.snapshot_download,
               "auto": vars(AutoModelForCausalLM)["from_pretrained"],
               "model": vars(PreTrainedModel)["from_pretrained"],
               "lpm": vars(PreTrainedModel)["_load_pretrained_model"]}
out = {"disabled_count": len(installed_patches()), "installed_flag": patchload.is_installed()}
patchload.patch(); n = len(installed_patches()); patchload.patch()
out["idempotent"] = len(installed_patches()) == n and n > 0
out["changed"] = all(now()[k] is not v for k, v in before.items())
patchload.unpatch()
out["restored"] = all(now()[k] is v for k, v in before.items())
out["after_count"] = len(installed_patches())
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PATCHLOAD": "0"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"disabled_count": 0, "installed_flag": False, "idempotent": True,
                   "changed": True, "restored": True, "after_count": 0}


def test_names_a_package_copies_while_importing_are_patched_and_restored():
    # `import patchload` imports no torch: torch.distributed's patches land while `import torch`
    # runs, and torch.distributed copies them by name (`from .distributed_c10d import *`); so
    # does datasets' `from .load import load_dataset`. A user calls those names.
    code = """
import json, sys
import patchload
assert "torch" not in sys.modules
import torch.distributed as dist, torch.distributed.distributed_c10d as c10d, datasets, datasets.load
names = lambda: {"barrier": dist.barrier, "broadcast": dist.broadcast,
                 "load_dataset": datasets.load_dataset}
originals = {"barrier": c10d.barrier.__wrapped__, "broadcast": c10d.broadcast.__wrapped__,
             "load_dataset": datasets.load.load_dataset.__wrapped__}
out = {"patched": all(names()[k] is not v and names()[k].__wrapped__ is v
                      for k, v in originals.items())}
patchload.unpatch()
out["restored"] = all(names()[k] is v for k, v in originals.items())
out["c10d_restored"] = c10d.barrier is originals["barrier"]
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PATCHLOAD": "1"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"patched": True, "restored": True, "c10d_restored": True}


def test_errors_pickle_with_their_attributes():
    from patchload import PatchloadTimeout

    for exc in (PatchloadTimeout("t", rank=3, leader_rank=0, waited_s=2.5),
                LeaderFailedError("l", rank=1, leader_rank=0, cause="gone"),
                ConfigError("PATCHLOAD", "x", "1 or 0")):
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is type(exc) and str(again) == str(exc)
        assert again.__dict__ == exc.__dict__


def test_follower_exception_of_an_oserror_class():
    exc = follower_exception({"module": "builtins", "qualname": "FileNotFoundError",
                              "message": "no such file"}, rank=1, leader_rank=0, note="p")
    assert isinstance(exc, FileNotFoundError) and str(exc) == "no such file"
    assert isinstance(pickle.loads(pickle.dumps(exc)), FileNotFoundError)


def test_follower_exception_imports_only_known_packages():
    code = """
import sys, json
from patchload._errors import follower_exception
from patchload._libraries import hand_down
from patchload.patches import library_facts
hand_down(library_facts())  # what install() does (PATCHLOAD=0 here: nothing is installed)
out = {}
for module, qualname in (("safetensors", "SafetensorError"), ("xml.dom.minidom", "Node"),
                         ("antigravity", "Exception")):
    exc = follower_exception({"module": module, "qualname": qualname, "message": "m"},
                             rank=1, leader_rank=0, note="")
    out[module] = [type(exc).__mro__[1].__name__, module in sys.modules]
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PATCHLOAD": "0"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["safetensors"] == ["SafetensorError", True]  # the plain call would import it
    assert out["xml.dom.minidom"] == ["PatchloadError", False]  # never imported from the store
    assert out["antigravity"] == ["PatchloadError", False]


_PRIVATE_DIR = """
import json, os, stat
from patchload.coordination.store import private_dir
first, again = private_dir(), private_dir()
st = os.lstat(first)
print(json.dumps({"dir": str(first), "again": str(again), "uid": st.st_uid,
                  "mode": oct(stat.S_IMODE(st.st_mode)), "isdir": stat.S_ISDIR(st.st_mode)}))
"""


@pytest.mark.parametrize("squat", ["other owner", "open to others", "symlink", "file"])
def test_squatted_private_dir_falls_back_to_a_fresh_private_one(tmp_path, squat):
    uid = os.getuid()
    usual = tmp_path / f"patchload-{uid}"
    if squat == "other owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the directory to another user (os.chown)")
        usual.mkdir(mode=0o700)
        os.chown(usual, 65534, 65534)
        found = ("a directory", 65534, "0o700")
    elif squat == "open to others":
        usual.mkdir()
        usual.chmod(0o777)
        found = ("a directory", uid, "0o777")
    elif squat == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        usual.symlink_to(tmp_path / "elsewhere")
        found = ("a symlink", uid, "0o777")
    else:
        usual.write_text("")
        usual.chmod(0o600)
        found = ("not a directory", uid, "0o600")
    proc = _python(_PRIVATE_DIR, TMPDIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    fallback = out["dir"]
    assert fallback.startswith(f"{tmp_path}/patchload-{uid}-") and out["again"] == fallback
    assert (out["uid"], out["mode"], out["isdir"]) == (uid, "0o700", True)
    kind, owner, mode = found
    assert proc.stderr == (
        f"patchload [rank 0/1] patchload's private directory {usual} is unfit ({kind} owned by "
        f"uid {owner}, mode "
        f"{mode}; it must be a directory owned by uid {uid} with mode 0700): not using it; this "
        f"process uses {fallback} instead, so a node-local store is not shared with the other "
        f"ranks of this node\n")
    assert not os.path.exists(fallback)  # removed at exit (empty)
    assert usual.is_symlink() or usual.exists()  # the squatted path is left alone


def test_private_dir_is_created_0700_and_reused(tmp_path):
    proc = _python(_PRIVATE_DIR, TMPDIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out == {"dir": f"{tmp_path}/patchload-{os.getuid()}", "again": out["dir"],
                   "uid": os.getuid(), "mode": "0o700", "isdir": True}
    assert proc.stderr == ""


def test_main_process_first_job_scope_needs_a_job_wide_store(tmp_path):
    """srun, 2 nodes x 2 tasks, before init_process_group: only a node-local store exists, so a
    job-scoped block would get one leader per node at once; it raises instead, naming the cause."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "PATCHLOAD"))
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(SLURM_PROCID="0", SLURM_NTASKS="4", SLURM_LOCALID="0", SLURM_NODEID="0",
               SLURM_NTASKS_PER_NODE="2", SLURM_JOB_ID="77", TMPDIR=str(tmp_path))
    code = ("import patchload\n"
            "try:\n"
            "    with patchload.main_process_first(scope='job'):\n"
            "        print('block ran')\n"
            "except patchload.PatchloadError as err:\n"
            "    print('raised:', err)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("raised: [rank 0/4] main_process_first(scope='job'): no "
                                 "job-wide store to coordinate 2 nodes through"), out.stdout
    assert "block ran" not in out.stdout


def test_call_keys_render_what_decides_a_result_and_never_raise(tmp_path, monkeypatch):
    """The key of a call: a local source as its real path (whatever the working directory
    calls it; also through transformers 5's ``*model_args`` Auto signature), other strings as
    they are, a config with a set by its contents, and no rendering (Unrenderable) for what has
    no stable one: never an exception of another type."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from patchload.coordination.key import Unrenderable, deciding_arguments

    load = AutoModelForCausalLM.from_pretrained
    for rank in (0, 1):
        for folder in ("ckpt", "cfg", "hf"):
            (tmp_path / f"cwd-{rank}" / folder).mkdir(parents=True)
    keys = []
    for rank in (0, 1):
        monkeypatch.chdir(tmp_path / f"cwd-{rank}")
        keys.append(deciding_arguments(load, ("./ckpt",), {"cache_dir": "./hf",
                                                           "cache_folder": "./hf",
                                                           "config": "./cfg"}))
    assert keys[0]["__source__"] == f"path:{tmp_path / 'cwd-0' / 'ckpt'}"
    assert keys[1]["__source__"] == f"path:{tmp_path / 'cwd-1' / 'ckpt'}"
    # Any other argument naming a local path: "./cfg" names two configs here.
    assert keys[0]["__path__config"] == f"path:{tmp_path / 'cwd-0' / 'cfg'}"
    assert keys[1]["__path__config"] == f"path:{tmp_path / 'cwd-1' / 'cfg'}"
    # A folder the call writes into is not one it reads.
    assert keys[0]["cache_dir"] == keys[1]["cache_dir"] == "'./hf'"
    assert "__path__cache_dir" not in keys[0] and "__path__cache_folder" not in keys[0]
    assert "__source__" not in deciding_arguments(load, ("org/model",), {})

    config = LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=2)
    config.extra = {"b", "a"}  # a set: repr() of the config raises, to_dict() holds it
    rendered = deciding_arguments(load, ("org/model",), {"config": config})["config"]
    assert "set{'a','b'}" in rendered

    class NoRepr:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    class RaisingAttribute:
        def __getattr__(self, name: str) -> None:
            raise RuntimeError(f"no {name}")

    for value in (NoRepr(), RaisingAttribute(), lambda: None):
        with pytest.raises(Unrenderable):
            deciding_arguments(load, ("org/model",), {"thing": value})


@pytest.mark.tf4
@pytest.mark.timeout(60)
def test_call_keys_hold_the_real_path_of_a_download_folder(tmp_path, monkeypatch):
    """``local_dir="model"`` (or sentence-transformers' ``cache_folder``) in two working
    directories names two folders, existing or not: their calls have two keys; two names of
    one folder one key."""
    from huggingface_hub import snapshot_download

    from patchload.coordination.key import deciding_arguments

    keys = []
    for rank in (0, 1, 0):
        (tmp_path / f"cwd-{rank}").mkdir(exist_ok=True)
        monkeypatch.chdir(tmp_path / f"cwd-{rank}")
        keys.append(deciding_arguments(snapshot_download, ("org/model",),
                                       {"local_dir": "model", "cache_folder": "st"}))
    assert keys[0]["__dir__local_dir"] == f"dir:{tmp_path / 'cwd-0' / 'model'}"
    assert keys[1]["__dir__local_dir"] == f"dir:{tmp_path / 'cwd-1' / 'model'}"
    assert keys[0]["__dir__cache_folder"] != keys[1]["__dir__cache_folder"]
    assert keys[0] == keys[2]
    absolute = deciding_arguments(snapshot_download, ("org/model",),
                                  {"local_dir": tmp_path / "cwd-0" / "model"})
    assert absolute["__dir__local_dir"] == keys[0]["__dir__local_dir"]
    assert "__dir__local_dir" not in deciding_arguments(snapshot_download, ("org/model",), {})


@pytest.mark.tf4
@pytest.mark.timeout(120)
def test_local_dir_pins_are_its_download_metadata(tmp_path):
    """What a rank's ``local_dir`` download pins (``call._local_dir_result_pin``) and a follower
    compares with its leader's: real downloads from a loopback hub into folders at commit A and
    at commit B (same names and sizes): the pins differ; one folder agrees with itself; a file
    changed after its metadata, or without metadata, is unverifiable (differs even from
    itself): an offline rerun would return it unchecked."""
    from huggingface_hub import hf_hub_download, snapshot_download

    from patchload.coordination.call import _differences, _local_dir_result_pin
    from patchload.testing import LoopbackHub

    def commit(name: str, fill: str) -> Path:
        folder = tmp_path / name
        (folder / "sub").mkdir(parents=True)
        (folder / "config.json").write_text('{"a": 1}')
        (folder / "sub" / "weights.bin").write_text(fill * 64)
        return folder

    def fetch(local_dir: Path) -> tuple[list, list]:
        kwargs = {"endpoint": hub.endpoint, "cache_dir": tmp_path / "hf", "local_dir": local_dir}
        file = hf_hub_download("u/ld", "weights.bin", subfolder="sub", **kwargs)
        folder = snapshot_download("u/ld", **kwargs)
        return (_local_dir_result_pin("hf_hub_download", ("u/ld", "weights.bin"),
                                      {"subfolder": "sub", **kwargs}, file),
                _local_dir_result_pin("snapshot_download", ("u/ld",), kwargs, folder))

    with LoopbackHub() as hub:
        hub.add_repo("u/ld", commit("a", "A"))
        file_a, snapshot_a = fetch(tmp_path / "dir-a")
        hub.add_repo("u/ld", commit("b", "B"))
        file_b, snapshot_b = fetch(tmp_path / "dir-b")
    assert file_a[0] == "local_dir" and file_a[1][0][0] == "sub/weights.bin"
    assert file_a[1][0][1] != file_b[1][0][1] and file_a[1][0][2] != file_b[1][0][2]
    assert [e[0] for e in snapshot_b[1]] == ["config.json", "sub/weights.bin"]
    for mine, leader in ((file_a, file_b), (snapshot_a, snapshot_b)):
        assert _differences({"k": mine}, {"k": leader}), (mine, leader)
        assert _differences({"k": leader}, {"k": leader}) == []
    weights = tmp_path / "dir-b" / "sub" / "weights.bin"
    later = weights.stat().st_mtime + 10
    os.utime(weights, (later, later))  # changed since huggingface_hub wrote its metadata
    touched = _local_dir_result_pin("hf_hub_download", ("u/ld", "weights.bin"),
                                    {"subfolder": "sub", "local_dir": tmp_path / "dir-b"},
                                    str(weights))
    assert _differences({"k": touched}, {"k": touched}), touched
    metadata = tmp_path / "dir-b" / ".cache" / "huggingface" / "download" / "config.json.metadata"
    metadata.unlink()
    snapshot = _local_dir_result_pin("snapshot_download", ("u/ld",), {"local_dir": "x"},
                                     str(tmp_path / "dir-b"))
    assert [e[0] for e in snapshot[1]] == ["sub/weights.bin"]  # what the metadata names
    assert _differences({"k": snapshot}, {"k": snapshot}), snapshot  # touched, as above


def test_call_keys_hold_the_process_state_that_decides_a_result(monkeypatch, tmp_path):
    """Ranks that differ in hub endpoint, offline mode or (for a model load)
    inference mode, default dtype or default device never share a call: each part of :func:`process_state` follows its own
    setting, and the inference mode counts only for model loads."""
    import torch
    from huggingface_hub import constants

    from patchload.coordination.key import process_state

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    base = process_state(loads_model=True)
    assert base["__inference_mode__"] == "False"
    with torch.inference_mode():
        assert process_state(loads_model=True) == {**base, "__inference_mode__": "True"}
        assert process_state(loads_model=False) == process_state(loads_model=False)
        assert "__inference_mode__" not in process_state(loads_model=False)
    torch.set_default_dtype(torch.float64)
    try:
        assert process_state(loads_model=True) == {**base, "__default_dtype__": "torch.float64"}
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.device("meta"):
        assert process_state(loads_model=True) == {**base, "__default_device__": "meta"}
    monkeypatch.setattr(constants, "ENDPOINT", "http://mirror.example")
    assert process_state(loads_model=True) == {**base, "__endpoint__": "http://mirror.example"}
    monkeypatch.undo()
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert process_state(loads_model=True) == {**base, "__offline__": "True"}
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # Credentials are no key part (.credentials decides what ranks with other ones share), but
    # their digest follows the token file and HF_TOKEN, and never shows the token.
    from patchload.coordination.key import credentials_digest

    none = credentials_digest()
    (tmp_path / "token").write_text("hf_file\n")
    by_file = credentials_digest()
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    by_env = credentials_digest()
    assert process_state(loads_model=True) == base
    assert len({none, by_file, by_env}) == 3, (none, by_file, by_env)
    assert "hf_env" not in by_env and "hf_file" not in by_file


def test_follower_exception_keeps_what_handlers_read():
    """A retry handler written for the plain call (``e.response.status_code``, the
    ``Retry-After`` header, ``e.errno``) reads the same on a follower's rebuilt exception."""
    import errno as errnos
    import types

    from huggingface_hub.errors import HfHubHTTPError

    url = "http://127.0.0.1:9/org/m/resolve/main/config.json"
    response = types.SimpleNamespace(  # the parts of an HTTP client's response it reads
        status_code=429, url=url, request=None,
        headers={"retry-after": "3", "x-request-id": "req-7"})
    leader = HfHubHTTPError("429 Too Many Requests", response=response, server_message="slow")
    exc = follower_exception(json.loads(json.dumps(describe_exception(leader))), rank=1,
                             leader_rank=0, note="[rank 1/2] x failed")
    assert isinstance(exc, HfHubHTTPError) and isinstance(exc, LeaderFailedError)
    assert exc.response.status_code == 429
    assert exc.response.headers["retry-after"] == "3"
    assert exc.response.url == url
    assert (exc.request_id, exc.server_message) == ("req-7", "slow")

    disk = OSError(errnos.ENOSPC, "No space left on device", "/cache/blob.incomplete")
    exc = follower_exception(json.loads(json.dumps(describe_exception(disk))), rank=1,
                             leader_rank=0, note="")
    assert (exc.errno, exc.strerror, exc.filename) == (
        errnos.ENOSPC, "No space left on device", "/cache/blob.incomplete")


# --- copy-out before writes (patchload.transport.mapped_models) ----------------------------------

def _model_on_one_mapping():
    """Two linear layers, a tied weight and a buffer, each with a storage of its own over one
    region, made the way ``shm.attach`` makes them; and those storages."""
    import torch

    from patchload.transport import shm

    region = torch.arange(44, dtype=torch.float32).view(torch.uint8).numpy()

    def view(offset, shape, stride):
        return shm.tensor_view(region, offset * 4, torch.float32, shape, stride)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight  # tied: one Parameter under two names
    with torch.no_grad():
        model[0].weight.data = view(0, (4, 4), (1, 4))  # transposed: the stride must stay
        model[0].bias.data = view(16, (4,), (1,))
        model[1].bias.data = view(20, (4,), (1,))
    model.register_buffer("scale", view(24, (20,), (1,)))
    storages = [t.untyped_storage() for t in (model[0].weight, model[0].bias, model[1].bias,
                                              model.scale)]
    return model, storages


@pytest.mark.parametrize("hold", [None, "view", "storage", "inference"])
def test_copy_out_keeps_values_and_objects_and_refuses_what_it_cannot_keep(hold):
    import torch

    from patchload.transport.mapped_models import MappedModels

    model, storages = _model_on_one_mapping()
    mapped = MappedModels()
    mapped.add(model, storages, "[test]")
    bases = {s.data_ptr() for s in storages}
    del storages
    tensors = list(model.parameters()) + list(model.buffers())
    before = [(t.detach().clone(), t.stride()) for t in tensors]
    held = None
    if hold == "view":
        held = model[0].bias[:2]
    elif hold == "storage":
        held = model[0].bias.untyped_storage()
    if hold == "inference":
        with torch.inference_mode():
            mapped.before_writes(list(model.parameters()), "given to SGD")
    else:
        mapped.before_writes(list(model.parameters()), "given to SGD")

    after = list(model.parameters()) + list(model.buffers())
    assert [id(t) for t in after] == [id(t) for t in tensors]  # same objects
    assert model[1].weight is model[0].weight
    for (value, stride), t in zip(before, after):
        assert torch.equal(value, t) and t.stride() == stride
    copied = {t.untyped_storage().data_ptr() not in bases for t in after}
    # Every tensor of the model leaves the mapping at once, or none does.
    assert copied == ({True} if hold is None else {False}), hold
    assert not mapped  # copied or refused: not tried again
    del held


@pytest.mark.parametrize("end", ["bfloat16", "cpu:0", "del", "optimizer", "view kept"])
def test_the_end_of_the_shared_copy_is_one_info_line(end, caplog):
    """Whatever makes a model stop mapping the shared copy, one INFO line says so (within the
    watcher's 0.5 s), with the bytes copied out; a view still mapping it defers the line."""
    import gc
    import time

    import torch

    from patchload.transport.mapped_models import MappedModels

    model, storages = _model_on_one_mapping()
    mapped = MappedModels()
    mapped.add(model, storages, f"[rank 0/1] load {end}")  # other tests' lines may come too
    del storages
    held = None

    def ended() -> list[str]:
        time.sleep(1.2)
        return [r.getMessage() for r in caplog.records if f"load {end}: the node's shared copy"
                in r.getMessage()]

    head = f"patchload [rank 0/1] load {end}: the node's shared copy of the weights ended on this rank"
    with caplog.at_level(logging.INFO, logger="patchload"):
        assert ended() == []  # still mapped
        if end == "bfloat16":
            model.to(torch.bfloat16)
        elif end == "cpu:0":
            model.to(torch.device("cpu", 0))
        elif end == "del":
            del model
            gc.collect()
        elif end == "optimizer":
            mapped.before_writes(list(model.parameters()), "given to SGD")
        else:
            held = model[0].bias[:2]
            model.to(torch.bfloat16)
            assert ended() == []
            del held
        cause, nbytes = {
            "bfloat16": ("converted to torch.bfloat16", 176),
            "cpu:0": ("copied into new CPU tensors, as by Module.to(torch.device('cpu', 0)) in "
                      "the HF Trainer", 176),
            "del": ("the model was freed", 0),
            "optimizer": ("given to SGD, before they are written", 176),
            "view kept": ("converted to torch.bfloat16", 176)}[end]
        assert ended() == [f"{head} ({cause}): {nbytes} bytes copied out"]
        assert ended() == [f"{head} ({cause}): {nbytes} bytes copied out"]  # once


def test_credentials_repos_of_pins_and_when_credentials_matter(monkeypatch):
    """The repos a leader's pins name, each with a commit it resolved (file pins, revision
    pins, ``local_dir`` pins; absent files name their repo with no commit), and the calls whose
    credentials cannot change what they get (a token argument, offline)."""
    from huggingface_hub import constants

    from patchload.coordination.credentials import call_credentials, repos_of

    pins = {"model:org/a:config.json": ["c1", "blob", 10],
            "model:org/a:custom_generate/generate.py": None,
            "model:org/b:@main": ["c2"],
            "dataset:org/d:data/train.json": ["local_dir", [["data/train.json", "c3", "e", 4]]],
            "model:org/e:missing.json": None}
    assert repos_of(pins) == {("model", "org/a"): "c1", ("model", "org/b"): "c2",
                              ("dataset", "org/d"): "c3", ("model", "org/e"): ""}
    # The leader's recorded HTTP answers name their URL's repo (a known one or a new one).
    hub = "http://127.0.0.1:9/"
    answers = {f"http:GET {hub}api/models/org/a/revision/c1 da39#0": {},
               f"http:HEAD {hub}org/b/resolve/c2/config.json da39#0": {},
               f"http:GET {hub}api/datasets/org/d/tree/main da39#1": {},
               f"http:GET {hub}api/models/org/f da39#0": {},
               f"http:GET {hub}api/whoami-v2 da39#0": {}}
    # Another API's answer (the leader's identity) names no public repo.
    assert repos_of({**pins, **answers}) == {**repos_of(pins), ("model", "org/f"): "",
                                             ("model", "api/whoami-v2"): ""}
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert call_credentials({}) is not None and call_credentials({"token": True}) is not None
    assert call_credentials({"token": "hf_x"}) is None  # the key holds its digest
    assert call_credentials({"token": False}) is None
    assert call_credentials({"local_files_only": True}) is None
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert call_credentials({}) is None


@pytest.mark.timeout(60)
def test_a_rank_that_counted_a_call_rank0_never_made_does_not_wait_out_the_claim_grace():
    """Rank 1 counted a call that another rank led and rank 0 never made, so at its next call
    (one rank 0 passed by with a call of its own, as when every rank loads its own ``./ckpt``)
    it looks for rank 0's entry one position too far, where rank 0 has none. Rank 0's latest
    entry below shows that it passed the call by: rank 1 claims at once, not after
    ``PATCHLOAD_CLAIM_GRACE`` (CI: a follower waited the 120 s there)."""
    import dataclasses
    import time
    import uuid

    from patchload.coordination import rank0

    _, call_of = _two_rank_calls("passed", Config(claim_grace_s=20.0, progress_warning_s=None))
    namespace, zero, one = f"u{uuid.uuid4().hex[:8]}", call_of(0), call_of(1)

    def key(name: str) -> str:
        return f"{namespace}/{name}/"

    for position, name in ((1, "shared"), (2, "own-ckpt-0")):  # rank 0's entries (rank0._publish)
        zero.store.store.multi_set([f"seqkey/{key(name)}", f"seq/{namespace}/top/{position}"],
                                   [str(position), key(name)])
    zero.store.store.set(key("shared") + "leader", "rank 0")
    zero.store.store.set(key("led-by-rank-2") + "leader", "rank 2")
    for name, holder in (("shared", "rank 0"), ("led-by-rank-2", "rank 2")):
        placed = rank0.place(dataclasses.replace(one, key=key(name)), nested=False)
        # the claim is there at the first look: one request, and no attempt waited for
        assert rank0.await_rank0(placed) == (holder, False)
    mine = rank0.place(dataclasses.replace(one, key=key("own-ckpt-1")), nested=False)
    start = time.monotonic()
    assert rank0.await_rank0(mine) == (None, False)  # this rank claims
    assert time.monotonic() - start < 2.0


def test_a_rank_there_before_rank0s_claim_is_told_it_waited_for_that_attempt() -> None:
    """Rank 1 reaches a call rank 0 has published but not claimed yet: await_rank0 returns rank
    0's claim once it comes, saying that rank 1 was there before it (so rank 1 follows that
    attempt to its end, a failure included, whatever the timing: protocol._claim)."""
    import dataclasses
    import threading
    import uuid

    from patchload.coordination import rank0

    _, call_of = _two_rank_calls("waited", Config(claim_grace_s=20.0, progress_warning_s=None))
    namespace, zero, one = f"u{uuid.uuid4().hex[:8]}", call_of(0), call_of(1)
    key = f"{namespace}/late/"
    zero.store.store.multi_set([f"seqkey/{key}", f"seq/{namespace}/top/1"], ["1", key])
    placed = rank0.place(dataclasses.replace(one, key=key), nested=False)
    claim = threading.Timer(0.3, lambda: zero.store.store.set(key + "leader", "rank 0"))
    claim.start()
    try:
        assert rank0.await_rank0(placed) == ("rank 0", True)
    finally:
        claim.join()


@pytest.mark.timeout(60)
def test_a_rank_reads_rank0s_claim_soon_once_rank0_reached_the_call(monkeypatch) -> None:
    """Rank 1 waits for a late rank 0 to reach a call, reading less often as the wait grows;
    rank 0's claim follows its entry within a ms, so once the entry is there rank 1 reads the
    claim after the first interval again, not after the grown one (which made it start 30-60 ms
    after its leader). The entry and the claim are written from inside rank 1's reads: no
    timing decides what is seen."""
    import dataclasses
    import uuid

    from patchload.coordination import rank0

    _, call_of = _two_rank_calls("soon", Config(claim_grace_s=20.0, progress_warning_s=None))
    namespace, zero, one = f"u{uuid.uuid4().hex[:8]}", call_of(0), call_of(1)
    key = f"{namespace}/soon/"
    placed = rank0.place(dataclasses.replace(one, key=key), nested=False)
    real_poll, waits = rank0._poll, []

    def poll(store, waited_for, timeout_s, poll_s):
        waits.append((waited_for, poll_s))
        if waited_for == key + "leader":
            zero.store.store.set(key + "leader", "rank 0")
        elif len(waits) == 2:  # rank 1 has waited a whole slice for rank 0: it reaches the call
            zero.store.store.multi_set([f"seqkey/{key}", f"seq/{namespace}/top/1"], ["1", key])
        return real_poll(store, waited_for, timeout_s, poll_s)

    monkeypatch.setattr(rank0, "_poll", poll)
    assert rank0.await_rank0(placed) == ("rank 0", True)
    (entry_waits, claim_waits) = ([p for k, p in waits if k != key + "leader"],
                                  [p for k, p in waits if k == key + "leader"])
    assert entry_waits[-1] > 10 * rank0._FIRST_POLL_S, waits  # the interval had grown
    assert claim_waits == [rank0._FIRST_POLL_S], waits


def test_a_collective_of_the_default_group_is_counted_and_shown_with_its_position() -> None:
    """The user's blocking collectives of the default group (``group`` None or WORLD, given by
    position or by name) are counted; another group's and point-to-point ones are not. A
    collective blocked over 0.2 s is shown with its position (``seq``), which the job leader
    compares with its own count (``job_collective._await_arrivals``)."""
    import time

    import torch.distributed as dist

    from patchload.coordination import rank0

    world = rank0._on_world_group
    assert world("barrier", dist.barrier, (), {})
    assert world("barrier", dist.barrier, (), {"group": dist.GroupMember.WORLD})
    assert world("broadcast_object_list", dist.broadcast_object_list, ([1], 0, None), {})
    assert not world("barrier", dist.barrier, (), {"group": object()})
    assert not world("broadcast", dist.broadcast, (None, 0, object()), {})
    assert not world("send", dist.send, (None, 1), {})
    assert not world("barrier", dist.barrier, (), {"no_such_argument": 1})

    state = rank0._State()
    state.leave(state.enter("barrier", world=True))
    token = state.enter("barrier", world=True)
    other = state.enter("broadcast", world=False)
    assert state.world_collectives() == 2
    now = time.monotonic()
    assert state._compose(now)["blocked"] is None  # not shown before 0.2 s
    shown = state._compose(now + 0.25)
    assert (shown["blocked"], shown["seq"]) == ("barrier", 2), shown
    state.leave(token)
    shown = state._compose(now + 0.25)
    assert (shown["blocked"], shown["seq"]) == ("broadcast", None), shown
    state.leave(other)


def test_a_pin_names_the_file_its_path_resolves_to(tmp_path) -> None:
    """A hub file's pin (``[commit, blob, size]``) names the file its path resolves to, as
    ``os.path.realpath`` does, for every layout a cache may have: a snapshot link to its blob, a
    chain of links, a copied file, a file under a linked folder; a snapshot folder pins its
    commit; a missing file pins None. (The pin reads the last link only.)"""
    import os

    from patchload.coordination.call import _pin_of

    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    (blobs / "b1").write_text("weights")
    (snapshot / "link").symlink_to("../../blobs/b1")
    (snapshot / "chain").symlink_to("link")
    (snapshot / "copy.json").write_text("{}")
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "z.json").write_text("[]")
    (snapshot / "folder").symlink_to(tmp_path / "real")
    for name, size in (("link", 7), ("chain", 7), ("copy.json", 2), ("folder/z.json", 2)):
        path = str(snapshot / name)
        assert _pin_of(path) == ["abc123", os.path.basename(os.path.realpath(path)), size]
    assert _pin_of(str(snapshot / "chain"))[1] == "b1"
    assert _pin_of(str(snapshot)) == ["abc123", "snapshot"]
    assert _pin_of(str(snapshot / "missing")) is None


def test_a_leaders_transport_error_is_rebuilt_of_its_class_or_not_at_all() -> None:
    """A follower replaying the leader's HTTP record raises the leader's transport error of its
    own class (httpx's with the follower's request; evaluate's requests errors from the message
    alone), and a class from another package, or one not built from a message, is a replay miss
    (the follower then makes the plain call), never an error of another class."""
    import requests

    from patchload.coordination.replay import ReplayMiss, rebuilt_error

    try:  # huggingface_hub 2's client; 1.x's is httpx
        import httpx2 as httpx
    except ImportError:
        import httpx

    def recorded(err: BaseException) -> dict[str, str]:
        return {"module": type(err).__module__, "qualname": type(err).__qualname__,
                "message": str(err)}

    request = httpx.Request("GET", "http://127.0.0.1:1/api/models/x")
    err = rebuilt_error(recorded(httpx.ConnectError("refused")), "GET x", ("httpx", "httpx2"),
                        request=request)
    assert type(err) is httpx.ConnectError and str(err) == "refused" and err.request is request
    err = rebuilt_error(recorded(requests.ConnectionError("refused")), "HEAD x", ("requests",))
    assert type(err) is requests.ConnectionError and str(err) == "refused"
    assert isinstance(rebuilt_error(recorded(KeyError("k")), "GET x", ("httpx",)), ReplayMiss)
    unbuildable = {"module": "json", "qualname": "JSONDecodeError", "message": "m"}
    assert isinstance(rebuilt_error(unbuildable, "GET x", ("json",)), ReplayMiss)


def test_a_streamed_body_is_recorded_whole_within_its_bound_or_not_at_all() -> None:
    """Inside ``recording_bodies`` a leader records a streamed body (an ``HfFileSystem`` read)
    once read to its end and at most the bound, as the reader got it; a body over the bound, one
    read in part, or any stream outside that block is not recorded (a follower's same request
    then goes to the hub, as plain). A ``Range`` header is part of the request's key."""
    from patchload.coordination import replay

    try:  # huggingface_hub 2's client; 1.x's is httpx
        import httpx2 as httpx
    except ImportError:
        import httpx

    send = getattr(httpx.Client.send, "__wrapped__", httpx.Client.send)  # unpatched: _send alone
    chunks = [bytes(range(256)) * 4, b"tail" * 100]
    body = b"".join(chunks)
    client = httpx.Client(transport=httpx.MockTransport(
        lambda request: httpx.Response(200, content=iter(chunks))))

    def streamed(max_bytes: int | None, whole: bool = True,
                 headers: dict[str, str] | None = None) -> tuple[bytes, list[dict[str, Any]]]:
        record: list[dict[str, Any]] = []
        request = client.build_request("GET", "http://hub.test/r/resolve/main/f",
                                       headers=headers or {})
        bodies = replay.recording_bodies(max_bytes) if max_bytes is not None \
            else contextlib.nullcontext()
        with replay.recording(record), bodies:
            response = replay._send(lambda *a, **k: send(client, *a, **k), client, (request,),
                                    {"stream": True})
        got = b"".join(response.iter_bytes()) if whole else next(response.iter_bytes())
        response.close()
        return got, record

    got, record = streamed(len(body))
    assert got == body and len(record) == 1 and record[0]["body"] is True
    assert base64.b64decode(record[0]["content"]) == body and record[0]["status"] == 200
    assert record[0]["key"].startswith("GET http://hub.test/r/resolve/main/f ")
    assert streamed(len(body) - 1) == (body, [])  # over the bound
    assert streamed(None) == (body, [])  # outside recording_bodies: a download's stream
    assert streamed(len(body), whole=False)[1] == []  # read in part
    _, ranged = streamed(len(body), headers={"Range": "bytes=10-"})
    assert ranged[0]["key"].endswith(" range=bytes=10-")
    assert " range=" not in record[0]["key"]
    # A node leader following the job's leader: the answer replayed to it, recorded as given.
    replayed = httpx.Response(200, content=body, request=client.build_request("GET", "http://x"))
    again: list[dict[str, Any]] = []
    replay._record_body(replayed, "GET http://x -", again, len(body))
    assert base64.b64decode(again[0]["content"]) == body


@pytest.mark.tf4
def test_a_replayed_answer_has_the_headers_and_body_a_plain_answer_has() -> None:
    """A follower's replayed response: a ``HEAD`` answer keeps its Content-Length (no body;
    huggingface_hub reads a file's size from it) in both clients; an ``httpx`` GET answer's
    recorded (decoded) body gets its own length and no Content-Encoding; a ``requests`` answer
    keeps every header, as a plain one does, and works as one (``raise_for_status``, ``json``).
    A transport error the follower cannot rebuild is sent to the hub, as plain, and counted."""
    import requests

    from patchload.coordination import replay

    def entry(status: int, headers: list[list[str]], content: bytes) -> dict[str, Any]:
        return {"status": status, "headers": headers,
                "content": base64.b64encode(content).decode("ascii")}

    head = entry(200, [["Content-Length", "1234"], ["ETag", '"e"']], b"")
    get = entry(200, [["Content-Length", "10"], ["Content-Encoding", "gzip"]], b'{"a": 1}')
    missing = entry(404, [["Content-Length", "2"], ["X-Error-Code", "EntryNotFound"]], b"{}")

    prepared = requests.Request("HEAD", "http://hub.test/r/resolve/main/config.json").prepare()
    response = replay._response(head, prepared, "HEAD x")
    assert isinstance(response, requests.Response) and response.content == b""
    assert response.headers["content-length"] == "1234" and response.url == prepared.url
    got = replay._response(get, requests.Request("GET", "http://hub.test/api").prepare(), "GET x")
    assert got.json() == {"a": 1} and got.headers["Content-Encoding"] == "gzip"
    not_found = replay._response(missing, requests.Request("GET", "http://hub.test/x").prepare(),
                                 "GET x")
    with pytest.raises(requests.HTTPError, match="404 Client Error: Not Found"):
        not_found.raise_for_status()
    assert replay.request_key(requests.Request("POST", "http://h/x", data="a=1").prepare()) == \
        replay.request_key(requests.Request("POST", "http://h/x", data=b"a=1").prepare())

    for name in ("httpx2", "httpx"):
        try:
            httpx = __import__(name)
        except ImportError:
            continue
        response = replay._response(head, httpx.Request("HEAD", "http://hub.test/f"), "HEAD x")
        assert response.headers["content-length"] == "1234" and response.content == b""
        response = replay._response(get, httpx.Request("GET", "http://hub.test/api"), "GET x")
        assert response.json() == {"a": 1} and response.headers["content-length"] == "8"
        assert "content-encoding" not in response.headers

    unbuildable = {"key": "k", "error": {"module": "json", "qualname": "JSONDecodeError",
                                         "message": "m"}}
    answers = replay.LeaderAnswers(lambda name: unbuildable, lambda name: None, "test")
    assert answers.answer(prepared, lambda: "sent") == "sent"
    assert (answers.unrecorded, answers.answered) == (1, 0)


def test_the_probes_fingerprint_is_handed_on_only_where_map_computes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """datasets >= 2.x fingerprints a map in ``Dataset.map`` itself (the probe's fingerprint is
    the map's); where ``_map_single`` is a ``fingerprint_transform`` (older releases), each
    ``num_proc`` shard hashed its own, and the call is left to do so."""
    datasets = pytest.importorskip("datasets", reason="datasets is not installed")
    from datasets.fingerprint import fingerprint_transform

    from patchload.patches import datasets_map

    assert not datasets_map._shards_fingerprint_themselves()

    @fingerprint_transform(inplace=False)
    def _map_single(self: Any, new_fingerprint: str | None = None) -> None:
        del self, new_fingerprint

    monkeypatch.setattr(datasets.Dataset, "_map_single", _map_single)
    assert datasets_map._shards_fingerprint_themselves()


def test_the_sampler_shows_the_main_thread_while_it_is_in_a_torch_distributed_function() -> None:
    """A collective patchload does not wrap (here a function of torch.distributed's collectives
    module that sleeps, as all_reduce waits for the other ranks) shows as one entry while the
    main thread is in it, and none once it returned; other code never shows."""
    from patchload.coordination import sampler

    events: list[tuple[str, Any]] = []

    def enter(name: str) -> int:
        events.append(("enter", name))
        return len(events)

    namespace: dict[str, Any] = {"__name__": "torch.distributed.distributed_c10d", "time": time}
    exec("def all_reduce(seconds):\n    time.sleep(seconds)\n", namespace)  # noqa: S102
    watch = sampler.CollectiveSampler(enter, lambda token: events.append(("leave", token)))
    watch.start()
    try:
        time.sleep(0.3)  # the test's own code: nothing shows
        assert events == []
        namespace["all_reduce"](0.3)
        time.sleep(0.3)
    finally:
        watch.stop()
    assert events == [("enter", "all_reduce"), ("leave", 1)]


def test_the_sampler_leaves_wrapped_collectives_to_their_wrappers() -> None:
    """rank 0's sampler is built with the names patchload wraps: a barrier shows through its
    wrapper only, counted among the default group's collectives. A sampled, uncounted entry
    outlived the wrapper's by a sample, and ranks that had left the barrier took rank 0 for
    blocked in it and led the next call (found by a break test with busy cores)."""
    from patchload.coordination import rank0 as _rank0

    assert "barrier" in _rank0._rank0().sampler._wrapped
    events: list[str] = []
    namespace: dict[str, Any] = {"__name__": "torch.distributed.distributed_c10d", "time": time}
    exec("def barrier(seconds):\n    time.sleep(seconds)\n", namespace)  # noqa: S102
    watch = type(_rank0._rank0().sampler)(lambda name: events.append(name) or 1,
                                          lambda token: None, frozenset({"barrier"}))
    watch.start()
    try:
        namespace["barrier"](0.3)
    finally:
        watch.stop()
    assert events == []


def test_a_followers_hub_error_has_the_response_and_attributes_of_the_plain_one() -> None:
    """huggingface_hub's error for a missing repo, as ``hf_raise_for_status`` raises it on the
    leader: a follower's rebuilt one has the same ``repo_id`` / ``repo_type``, and a response of
    the same client library with the same status, headers (case-insensitive), body, reason and
    request (``e.response.request.url``, ``e.response.json()``)."""
    from huggingface_hub.errors import RepositoryNotFoundError
    from huggingface_hub.utils import hf_raise_for_status

    url = "http://127.0.0.1:9/api/models/org/nosuch/revision/main"
    for name in ("httpx2", "httpx"):
        try:
            httpx = __import__(name)
        except ImportError:
            continue
        sent = httpx.Response(404, headers={"X-Error-Code": "RepoNotFound", "x-request-id": "r1",
                                            "Content-Type": "application/json"},
                              content=b'{"error":"Repository not found"}',
                              request=httpx.Request("GET", url))
        with pytest.raises(RepositoryNotFoundError) as raised:
            hf_raise_for_status(sent)
        leader = raised.value
        exc = follower_exception(json.loads(json.dumps(describe_exception(leader))), rank=1,
                                 leader_rank=0, note="")
        assert isinstance(exc, RepositoryNotFoundError) and str(exc) == str(leader)
        for attribute in ("repo_id", "repo_type", "request_id", "server_message"):
            assert getattr(exc, attribute) == getattr(leader, attribute), attribute
        got, plain = exc.response, leader.response
        assert type(got) is type(plain)
        assert (got.status_code, got.reason_phrase, got.headers["x-error-code"], got.json(),
                str(got.request.url), got.request.method) == (
            plain.status_code, plain.reason_phrase, plain.headers["X-Error-Code"], plain.json(),
            url, "GET")
        assert exc.request is got.request


def test_a_scope_marker_leaves_the_cache_listing_as_plain(hub, tmp_path, monkeypatch):
    """A node's scope marker (several nodes, ``PATCHLOAD_DOWNLOAD_SCOPE=auto``) lies in the hub
    cache while the job runs. Beside the repo folders, ``scan_cache_dir`` reported it as a
    corrupted repo ("Repo path is not a directory"), a warning a plain rank's scan does not
    show (found by a break test); in the cache's ``.locks`` folder it is skipped."""
    from huggingface_hub import hf_hub_download, scan_cache_dir

    from patchload.coordination import scope as _scope

    cache = tmp_path / "hub"
    hf_hub_download("org/gpt2", "config.json", cache_dir=cache, endpoint=hub.endpoint)
    plain, listed = scan_cache_dir(cache), sorted(os.listdir(cache))
    monkeypatch.setattr(_scope.atexit, "register", lambda *a, **k: None)
    marker = _scope._write_marker(cache, "0123456789abcdef")
    try:
        scanned = scan_cache_dir(cache)
        assert marker.exists()
        assert [str(w) for w in scanned.warnings] == [str(w) for w in plain.warnings] == []
        assert [r.repo_id for r in scanned.repos] == [r.repo_id for r in plain.repos] == [
            "org/gpt2"]
        assert sorted(os.listdir(cache)) == listed
    finally:
        marker.unlink()


def test_a_rank_that_left_rank0s_collective_does_not_take_rank0_for_blocked_in_it():
    """Rank 0's state shows it blocked in a collective of the default group until its watcher
    thread writes the change, a little after the collective returned. A rank that has returned
    from that collective too (its own count of them reached rank 0's ``seq``) read it as
    blocked, stopped waiting for rank 0 and led the next call itself, making its hub requests
    (found by a break test, after a barrier one rank came late to)."""
    from patchload.coordination import rank0 as _rank0
    from patchload.coordination.identity import node_id

    state = {"pid": os.getpid(), "node": node_id(), "facts": None, "blocked": "barrier",
             "following": False, "exited": False}
    left = _rank0._rank0().state.left_world()
    assert _rank0._stop({**state, "seq": left + 1}, None, 0) == \
        "rank 0 is blocked in torch.distributed.barrier"
    assert _rank0._stop({**state, "seq": None}, None, 0) is not None  # another group's: no count
    _rank0._rank0().state.left_world(1)  # this rank returned from that barrier too
    assert _rank0._stop({**state, "seq": left + 1}, None, 0) is None
    assert _rank0._stop({**state, "seq": left + 2}, None, 0) is not None  # rank 0's next one
