"""Guard for the refactor (REDESIGN.md §3.4 step 0b): what goes over the wire for a model load.

A real 2-rank torchrun job (``tests/workers/wire.py``) loads the tiny llama with
``AutoModelForCausalLM.from_pretrained`` from the loopback hub; each rank records every write
patchload makes to its job store. The test reduces the records of both ranks to the wire's
schema and compares it with a golden file byte for byte:

- for each load, the call's store keys (normalised: the node id and the call digests are
  placeholders, ``beat/<n>`` stands for every beat) with the operations that wrote them;
- the shape of every JSON value written: the published outcome (the shm descriptor, the
  collective payload, ``entries``), the files announcement, the pins (with the leader's
  recorded HTTP answers, named without the hub's port or hashes), the leader's claim, the
  arrivals: every key path with its value's type (lists as their length and element shape),
  values kept only for a few keys that name a choice (``LITERAL_KEYS``), never pids, fds,
  paths, timestamps or hashes.

Two jobs: the default transport (``auto``, which is shm inside one node) with a float32 load
(on transformers 5.x the followers map the checkpoint files) and a bfloat16 load (converted on
the leader, shared through a blob), and ``PATCHLOAD_TRANSPORT=collective`` with the float32
load (a broadcast). The payloads differ between transformers lines (headers, loading info,
marks, pins), so transformers 4.x has golden files of its own (``wire-*-tf4.json``). Steps 3-5
of the refactor (the key schema, the typed payload, ``LoadState``) must leave every golden file
as it is.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Final

import pytest

from _golden import check_golden
from _launch import TRANSFORMERS_4, Job, job_env, run_torchrun

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="torchrun jobs with /proc and memfd: Linux only"),
    pytest.mark.tf4,
]

JOB_TIMEOUT_S: Final = 150
NPROC: Final = 2

# What each job loads and how its followers must have got the weights (their INFO line). On
# transformers 4.x the float32 load has no zero-copy path: the leader shares a blob for it too.
JOBS: Final = {
    "shm": ({}, {"f32": "weights mapped" if TRANSFORMERS_4 else
                 "weights mapped from the checkpoint files", "bf16": "weights mapped"}),
    "collective": ({"PATCHLOAD_TRANSPORT": "collective"}, {"f32": "weights received"}),
}

# JSON keys whose values are kept in the golden file (they name a choice, identical from run to
# run); every other value is reduced to its type.
LITERAL_KEYS: Final = frozenset({"ok", "transport", "reason", "class", "dtype", "kind"})

# A store key below the job's namespace: <where>/<function>/<digest>/<occurrence>/<rest>.
_CALL_KEY: Final = re.compile(r"^(job|node-[0-9a-f]+)/([^/]+)/([0-9a-f]{20})/(\d+)/(.*)$")
_BEAT: Final = re.compile(r"^(a\d+/beat)/\d+$")
_NODE: Final = re.compile(r"node-[0-9a-f]{20}")
_DIGEST: Final = re.compile(r"/([0-9a-f]{20})/")
_HUB_URL: Final = re.compile(r"https?://127\.0\.0\.1:\d+")
_HASH: Final = re.compile(r"\b[0-9a-f]{40}\b")


def _shape(value: Any, key: str | None = None) -> Any:
    """The schema of a JSON value: dicts keep their keys; a list is ``{"list": len, "of":
    shape}`` when its elements share one shape, positional when short, else its length and
    the distinct shapes; a scalar is its type name (its value, under ``LITERAL_KEYS``)."""
    if isinstance(value, dict):
        return {_key_name(k): _shape(v, k) for k, v in sorted(value.items())}
    if isinstance(value, list):
        shapes = [_shape(v) for v in value]
        distinct = sorted({json.dumps(s, sort_keys=True) for s in shapes})
        if not shapes:
            return []
        if len(distinct) == 1:
            return {"list": len(shapes), "of": shapes[0]}
        if len(shapes) <= 8:
            return shapes
        return {"list": len(shapes), "of-any": [json.loads(s) for s in distinct]}
    if key in LITERAL_KEYS and not isinstance(value, (dict, list)):
        return value
    return {bool: "bool", int: "int", float: "float", str: "str", type(None): "null"}[type(value)]


def _key_name(key: str) -> str:
    """A JSON key as the golden file names it: a recorded HTTP answer's pin
    (``http:<METHOD> <url> <body sha1>#<n>``) without the hub's port or any hash."""
    if not key.startswith("http:"):
        return key
    return _HASH.sub("<sha>", _HUB_URL.sub("<hub>", key))


def _value_shape(text: str) -> Any:
    if text == "":
        return "empty"
    try:
        return _shape(json.loads(text))
    except json.JSONDecodeError:
        return "text"


def _is_write(record: dict[str, Any]) -> bool:
    """Reads that go through a write method are left out: ``add(key, 0)`` reads a counter, and
    ``compare_set`` with an expected value no key holds (it starts with NUL) reads a value."""
    if record["op"] == "add":
        return record["amount"] != 0
    if record["op"] == "compare_set":
        return not record["expected"].startswith("\x00")
    return True


def wire_schema(job: Job) -> dict[str, Any]:
    """Both ranks' store writes, by load and call: the keys with the operations that wrote
    them, and the shape of each value (the lowest rank's last write of that key)."""
    digests: dict[str, str] = {}
    loads: dict[str, dict[str, Any]] = {}
    for rank, report in sorted(job.ranks.items()):
        for record in report["store_writes"]:
            if not _is_write(record):
                continue
            keys = record.get("keys") or [record["key"]]
            values = record.get("values") or [record.get("value")] * len(keys)  # multi_set: each
            for key, value in zip(keys, values):
                found = _CALL_KEY.match(key)
                if found is None:  # rank 0's sequence keys name a node and a call's digest
                    call = "other"
                    rest = _NODE.sub("node-<id>", key)
                    for digest in _DIGEST.findall(rest):
                        digests.setdefault(digest, f"<digest {len(digests) + 1}>")
                        rest = rest.replace(f"/{digest}/", f"/{digests[digest]}/")
                else:
                    where, function, digest, count, rest = found.groups()
                    digests.setdefault(digest, f"<digest {len(digests) + 1}>")
                    where = "job" if where == "job" else "node-<id>"
                    call = f"{where}/{function}/{digests[digest]}/{count}"
                    rest = _BEAT.sub(r"\1/<n>", rest)
                entry = loads.setdefault(str(record["step"]), {}).setdefault(
                    call, {"keys": {}, "values": {}})
                ops = entry["keys"].setdefault(rest, [])
                if record["op"] not in ops:
                    ops.append(record["op"])
                    ops.sort()
                if value is not None and (rest not in entry["values"]
                                          or entry["values"][rest][0] == rank):
                    entry["values"][rest] = (rank, _value_shape(value))
    for calls in loads.values():
        for entry in calls.values():
            entry["keys"] = dict(sorted(entry["keys"].items()))
            entry["values"] = {k: v for k, (_, v) in sorted(entry["values"].items())}
    return loads


def _run(hub: Any, tmp_path: Path, transport: str) -> Job:
    extra, received = JOBS[transport]
    env = job_env(hub.endpoint, tmp_path / "hf", tmp_path / "out", **extra)
    job = run_torchrun(hub, "wire", ["--loads", ",".join(received)], nproc=NPROC, env=env,
                       timeout_s=JOB_TIMEOUT_S).check_ok()
    # The loads took the path under test (a rank that loaded plainly would change the schema
    # for a reason of its own): the leader led each, each follower got the weights from it.
    for rank, report in sorted(job.ranks.items()):
        assert report["installed"], rank
        for load, how in received.items():
            record = report["steps"][load]
            assert record["error"] is None, f"rank {rank} {load}: {record['error']}"
            line = " ".join(record["patchload"])
            expected = "led it" if rank == 0 else "followed rank 0: no request, "
            assert expected in line and (rank == 0 or how in line), (rank, load, line)
    return job


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("transport", sorted(JOBS))
def test_wire_matches_golden(transport: str, hub: Any, tmp_path: Path) -> None:
    """The store keys and the shapes of the values a model load writes, for each transport,
    are those of the golden file."""
    job = _run(hub, tmp_path, transport)
    schema = wire_schema(job)
    assert set(schema) == set(JOBS[transport][1]), f"writes outside the loads: {sorted(schema)}"
    text = json.dumps(schema, indent=1, sort_keys=True) + "\n"
    name = f"wire-{transport}{'-tf4' if TRANSFORMERS_4 else ''}.json"
    check_golden(name, text, how=f"pytest tests/test_wire.py -k {transport}")
