"""Store benchmark: what waiting followers cost the job's store, and what 1,000 calls leave in it.

    .venv/bin/python benchmarks/bench_store.py                      # N = 64, 256, 1024
    .venv/bin/python benchmarks/bench_store.py --followers 64 --wait-s 6

One ``TCPStore`` server in a process of its own stands in for torchrun's agent store. For each N in
``--followers``, N simulated followers (threads, each with its own store client, as N processes
would have) claim one call that a leader (this process's main thread) already leads, and wait
for its outcome through patchload's own code (``claim``, ``wait_outcome``) while the leader
"loads" for ``--wait-s`` seconds with its heartbeat running (``PATCHLOAD_HEARTBEAT`` 5 s); then
it publishes. The followers' leader counts as on another node (most of a 1,024-rank job's are),
so only its beats speak for it.

Columns:

* req/s per follower: every store request the followers sent between the moment all of them
  were waiting and the publication (counted at each follower's client, the blocking ``wait``
  included), divided by N and by that window's seconds.
* release p50 / max: from the leader's publication to each follower's ``wait_outcome`` returning.
* unrelated p50 / max: latency of a ``set`` on an unrelated key, made every 50 ms by another
  client during the wait (what torchrun's own keep-alives see).

Then ``--calls`` coordinated calls in a row (``leader_first``) among ``--ranks`` simulated ranks
(threads, own clients): the store's key count, this process's open fds, threads and RSS before
and after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import psutil
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from patchload._config import Config  # noqa: E402
from patchload._topology import Topology  # noqa: E402
from patchload.coordination import protocol  # noqa: E402
from patchload.coordination.store import JobStore  # noqa: E402

PREFIX = "patchload/bench/"


class CountingStore:
    """A store client that counts every request made through it (clones share the count)."""

    _METHODS = ("set", "get", "add", "check", "wait", "compare_set", "delete_key")

    def __init__(self, inner: Any, counter: list[int], lock: threading.Lock) -> None:
        self._inner, self._counter, self._count_lock = inner, counter, lock

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._inner, name)
        if name not in self._METHODS:
            return method

        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._count_lock:
                self._counter[0] += 1
            return method(*args, **kwargs)
        return counted

    def clone(self) -> CountingStore:
        return CountingStore(self._inner.clone(), self._counter, self._count_lock)


def client(port: int, counter: list[int], lock: threading.Lock) -> JobStore:
    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    return JobStore(CountingStore(dist.PrefixStore(PREFIX, base), counter, lock), "agent",
                    threading.RLock())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def followers_process(port: int, key: str, ranks: list[int], world: int,
                      leader_pid: int) -> None:
    """A child process of :func:`waiting`: one thread per rank in ``ranks`` claims the call and
    waits for its outcome. Protocol on stdin/stdout: prints ``ready`` once every thread waits;
    each ``mark`` line read is answered with the request count so far; at the end prints the
    wall-clock time (``time.time()``) at which each thread's wait returned, as JSON."""
    counter, lock = [0], threading.Lock()
    config = Config(progress_warning_s=None)  # connecting 1,024 clients takes a minute
    remote = protocol.Role(False, 0, leader_pid, "another-node")
    waiting_now = threading.Semaphore(0)
    returned: list[float] = []

    def follower(rank: int) -> None:
        call = protocol.Call(key, "bench wait", "job",
                             Topology(rank, world, rank % 8, 8, rank // 8, "torchrun"), config,
                             client(port, counter, lock))
        call, _ = protocol.claim(call)
        waiting_now.release()
        protocol.wait_outcome(call, remote)
        returned.append(time.time())

    threads = [threading.Thread(target=follower, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for _ in threads:
        waiting_now.acquire()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "mark":
            print(counter[0], flush=True)
        else:
            break
    for t in threads:
        t.join(60)
    print(json.dumps(returned), flush=True)


def waiting(port: int, n: int, wait_s: float, processes: int,
            config: Config) -> dict[str, Any]:
    """N followers, spread over ``processes`` processes, wait on one call for ``wait_s``
    seconds; see the module docstring."""
    world = n + 1
    key = f"job/wait/{n}/"
    leader_call = protocol.Call(key, f"bench wait N={n}", "job",
                                Topology(0, world, 0, 8, 0, "torchrun"), config,
                                client(port, [0], threading.Lock()))
    leader_call, role = protocol.claim(leader_call)
    assert role.lead
    unrelated: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        other = dist.TCPStore("127.0.0.1", port, is_master=False)
        i = 0
        while not stop.wait(0.05):
            start = time.monotonic()
            other.set("unrelated", str(i))
            unrelated.append(time.monotonic() - start)
            i += 1

    def ask(line: str) -> list[str]:
        for child in children:
            child.stdin.write(line + "\n")  # type: ignore[union-attr]
            child.stdin.flush()  # type: ignore[union-attr]
        return [child.stdout.readline().strip() for child in children]  # type: ignore

    followers = list(range(1, world))
    with protocol.leading(leader_call) as done:
        children = [subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps(
                [port, key, followers[i::processes], world, role.leader_pid])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for i in range(processes)]
        assert [c.stdout.readline().strip() for c in children] == ["ready"] * processes  # type: ignore
        time.sleep(0.5)  # every follower is blocked in its wait by now
        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        start, before = time.monotonic(), sum(int(x) for x in ask("mark"))
        time.sleep(wait_s)
        requests = sum(int(x) for x in ask("mark")) - before
        window = time.monotonic() - start
        stop.set()
        prober.join()
        published = time.time()
        done({})
    returned = [t for line in ask("end") for t in json.loads(line)]
    for child in children:
        child.wait(60)
    release = [t - published for t in returned]
    return {"followers": n, "processes": processes, "window_s": round(window, 2),
            "requests": requests, "req_per_s_per_follower": requests / n / window,
            "release_p50_ms": 1e3 * statistics.median(release),
            "release_max_ms": 1e3 * max(release), "returned": len(returned),
            "unrelated_p50_ms": 1e3 * statistics.median(unrelated),
            "unrelated_max_ms": 1e3 * max(unrelated)}


def calls_in_a_row(port: int, calls: int, ranks: int, config: Config) -> dict[str, Any]:
    """``calls`` coordinated calls among ``ranks`` simulated ranks; the store's keys, this
    process's fds, threads and RSS before and after."""
    counter, lock = [0], threading.Lock()
    stores = [client(port, counter, lock) for _ in range(ranks)]
    observer = dist.TCPStore("127.0.0.1", port, is_master=False)
    process = psutil.Process()

    def facts() -> dict[str, int]:
        return {"keys": observer.num_keys(), "fds": process.num_fds(),
                "threads": threading.active_count(), "rss_mib": process.memory_info().rss >> 20}

    def run(rank: int, i: int) -> None:
        call = protocol.Call(f"job/row/{i}/", f"call {i}", "job",
                             Topology(rank, ranks, rank, ranks, 0, "torchrun"), config,
                             stores[rank])
        protocol.leader_first(call, lambda c: (i, {"i": i}, None),
                              lambda c, role, leader: leader.payload()["i"])

    def one_round(i: int) -> None:
        threads = [threading.Thread(target=run, args=(r, i)) for r in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)

    one_round(-1)  # the clients' wait connections and the heartbeat thread exist from here on
    time.sleep(0.3)
    before = facts()
    start = time.monotonic()
    for i in range(calls):
        one_round(i)
    elapsed = time.monotonic() - start
    time.sleep(0.3)  # the heartbeat thread ends once it leads nothing
    return {"calls": calls, "ranks": ranks, "before": before, "after": facts(),
            "ms_per_call": 1e3 * elapsed / calls}


def run(args: argparse.Namespace, port: int, config: Config) -> None:
    results: dict[str, Any] = {"waiting": [], "row": None}
    print("| followers | req/s per follower | release p50 | release max | unrelated p50 "
          "| unrelated max |\n|---|---|---|---|---|---|")
    for n in args.followers:
        r = waiting(port, n, args.wait_s, args.processes, config)
        results["waiting"].append(r)
        print(f"| {n} | {r['req_per_s_per_follower']:.2f} | {r['release_p50_ms']:.0f} ms "
              f"| {r['release_max_ms']:.0f} ms | {r['unrelated_p50_ms']:.1f} ms "
              f"| {r['unrelated_max_ms']:.1f} ms |", flush=True)
    row = calls_in_a_row(port, args.calls, args.ranks, config)
    results["row"] = row
    print(f"\n{row['calls']} calls among {row['ranks']} ranks ({row['ms_per_call']:.1f} ms "
          "each):\n\n| | store keys | fds | threads | RSS MiB |\n|---|---|---|---|---|")
    for when in ("before", "after"):
        f = row[when]
        print(f"| {when} | {f['keys']} | {f['fds']} | {f['threads']} | {f['rss_mib']} |")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--followers", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--wait-s", type=float, default=12.0)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--processes", type=int, default=8,
                        help="processes the followers are spread over (threads in each)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.child is not None:
        followers_process(*json.loads(args.child))
        return
    config = Config()
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, "
         "is_master=True, wait_for_workers=False); print(s.port, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        run(args, port, config)
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
