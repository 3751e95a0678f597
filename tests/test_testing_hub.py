"""Single-process tests of :mod:`patchload.testing` (the loopback hub and the tiny model repos).

The real ``huggingface_hub`` client freezes ``HF_ENDPOINT``/``HF_HOME``/``HF_HUB_DISABLE_XET`` at
import, so every client runs in a subprocess with its environment set (as the multi-rank tests
do); the hub runs in the pytest process and its request log says what the client did.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from patchload.testing import Fault, LoopbackHub, models, read_request_log

REPO_ROOT = Path(__file__).resolve().parents[1]
LLAMA = "org/tiny-llama"
LLAMA_SHARDED = "org/tiny-llama-sharded"

_CLIENT_PRELUDE = textwrap.dedent("""
    import json, sys

    def _finish(main):
        try:
            value = main()
        except BaseException as err:
            out = {"ok": False, "type": type(err).__name__,
                   "mro": [c.__name__ for c in type(err).__mro__], "message": str(err)[-3000:],
                   "cause": type(err.__cause__).__name__ if err.__cause__ else None}
        else:
            out = {"ok": True, "value": value}
        print("RESULT:" + json.dumps(out, default=str), flush=True)
""")


# --------------------------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny repo folders, written once for the module."""
    root = tmp_path_factory.mktemp("repos")
    return {
        LLAMA: models.tiny_llama(root / "llama"),
        LLAMA_SHARDED: models.tiny_llama(root / "llama-sharded", max_shard_size="20KB"),
        "org/tiny-custom": models.tiny_custom(root / "custom"),
    }


@pytest.fixture
def hub(tmp_path: Path, folders: dict[str, Path]) -> Any:
    """A running hub serving the tiny repos, logging to ``tmp_path/requests.jsonl``."""
    with LoopbackHub(log_path=tmp_path / "requests.jsonl") as running:
        for repo_id, folder in folders.items():
            running.add_repo(repo_id, folder)
        yield running


def _client(hub: LoopbackHub, home: Path, code: str, *, rank: int | None = None,
            extra_env: dict[str, str] | None = None, timeout_s: float = 90) -> dict[str, Any]:
    """Runs ``code`` (which defines ``main()``) in a fresh interpreter pointed at ``hub``.

    Returns:
        ``{"ok": True, "value": main()}`` or ``{"ok": False, "type", "mro", "message", "cause"}``.
    """
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "SENTENCE_TRANSFORMERS_"))}
    env.update({
        "HF_ENDPOINT": hub.endpoint,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "PATCHLOAD": "0",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p),
    })
    if rank is not None:
        env["HF_HUB_USER_AGENT_ORIGIN"] = "rank-%d" % rank
    env.update(extra_env or {})
    script = _CLIENT_PRELUDE + textwrap.dedent(code) + "\n_finish(main)\n"
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=timeout_s, cwd=str(home.parent))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT:")]
    assert lines, "client produced no result (rc=%s)\nstdout:\n%s\nstderr:\n%s" % (
        proc.returncode, proc.stdout[-3000:], proc.stderr[-5000:])
    return json.loads(lines[-1][len("RESULT:"):])


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _http(hub: LoopbackHub, method: str, path: str,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request with the stdlib client; returns (status, headers, body)."""
    host, port = hub.endpoint.rsplit("//", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


# --------------------------------------------------------------------------------------------
# Hub protocol, in process (no huggingface_hub)
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_resolve_headers_range_and_errors(hub: LoopbackHub, folders: dict[str, Path]) -> None:
    commit = hub.commit_of(LLAMA)
    assert len(commit) == 40 and int(commit, 16) >= 0

    status, headers, body = _http(hub, "HEAD", "/%s/resolve/main/config.json" % LLAMA)
    config = (folders[LLAMA] / "config.json").read_bytes()
    git_sha1 = hashlib.sha1(b"blob %d\0" % len(config) + config).hexdigest()
    assert (status, body) == (200, b"")
    assert headers["X-Repo-Commit"] == commit
    assert headers["ETag"] == '"%s"' % git_sha1
    assert headers["Content-Length"] == str(len(config))
    assert "X-Linked-Etag" not in headers

    weights = folders[LLAMA] / "model.safetensors"
    status, headers, _ = _http(hub, "HEAD", "/%s/resolve/%s/model.safetensors" % (LLAMA, commit))
    assert status == 200
    assert headers["X-Linked-Etag"] == '"%s"' % _sha256(weights)
    assert headers["X-Linked-Size"] == str(weights.stat().st_size)

    status, headers, body = _http(hub, "GET", "/%s/resolve/main/model.safetensors" % LLAMA,
                                  {"Range": "bytes=10-19"})
    assert status == 206 and body == weights.read_bytes()[10:20]
    assert headers["Content-Range"] == "bytes 10-19/%d" % weights.stat().st_size

    for path, code in [("/org/nope/resolve/main/config.json", "RepoNotFound"),
                       ("/%s/resolve/main/nope.json" % LLAMA, "EntryNotFound"),
                       ("/%s/resolve/nope/config.json" % LLAMA, "RevisionNotFound")]:
        status, headers, _ = _http(hub, "GET", path)
        assert (status, headers["X-Error-Code"]) == (404, code), path

    status, _, body = _http(hub, "GET", "/api/some/unknown/thing")
    assert status == 404 and "unknown endpoint" in json.loads(body)["error"]

    in_memory = hub.requests()  # waits for in-flight requests to be recorded
    log = read_request_log(hub.log_path)
    assert [(r.method, r.status) for r in log] == [(r.method, r.status) for r in in_memory]
    assert len(hub.requests(method="HEAD")) == 2
    assert hub.requests(path_contains="nope.json")[0].filename == "nope.json"


@pytest.mark.timeout(60)
def test_responses_are_sent_without_nagle_delay(hub: LoopbackHub) -> None:
    """Headers and body of a response go out in two writes; with Nagle's algorithm the body of
    a small one waits for the client's delayed ACK (about 40 ms per request on Linux loopback,
    which no real hub adds). Every connection the hub serves has ``TCP_NODELAY`` set."""
    conn = http.client.HTTPConnection("127.0.0.1", int(hub.endpoint.rsplit(":", 1)[1]),
                                      timeout=10)
    try:
        conn.request("GET", "/%s/resolve/main/nope.json" % LLAMA)  # a small 404, kept alive
        assert conn.getresponse().read()
        with hub._lock:
            served = list(hub._connections)
        assert served, "the hub tracks no open connection"
        assert all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in served)
    finally:
        conn.close()


@pytest.mark.timeout(60)
def test_branches_and_deterministic_commits(tmp_path: Path, folders: dict[str, Path]) -> None:
    again = models.tiny_llama(tmp_path / "again")
    with LoopbackHub() as hub:
        first = hub.add_repo(LLAMA, folders[LLAMA])
        assert hub.add_repo("other/copy", again) == first  # same bytes, same sha
        dev = hub.add_repo(LLAMA, folders[LLAMA_SHARDED], branch="refs/pr/1")
        assert dev != first and hub.commit_of(LLAMA) == first
        status, headers, _ = _http(hub, "HEAD", "/%s/resolve/refs%%2Fpr%%2F1/config.json" % LLAMA)
        assert (status, headers["X-Repo-Commit"]) == (200, dev)
        status, _, body = _http(hub, "GET", "/api/models/%s/refs" % LLAMA)
        assert {b["name"] for b in json.loads(body)["branches"]} == {"main", "refs/pr/1"}


def test_files_of_and_remove_repo(tmp_path: Path, folders: dict[str, Path]) -> None:
    """files_of names the hub's copy and the etag it serves for each file (what a benchmark
    links into a cache); remove_repo stops serving a repo and deletes the copies no other repo
    holds, keeping the shared ones."""
    with LoopbackHub() as hub:
        hub.add_repo(LLAMA, folders[LLAMA])
        hub.add_repo(LLAMA_SHARDED, folders[LLAMA_SHARDED])  # the same tokenizer files
        files = hub.files_of(LLAMA)
        assert set(files) == {p.relative_to(folders[LLAMA]).as_posix()
                              for p in folders[LLAMA].rglob("*") if p.is_file()}
        content, etag = files["config.json"]
        assert content.read_bytes() == (folders[LLAMA] / "config.json").read_bytes()
        status, headers, _ = _http(hub, "HEAD", "/%s/resolve/main/config.json" % LLAMA)
        assert headers["ETag"].strip('"') == etag
        shared = {path for path in files if path in hub.files_of(LLAMA_SHARDED)
                  and files[path][0] == hub.files_of(LLAMA_SHARDED)[path][0]}
        assert "tokenizer.json" in shared
        hub.remove_repo(LLAMA)
        status, _, _ = _http(hub, "HEAD", "/%s/resolve/main/config.json" % LLAMA)
        assert status == 404
        assert not files["model.safetensors"][0].exists()  # its own copy is gone
        assert all(files[path][0].exists() for path in shared)  # the other repo's stay
        with pytest.raises(KeyError):
            hub.files_of(LLAMA)
        hub.remove_repo(LLAMA)  # not served: nothing happens


@pytest.mark.timeout(60)
def test_close_fault_and_stop_within_a_second(hub: LoopbackHub) -> None:
    hub.add_fault(Fault(repo_id=LLAMA, path="config.json", close=True, times=1))
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
        _http(hub, "GET", "/%s/resolve/main/config.json" % LLAMA)
    assert _http(hub, "GET", "/%s/resolve/main/config.json" % LLAMA)[0] == 200
    assert [r.status for r in hub.requests()] == [0, 200]
    assert hub.requests()[0].fault == "close=True"

    # A request stalled for a minute and an idle keep-alive connection must not delay stop().
    hub.add_fault(Fault(path="generation_config.json", stall_s=60))
    outcome: list[BaseException | tuple] = []

    def stalled_get() -> None:
        try:
            outcome.append(_http(hub, "GET", "/%s/resolve/main/generation_config.json" % LLAMA))
        except (http.client.HTTPException, OSError) as err:
            outcome.append(err)

    stalled = threading.Thread(target=stalled_get, daemon=True)
    stalled.start()
    idle = socket.create_connection(("127.0.0.1", int(hub.endpoint.rsplit(":", 1)[1])))
    time.sleep(0.3)
    started = time.monotonic()
    hub.stop()
    assert time.monotonic() - started < 1.0
    stalled.join(timeout=5)
    assert not stalled.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], BaseException), outcome  # body cut
    idle.close()


# --------------------------------------------------------------------------------------------
# The real huggingface_hub client
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_hf_hub_download_snapshot_and_api(hub: LoopbackHub, tmp_path: Path,
                                          folders: dict[str, Path]) -> None:
    hub.add_repo("org/data", folders["org/tiny-custom"], repo_type="dataset")
    result = _client(hub, tmp_path / "home", """
        def main():
            from huggingface_hub import HfApi, hf_hub_download, snapshot_download
            api = HfApi()
            config = hf_hub_download("%(repo)s", "config.json")
            dataset = hf_hub_download("org/data", "config.json", repo_type="dataset")
            snap = snapshot_download("%(sharded)s")
            info = api.model_info("%(repo)s", files_metadata=True)
            lfs = {s.rfilename: s.lfs.sha256 for s in info.siblings if s.lfs}
            return {
                "config": config, "dataset": dataset, "snapshot": snap, "sha": info.sha,
                "lfs": lfs,
                "files": sorted(api.list_repo_files("%(sharded)s")),
                "paths": [p.path for p in api.get_paths_info("%(repo)s", ["config.json", "x"])],
                "exists": [api.file_exists("%(repo)s", "config.json"),
                           api.file_exists("%(repo)s", "nope.json")],
            }
    """ % {"repo": LLAMA, "sharded": LLAMA_SHARDED})
    assert result["ok"], result
    value = result["value"]
    assert Path(value["config"]).read_bytes() == (folders[LLAMA] / "config.json").read_bytes()
    assert Path(value["dataset"]).read_bytes() == (
        folders["org/tiny-custom"] / "config.json").read_bytes()
    assert "/datasets--org--data/" in value["dataset"]
    assert value["sha"] == hub.commit_of(LLAMA)
    assert value["lfs"] == {"model.safetensors": _sha256(folders[LLAMA] / "model.safetensors")}
    expected = sorted(p.name for p in folders[LLAMA_SHARDED].iterdir())
    assert value["files"] == expected
    assert sorted(p.name for p in Path(value["snapshot"]).iterdir()) == expected
    assert value["paths"] == ["config.json"]
    assert value["exists"] == [True, False]
    assert hub.requests(path_contains="/tree/")  # snapshot_download listed the tree
    assert hub.requests(method="POST", path_contains="/paths-info/")


@pytest.mark.timeout(90)
def test_from_pretrained_rank_attribution_and_offline_reload(
        hub: LoopbackHub, tmp_path: Path, folders: dict[str, Path]) -> None:
    load = """
        def main():
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer
            out = {}
            for repo in ("%s", "%s"):
                model = AutoModelForCausalLM.from_pretrained(repo, local_files_only=%s)
                tok = AutoTokenizer.from_pretrained(repo, local_files_only=%s)
                total = sum(float(p.detach().double().sum()) for p in model.parameters())
                out[repo] = {"params": total, "ids": tok("the water is hot")["input_ids"]}
            return out
    """
    home = tmp_path / "home"
    cold = _client(hub, home, load % (LLAMA, LLAMA_SHARDED, False, False), rank=3)
    assert cold["ok"], cold
    from transformers import AutoModelForCausalLM

    for repo in (LLAMA, LLAMA_SHARDED):
        local = AutoModelForCausalLM.from_pretrained(folders[repo])
        expected = sum(float(p.detach().double().sum()) for p in local.parameters())
        assert cold["value"][repo]["params"] == pytest.approx(expected, rel=1e-12)
        assert cold["value"][repo]["ids"] == [7, 96, 13, 36]
    shard_gets = hub.requests(method="GET", path_contains=LLAMA_SHARDED + "/resolve/")
    assert sum(r.path.endswith("-of-00007.safetensors") for r in shard_gets) == 7
    resolve = hub.requests(path_contains="/resolve/")
    assert resolve and {r.rank for r in resolve} == {3}
    assert hub.requests(rank=3) == [r for r in hub.requests() if r.rank is not None]
    assert len(hub.requests()) == len(read_request_log(hub.log_path))

    hub.clear_requests()
    warm = _client(hub, home, load % (LLAMA, LLAMA_SHARDED, True, True), rank=3)
    assert warm["ok"], warm
    assert warm["value"] == cold["value"]
    assert hub.requests() == []  # local_files_only=True: fully offline


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("fault", "repo", "expected", "resolve_requests"), [
    (None, "org/does-not-exist", "RepositoryNotFoundError", 1),
    (Fault(repo_id=LLAMA, status=404), LLAMA, "RepositoryNotFoundError", 1),
    (Fault(repo_id=LLAMA, status=401), LLAMA, "GatedRepoError", 1),
    # http_get retries only 408/429 and dropped connections: a 500 on the body GET raises at once.
    (Fault(repo_id=LLAMA, method="GET", status=500), LLAMA, "HfHubHTTPError", 2),
    # A dropped connection on the metadata HEAD escapes hf_hub_download as the raw httpx2 error.
    (Fault(repo_id=LLAMA, method="HEAD", close=True, times=1), LLAMA, "RemoteProtocolError", 1),
], ids=["missing-repo", "404-fault", "401-gated", "500-on-get", "close-on-head"])
def test_faults_map_to_client_errors(hub: LoopbackHub, tmp_path: Path, fault: Fault | None,
                                     repo: str, expected: str, resolve_requests: int) -> None:
    if fault is not None:
        hub.add_fault(fault)
    result = _client(hub, tmp_path / "home", """
        def main():
            from huggingface_hub import hf_hub_download
            return hf_hub_download("%s", "config.json")
    """ % repo)
    assert not result["ok"], result
    assert expected in result["mro"], result
    assert len(hub.requests(path_contains="/resolve/")) == resolve_requests  # no retries


@pytest.mark.timeout(60)
def test_missing_file_and_revision_errors(hub: LoopbackHub, tmp_path: Path) -> None:
    result = _client(hub, tmp_path / "home", """
        def main():
            from huggingface_hub import hf_hub_download
            out = []
            for kwargs in ({"filename": "nope.json"},
                           {"filename": "config.json", "revision": "no-such-branch"}):
                try:
                    hf_hub_download("%s", **kwargs)
                except Exception as err:
                    out.append([c.__name__ for c in type(err).__mro__])
            return out
    """ % LLAMA)
    assert result["ok"], result
    missing_file, missing_rev = result["value"]
    assert "EntryNotFoundError" in missing_file
    assert "RevisionNotFoundError" in missing_rev


@pytest.mark.timeout(60)
def test_head_500_once_is_retried(hub: LoopbackHub, tmp_path: Path) -> None:
    hub.add_fault(Fault(repo_id=LLAMA, method="HEAD", status=500, times=1))
    result = _client(hub, tmp_path / "home", """
        def main():
            from huggingface_hub import hf_hub_download
            return open(hf_hub_download("%s", "config.json")).read()
    """ % LLAMA)
    assert result["ok"], result
    statuses = [(r.method, r.status) for r in hub.requests(path_contains="/resolve/")]
    # hf_hub_download's first HEAD does not retry; on a retryable error with nothing cached it
    # makes a second metadata call with retries enabled.
    assert statuses == [("HEAD", 500), ("HEAD", 200), ("GET", 200)]


@pytest.mark.timeout(60)
def test_429_retry_after_then_success(hub: LoopbackHub, tmp_path: Path) -> None:
    hub.add_fault(Fault(repo_id=LLAMA, path="config.json", method="GET", status=429,
                        retry_after_s=1, times=1))
    result = _client(hub, tmp_path / "home", """
        def main():
            from huggingface_hub import hf_hub_download
            return open(hf_hub_download("%s", "config.json")).read()
    """ % LLAMA)
    assert result["ok"], result
    gets = hub.requests(method="GET", path_contains="/resolve/")
    assert [r.status for r in gets] == [429, 200]
    # The client waits Retry-After + 1 s.
    assert gets[1].time - gets[0].time >= 1.5


@pytest.mark.timeout(60)
def test_abort_after_bytes_is_retried(hub: LoopbackHub, tmp_path: Path,
                                              folders: dict[str, Path]) -> None:
    hub.add_fault(Fault(repo_id=LLAMA, path="*.safetensors", method="GET",
                        abort_after_bytes=1000, times=1))
    result = _client(hub, tmp_path / "home", """
        def main():
            import hashlib
            from huggingface_hub import hf_hub_download
            path = hf_hub_download("%s", "model.safetensors")
            return hashlib.sha256(open(path, "rb").read()).hexdigest()
    """ % LLAMA)
    assert result["ok"], result
    assert result["value"] == _sha256(folders[LLAMA] / "model.safetensors")
    # http_get catches the RemoteProtocolError and retries after 1 s. It reads the body in
    # 10 MB chunks (constants.DOWNLOAD_CHUNK_SIZE), so the 1000 bytes never reached the file and
    # the retry starts from byte 0 without a Range header (a Range resume needs > 10 MB sent).
    size = (folders[LLAMA] / "model.safetensors").stat().st_size
    gets = hub.requests(method="GET", path_contains="model.safetensors")
    assert [(r.status, r.bytes_sent, r.range) for r in gets] == [(200, 1000, None),
                                                                  (200, size, None)]
    assert gets[1].time - gets[0].time >= 0.9


@pytest.mark.timeout(60)
def test_throttle_and_stall_slow_the_body(hub: LoopbackHub, tmp_path: Path) -> None:
    hub.add_fault(Fault(repo_id=LLAMA, path="*.safetensors", method="GET",
                        throttle_bytes_per_s=500_000, stall_s=0.3))
    result = _client(hub, tmp_path / "home", """
        def main():
            from huggingface_hub import hf_hub_download
            return hf_hub_download("%s", "model.safetensors")
    """ % LLAMA)
    assert result["ok"], result
    (get,) = hub.requests(method="GET", path_contains="model.safetensors")
    # ~110 KB at 500 KB/s plus the stall.
    assert get.duration_s >= 0.3 + 0.15
    assert "throttle_bytes_per_s=500000" in get.fault


@pytest.mark.timeout(90)
def test_sentence_transformers_minilm(tmp_path: Path) -> None:
    folder = models.minilm(tmp_path / "minilm")
    with LoopbackHub() as hub:
        hub.add_repo(models.MINILM_REPO_ID, folder)
        result = _client(hub, tmp_path / "home", """
            def main():
                from sentence_transformers import SentenceTransformer
                model = SentenceTransformer("%s", device="cpu")
                return list(model.encode(["hello world"]).shape)
        """ % models.MINILM_REPO_ID)
        assert result["ok"], result
        assert result["value"] == [1, 384]
        assert hub.requests(path_contains="1_Pooling/config.json")


# --------------------------------------------------------------------------------------------
# Models and CLI
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_custom_model_buffers_after_load(folders: dict[str, Path]) -> None:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folders["org/tiny-custom"])
    assert isinstance(model, models.PatchloadToyModel)
    assert torch.equal(model.scale, torch.arange(16, dtype=torch.float32) * 0.5)
    assert torch.equal(model.offset, torch.arange(16, dtype=torch.float32) * 2 + 1)
    assert model(torch.tensor([[1, 2]])).shape == (1, 2, 16)


@pytest.mark.timeout(60)
def test_cli_serves_and_logs(tmp_path: Path, folders: dict[str, Path]) -> None:
    port_file, log = tmp_path / "endpoint.txt", tmp_path / "cli.jsonl"
    env = dict(os.environ, PATCHLOAD="0", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "patchload.testing.hub", "--repo", "%s=%s" % (LLAMA, folders[LLAMA]),
         "--port-file", str(port_file), "--log", str(log)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "CLI hub did not write its port file"
            time.sleep(0.05)
        endpoint = port_file.read_text().strip()
        with urllib.request.urlopen(endpoint + "/api/models/" + LLAMA, timeout=10) as response:
            assert json.load(response)["id"] == LLAMA
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(endpoint + "/org/x/resolve/main/a", timeout=10)
        logged = read_request_log(log, min_records=2, timeout_s=5)
        assert [(r.path, r.status) for r in logged] == [("/api/models/" + LLAMA, 200),
                                                        ("/org/x/resolve/main/a", 404)]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert proc.returncode == 0


@pytest.mark.timeout(120)
def test_dataset_repo_serves_what_the_datasets_client_asks(tmp_path: Path) -> None:
    """A dataset repo answers every endpoint ``datasets.load_dataset`` and ``HfFileSystem`` use
    (repo info by branch and by commit, tree listings, paths-info, ``/datasets/.../resolve``),
    with no unknown endpoint, and the real client loads its rows."""
    pytest.importorskip("datasets", reason="datasets is not installed (the `test` extra has it)")
    folder = tmp_path / "ds"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "train.csv").write_text("text,label\nx,1\ny,0\n")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n")
    with LoopbackHub(log_path=tmp_path / "requests.jsonl") as hub:
        commit = hub.add_repo("org/ds", folder, repo_type="dataset")
        result = _client(hub, tmp_path / "home", """
            def main():
                import datasets
                from huggingface_hub import HfApi, HfFileSystem

                api = HfApi()
                tree = sorted(e.path for e in api.list_repo_tree(
                    "org/ds", repo_type="dataset", recursive=True))
                info = [e.path for e in api.get_paths_info(
                    "org/ds", ["data/train.csv", "data"], repo_type="dataset")]
                fs = HfFileSystem()
                found = fs.glob("datasets/org/ds/data/*.csv")
                ds = datasets.load_dataset("org/ds", split="train")
                return {"tree": tree, "paths_info": info, "glob": found,
                        "sha": api.dataset_info("org/ds").sha, "rows": ds.to_dict(),
                        "files": [f["filename"] for f in ds.cache_files]}
        """)
        requests = hub.requests()
    assert result["ok"], result
    value = result["value"]
    assert value["tree"] == ["README.md", "data", "data/train.csv"]
    assert value["paths_info"] == ["data/train.csv", "data"]
    assert value["glob"] == ["datasets/org/ds/data/train.csv"]
    assert value["sha"] == commit
    assert value["rows"] == {"text": ["x", "y"], "label": [1, 0]}
    assert f"/org___ds/default/0.0.0/{commit}/" in value["files"][0]
    paths = {(r.method, r.path.replace(commit, "<sha>")) for r in requests}
    assert ("GET", "/api/datasets/org/ds/revision/<sha>") in paths
    assert ("GET", "/api/datasets/org/ds/tree/<sha>") in paths
    assert ("POST", "/api/datasets/org/ds/paths-info/main") in paths
    assert ("GET", "/datasets/org/ds/resolve/<sha>/data/train.csv") in paths
    # Only files the repo lacks are 404 (the client probes for a card, scripts, metadata).
    assert all(r.status in (200, 206) or "/resolve/" in r.path for r in requests), \
        [(r.method, r.path, r.status) for r in requests if r.status not in (200, 206)]


@pytest.mark.timeout(90)
def test_gated_and_private_repos_honour_the_bearer_token(hub: LoopbackHub, folders: dict[str, Path],
                                                         tmp_path: Path) -> None:
    """A gated repo: its info is public (``gated``), its files answer 401 without a token and
    403 with another (``GatedRepoError`` both); a private repo: hidden from anonymous clients
    (401) and other tokens (404) alike (``RepositoryNotFoundError``); the token given reads both,
    as the real hub answers."""
    hub.add_repo("org/gated", folders[LLAMA])
    hub.add_repo("org/private", folders[LLAMA])
    hub.restrict("org/gated", access="gated", tokens=["hf_ok"])
    hub.restrict("org/private", access="private", tokens=["hf_ok"])
    result = _client(hub, tmp_path / "home", """
        def main():
            from huggingface_hub import HfApi, hf_hub_download
            import tempfile
            out = {}
            for repo in ("org/gated", "org/private"):
                for token in (False, "hf_other", "hf_ok"):
                    for what, call in (
                            ("file", lambda: hf_hub_download(  # an empty cache each time
                                repo, "config.json", token=token, cache_dir=tempfile.mkdtemp())),
                            ("info", lambda: HfApi().model_info(repo, token=token))):
                        try:
                            value = call()
                        except Exception as err:
                            value = [c.__name__ for c in type(err).__mro__][:1] + [str(err)]
                        else:
                            value = ("file" if what == "file"
                                     else {"gated": value.gated, "private": value.private})
                        out[f"{repo} {token} {what}"] = value
            return out
    """)
    assert result["ok"], result
    out = result["value"]
    assert out["org/gated False info"] == {"gated": "manual", "private": False}, out
    assert out["org/gated hf_other info"] == {"gated": "manual", "private": False}, out
    assert out["org/gated hf_ok file"] == "file" and out["org/private hf_ok file"] == "file", out
    assert out["org/private hf_ok info"] == {"gated": False, "private": True}, out
    assert out["org/gated False file"][0] == "GatedRepoError", out
    assert "Please log in" in out["org/gated False file"][1], out
    assert out["org/gated hf_other file"][0] == "GatedRepoError", out
    assert "not in the authorized list" in out["org/gated hf_other file"][1], out
    for token in ("False", "hf_other"):
        for what in ("file", "info"):
            assert out[f"org/private {token} {what}"][0] == "RepositoryNotFoundError", out
    statuses = {}
    for request in hub.requests():
        if request.repo_id in ("org/gated", "org/private"):
            statuses.setdefault((request.repo_id, request.path.startswith("/api/")),
                                []).append(request.status)
    assert statuses[("org/gated", False)] == [401, 403, 200, 200], statuses  # HEAD, HEAD, HEAD+GET
    assert statuses[("org/gated", True)] == [200, 200, 200], statuses
    assert statuses[("org/private", False)] == [401, 404, 200, 200], statuses
    assert statuses[("org/private", True)] == [401, 404, 200], statuses
