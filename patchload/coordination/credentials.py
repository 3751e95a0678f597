"""Hub credentials across ranks: shared only where any credentials could have fetched the same.

A call's key holds no credentials digest (``HF_TOKEN`` or the token file): ranks with other
tokens meet at one call, and rank 0 leads it as any other. What a rank may take from a leader
whose credentials differ from its own is decided by one rule: **a rank never gets a file or an
answer that its own credentials could not have fetched**. So across credentials only what any
credentials can fetch is shared: every repo the leader's call resolved files of (its pins) must
be neither gated nor private, as one anonymous metadata request shows (``HfApi.repo_info(...,
token=False)``: a gated repo says ``gated``, a private one answers 401/404 anonymously). The
answer is cached per job, per (repo type, repo, commit), in the store; the leader asks it
before publishing its outcome whenever some rank of the call's scope reported other credentials
(so followers make no request), a follower only where the leader did not (it reported its
credentials after the leader looked).

Each rank reports its digest (never the token) to the store key ``ranks/credentials`` at its
first coordinated call, and again when it changes (:mod:`.rank0`); the last entry of a rank is
its current one. A leader's claim carries its digest too, so a follower compares its own with
it and reads no reports. With one token everywhere nothing here makes a request or writes a
key: the leader reads ``ranks/credentials`` once per call until every rank of the call's scope
reported the leader's digest, then no more.

Not collective; no function here waits for another rank.
"""

from __future__ import annotations

import json
import urllib.parse
from typing import TYPE_CHECKING, Any, Callable, Final

from .._logging import get_logger
from .replay import is_answer

if TYPE_CHECKING:
    from .calls import Call
    from .store import JobStore

__all__ = ["call_credentials", "digests", "publish_verdicts", "repos_of", "unshareable"]

logger = get_logger(__name__)

KEY: Final = "ranks/credentials"
_VERDICT: Final = "credentials/public/"
_SECRETS: Final = ("token", "use_auth_token")


def call_credentials(kwargs: dict[str, Any]) -> str | None:
    """The digest of the credentials a call sends by default (``HF_TOKEN`` or the token file:
    :func:`.key.credentials_digest`), or None where credentials cannot change what it gets:
    the call passes a token of its own (``token=`` / ``use_auth_token=``: its digest is in the
    call's key, equal on every rank that shares the call), runs offline (``local_files_only``,
    ``HF_HUB_OFFLINE``: no request, plain reads the cache whatever the token). Never raises."""
    from huggingface_hub import constants

    from .key import credentials_digest

    if any(kwargs.get(name) not in (None, True) for name in _SECRETS):
        return None
    if kwargs.get("local_files_only") or constants.HF_HUB_OFFLINE:
        return None
    return credentials_digest()


def _read(store: JobStore, key: str) -> str | None:
    absent = "\x00absent"
    with store.lock:
        value = store.store.compare_set(key, absent, absent + "-never-written").decode()
    return None if value == absent else value


def digests(store: JobStore) -> dict[int, str]:
    """Every rank's reported credentials digest, ``{rank: digest}`` (its latest report), in one
    store request."""
    text = _read(store, KEY) or ""
    seen: dict[int, str] = {}
    for entry in text.split(","):
        rank, sep, digest = entry.partition(":")
        if sep and rank.strip().isdigit():
            seen[int(rank)] = digest
    return seen


def _scope_ranks(call: Call) -> set[int]:
    topology = call.topology
    return set(topology.node_ranks()) if call.scope == "node" else set(range(topology.world_size))


def repos_of(pins: dict[str, Any]) -> dict[tuple[str, str], str]:
    """The repos a call's pins name (``<type>:<repo>:<path>``, see
    :attr:`.call.Mode.pins`), each with a commit it resolved (``""`` if none: every file of it
    found absent)."""
    repos: dict[tuple[str, str], str] = {}
    answered = []
    for key, pin in pins.items():
        if is_answer(key):  # a recorded HTTP answer (``http:<METHOD> <url> ...``): its URL's repo
            answered.append(key)
            continue
        parts = key.split(":", 2)
        if len(parts) != 3:
            continue
        commit = ""
        if isinstance(pin, list) and pin and isinstance(pin[0], str) and pin[0] != "local_dir":
            commit = pin[0]
        elif isinstance(pin, list) and len(pin) == 2 and pin[0] == "local_dir":
            commit = next((e[1] for e in pin[1] if isinstance(e, list) and len(e) > 1
                           and isinstance(e[1], str)), "")
        where = (parts[0], parts[1])
        if commit or where not in repos:
            repos[where] = commit
    for key in answered:
        where = _answered_repo(key, repos)
        if where is not None and where not in repos:
            repos[where] = ""
    return repos


_API_TYPES: Final = {"models": "model", "datasets": "dataset", "spaces": "space"}


def _answered_repo(key: str, known: dict[tuple[str, str], str]) -> tuple[str, str] | None:
    """The repo a recorded answer's URL names (``/api/<type>s/<repo>/...`` or
    ``/[<type>s/]<repo>/resolve/...``): one of ``known`` whose path it starts with, else its
    first two path segments (a repo with a namespace; a bare name followed by more segments is
    taken with the next one, a repo that does not exist, so never public: such ranks then make
    the call among themselves; so is any other API's path). None for a URL with no path."""
    url = key[len("http:"):].split(" ")[1] if key.count(" ") >= 2 else ""
    path = urllib.parse.urlsplit(url).path.strip("/").split("/")
    if len(path) >= 2 and path[0] == "api" and path[1] in _API_TYPES:
        repo_type, rest = _API_TYPES[path[1]], path[2:]
    elif path and path[0] == "api":
        # Another API (whoami: the leader's own identity): named as a repo that does not
        # exist, so never public, and ranks with other credentials make the call themselves.
        return ("model", "/".join(path))
    elif path and path[0] in ("datasets", "spaces"):
        repo_type, rest = _API_TYPES[path[0]], path[1:]
    else:
        repo_type, rest = "model", path
    for known_type, repo_id in known:
        parts = repo_id.split("/")
        if known_type == repo_type and rest[:len(parts)] == parts:
            return (known_type, repo_id)
    named = "/".join(rest[:2])
    return (repo_type, named) if named else None


def _anonymous(repo_type: str, repo_id: str, commit: str) -> tuple[bool, str]:
    """(public, why): one anonymous ``repo_info`` request (the caller runs it as a plain
    call). Any failure counts as not public."""
    from huggingface_hub import HfApi

    try:
        info = HfApi().repo_info(repo_id, repo_type=repo_type, revision=commit or None,
                                 token=False)
    except Exception as err:  # noqa: BLE001 - unreadable anonymously: not for every credential
        return False, f"{type(err).__name__} to an anonymous request"
    if getattr(info, "private", False):
        return False, "private"
    if getattr(info, "gated", False):
        return False, f"gated ({info.gated})"
    return True, "public"


def _verdict(store: JobStore, repo_type: str, repo_id: str, commit: str) -> tuple[bool, str]:
    """Whether any credentials can read the repo: the job's cached answer, else one anonymous
    request whose answer is cached for the job."""
    key = f"{_VERDICT}{repo_type}:{repo_id}@{commit}"
    cached = _read(store, key)
    if cached is not None:
        try:
            public, why = json.loads(cached)
            return bool(public), str(why)
        except (ValueError, TypeError):
            pass
    public, why = _anonymous(repo_type, repo_id, commit)
    with store.lock:
        store.store.set(key, json.dumps([public, why]))
    return public, why


def publish_verdicts(call: Call, mine: str, pins: dict[str, Any]) -> None:
    """Leader, before publishing its outcome: where a rank of the call's scope reported other
    credentials than ``mine``, establish for each repo of ``pins`` whether it is public (one
    anonymous request per repo not yet known to the job), so that its followers with other
    credentials decide without a request. A store or hub failure only leaves it to them."""
    try:
        if not _others_differ(call, mine):
            return
        for (repo_type, repo_id), commit in sorted(repos_of(pins).items()):
            _verdict(call.store, repo_type, repo_id, commit)
    except Exception as err:  # noqa: BLE001 - the followers then ask themselves
        logger.debug("%s: establishing whether its repos are public failed: %s", call.prefix(),
                     err)


def _others_differ(call: Call, mine: str) -> bool:
    """Whether a rank of the call's scope reported other credentials than ``mine``. Once every
    one of them reported ``mine``, remembered for the store (no more reads): a rank whose
    credentials change later finds the leader's claim with other credentials and asks for
    itself (:func:`unshareable`)."""
    ranks = frozenset(_scope_ranks(call))
    if (ranks, mine) in call.store.same_credentials:
        return False
    seen = digests(call.store)
    if any(digest != mine for rank, digest in seen.items() if rank in ranks):
        return True
    if ranks <= seen.keys():
        call.store.same_credentials.add((ranks, mine))
    return False


def unshareable(call: Call, leader_rank: int, mine: str,
                pins: Callable[[], dict[str, Any] | None],
                source: tuple[str, str] | None, theirs: str | None = None) -> str | None:
    """Follower: why it must not take the result of a leader whose credentials differ from
    ``mine`` (None: they are equal, or every repo the leader's call resolved is public; with no
    repo pinned, ``source``: the repo the call names). ``pins()`` waits for the leader's pins
    (None: it failed, and its error is not taken across credentials: its repos are unknown);
    called only where the credentials differ, so that with one token nobody waits here.
    ``theirs``: the leader's digest as its claim carried it (:attr:`.calls.Role`); None: read
    from its reports (one store request).

    Raises:
        Exception: a store failure (the caller then takes nothing across credentials).
    """
    if theirs is None:
        theirs = digests(call.store).get(leader_rank)
    if theirs == mine:
        return None
    leader_pins = pins()
    if leader_pins is None:
        return f"rank {leader_rank}, with other hub credentials, failed"
    repos = repos_of(leader_pins)
    if not repos and source is not None:
        repos = {source: ""}
    for (repo_type, repo_id), commit in sorted(repos.items()):
        public, why = _verdict(call.store, repo_type, repo_id, commit)
        if not public:
            return f"the {repo_type} repo {repo_id} is {why}"
    return None
