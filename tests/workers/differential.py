"""Rank worker of the differential tests (tests/test_differential.py): run a plan of steps and
record everything a rank can observe of each call, so that a plain run (``PATCHLOAD=0``) and a
patched run of the same plan can be compared rank by rank.

Usage: ``differential.py PLAN.json``. The plan is::

    {"run_root": "/abs/path",                 # normalised to "<RUN>" in every recorded string
     "per_rank": {"2": {"env": {"HF_HOME": "..."}, "cwd": "..."}},
     "steps": [{"name": "stale/model", "op": "model", "repo": "diff/stale", ...}, ...]}

``per_rank`` is applied first thing, before huggingface_hub or transformers is imported (both
freeze ``HF_HOME`` and friends at import): a rank with its own cache or working directory starts
as if launched with them. Its ``copy`` (``[[source, destination], ...]``) is made first: each
rank copies the source folder beside the destination, and the first rename wins (the ranks of a
node fill one node-local folder, race-free).

With ``"process_group": "gloo"`` in the plan, every rank first joins a gloo process group
(``env://``, torchrun's variables). With ``"init_process_group": "tcp://host:port"`` in the plan, every rank first joins a gloo
process group there, with the rank and world size of ``PLT_RANK`` / ``PLT_WORLD_SIZE`` (ranks
started by ``differential_hosts.py``: a user's ``torch.multiprocessing.spawn`` script).

A step (every key but ``name`` and ``op`` is optional):

* ``op``: ``model`` (``cls.from_pretrained``), ``config`` (``AutoConfig``), ``generation_config``
  (``GenerationConfig``), ``tokenizer`` (``AutoTokenizer``), ``hf_hub_download`` (each of
  ``filenames``, one after another), ``snapshot_download``, ``thread_pool`` (``hf_hub_download``
  of each of ``filenames`` from a user ``ThreadPoolExecutor``, all at once).
* ``processor`` (``AutoProcessor``) and ``sentence_transformer`` (``SentenceTransformer``):
  the object is saved (``save_pretrained``, ``save``) into a folder of this rank's and every
  saved file recorded (``saved_files``).
* ``hub_api``: ``huggingface_hub.<method>(repo, *args, **kwargs)`` (``via: "HfApi"``: through
  ``HfApi(**api)``); its result's ``repr`` recorded (a generator's items, read in the op).
* ``hf_fs``: ``HfFileSystem(skip_instance_cache=True).<method>(path, *args, **kwargs)`` (a fresh
  instance per step: no listing or instance cached by an earlier step); ``read: true`` opens
  ``path`` (in ``mode``, default ``rb``) and reads it to the end instead, or (``read_sizes``)
  reads each of those sizes in turn (``-1``: the rest). Its result rendered without times
  (:func:`fs_view`).
* ``chat_template``: for ``tokenizer``: also record the tokenizer's ``chat_template``.
* ``load_dataset``: ``datasets.load_dataset(repo, *args, **kwargs)``; each split's rows,
  features, number of rows, split name and fingerprint recorded.
* ``repo``: repo id or path (``"./ckpt"`` resolves against the rank's working directory);
  ``cls``: the transformers class for ``model`` (default ``AutoModelForCausalLM``);
  ``kwargs``: more arguments (``dtype`` as a name: ``"float32"``, ``"auto"``);
  ``kwargs_by_rank``: ``{rank: arguments}`` added on that rank only.
* ``inference_mode``: for ``model``: make the call inside ``torch.inference_mode()`` (true: on
  every rank; a list: on those ranks).
* ``config_set_attr``: for ``model``: first ``config = AutoConfig.from_pretrained(repo)``, then
  set this attribute of it to a one-element ``set`` (its ``repr()`` raises: a set is not JSON),
  then pass ``config=config``.
* ``trainer``: a ``transformers.Trainer`` job on ``repo`` (``op_trainer``); ``import_first``:
  a module imported before the step's timer starts (the Trainer's imports, seconds long, are
  the same work in every run).
* ``ranks``: the ranks that make the call (default: all); the others only meet the barriers.
* ``seed``: ``torch``/``random``/``numpy`` seed set right before the call (default 0);
  ``seed_plus_rank``: add the rank to it.
* ``rand_after``: record ``torch.rand(n)`` drawn right after the call (and after the RNG hash).
* ``attempts``: user code retrying the call (``for ...: try: call; break; except: ...``) up to
  this many times; ``retry_delay_s``: ``{rank: seconds}`` slept before each retry.
* ``sleep_before_s``: ``{rank: seconds}`` that rank sleeps before the call (its own work first:
  ``wandb.init()``, rank-0-only data preparation).
* ``collective``: every rank enters this ``torch.distributed`` collective after the step's call
  (a rank that skips the call, at once): ``barrier``, ``all_reduce`` (of one float) or ``ddp``
  (``DistributedDataParallel`` built around a small linear layer); the plan needs
  ``"process_group": "gloo"``.
* ``observe_after_barrier``: for ``hf_hub_download`` and ``snapshot_download``: read the
  returned files only once every rank's call returned (a barrier). Ranks of a node that share a
  ``local_dir`` race in a plain run: one rank's download unlinks the file another rank's call
  has just returned, so what a rank sees right after its call depends on timing.
* ``gate``: ``"rank0_first"``: ranks other than 0 start only once rank 0's first attempt ended,
  so a fault on the first request of a file meets rank 0 in a plain run too (deterministic).

Each rank writes ``$PLT_OUT/rank-<RANK>.json``: its transformers ``session_id`` and, per step
(``_common.step``: ``t0``/``t1``, barriers around it so the hub log cuts into per-step windows),
``skipped`` or ``attempts``: a list, one entry per try, each ``{"ok": true, "obs": {...}}`` or
``{"ok": false, "error": {...}}``, plus ``call_s`` (seconds the call took), ``rng`` (sha256 of ``torch.get_rng_state()`` right after
the call) and ``rand``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PLAN = json.loads(Path(sys.argv[1]).read_text())
_RANK = os.environ.get("PLT_RANK") or os.environ.get("RANK", "0")  # as _common.RANK
_MINE = PLAN.get("per_rank", {}).get(_RANK, {})
os.environ.update(_MINE.get("env", {}))
for _source, _destination in _MINE.get("copy", []):
    if not os.path.isdir(_destination):
        import shutil

        _mine = f"{_destination}.rank-{_RANK}"
        shutil.copytree(_source, _mine, symlinks=True)
        try:
            os.makedirs(os.path.dirname(_destination), exist_ok=True)
            os.rename(_mine, _destination)
        except OSError:  # another rank of this node was first
            shutil.rmtree(_mine)
if _MINE.get("cwd"):
    os.chdir(_MINE["cwd"])
os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{_RANK}"

import concurrent.futures  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import importlib  # noqa: E402
import inspect  # noqa: E402
import logging  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import _common  # noqa: E402
from _common import RANK  # noqa: E402

import patchload  # noqa: E402 - installs the patches (unless PATCHLOAD=0)
import numpy  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()

SENTENCES = ["the first sentence is here .", "people write many words", "water is hot"]
# Words of patchload.testing.models.mistral_style_tokenizer's vocabulary, split otherwise by the
# regex transformers' Mistral fix puts in front of its pre-tokenizer.
MISTRAL_SENTENCES = ["w7 w8", "Hello w12 w100000", " w3"]

# Strings that legitimately differ between the two runs (their temporary directories, the hub's
# port), replaced in everything recorded; nothing else is normalised.
_REPLACE = [(p, "<RUN>") for p in sorted({PLAN["run_root"], os.path.realpath(PLAN["run_root"])},
                                          key=len, reverse=True)]
_REPLACE.append((os.environ["HF_ENDPOINT"], "<HUB>"))


def norm(text: str) -> str:
    for raw, tag in _REPLACE:
        text = text.replace(raw, tag)
    return text


def jsonable(obj: Any) -> Any:
    return json.loads(norm(json.dumps(obj, default=str, sort_keys=True)))


def rng_hash() -> str:
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)


def error_record(exc: BaseException) -> dict[str, Any]:
    """Class (name, ``module.qualname`` of every class in its MRO, so the comparison can ask
    "is it an instance of the plain run's class"), message, and whether patchload raised it as a
    follower of another rank."""
    return {
        "type": type(exc).__name__,
        "mro": [f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__],
        "message": norm(str(exc))[-4000:],
        "follower": isinstance(exc, patchload.LeaderFailedError),
        "leader_rank": getattr(exc, "leader_rank", None),
    }


def file_sha(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _dtype(value: Any) -> Any:
    return value if value == "auto" else getattr(torch, value)


def _kwargs(step: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(step.get("kwargs", {}))
    kwargs.update(step.get("kwargs_by_rank", {}).get(_RANK, {}))
    if "dtype" in kwargs:
        kwargs["dtype"] = _dtype(kwargs["dtype"])
    return kwargs


def loading_info(info: dict[str, Any]) -> dict[str, Any]:
    """``output_loading_info``'s dict with every collection as a sorted list (sets and lists
    mean the same here)."""
    return {key: sorted(jsonable(list(value)), key=lambda v: json.dumps(v, sort_keys=True))
            for key, value in sorted(info.items())}


def download_record(path: str) -> dict[str, Any]:
    return {"path": norm(str(path)), "sha256": file_sha(path)}


# --- ops: each makes the call and returns what the rank can observe of its result -------------

def op_model(step: dict[str, Any]) -> dict[str, Any]:
    cls = getattr(transformers, step.get("cls", "AutoModelForCausalLM"))
    kwargs = _kwargs(step)
    if step.get("config_set_attr"):
        config = transformers.AutoConfig.from_pretrained(step["repo"])
        setattr(config, step["config_set_attr"], {"x"})  # one element: str() is deterministic
        kwargs["config"] = config
    inference = step.get("inference_mode")
    if isinstance(inference, list):
        inference = int(_RANK) in inference
    # A model class that keeps other modules in float32 on some ranks (a patched attribute).
    fp32 = step.get("keep_in_fp32_strict", {})
    owner = getattr(transformers, fp32.get("cls", "PreTrainedModel"))
    saved = owner.__dict__.get("_keep_in_fp32_modules_strict")
    patched = int(_RANK) in fp32.get("ranks", ())
    if patched:
        owner._keep_in_fp32_modules_strict = fp32["modules"]
    try:
        with torch.inference_mode() if inference else contextlib.nullcontext():
            result = cls.from_pretrained(step["repo"], **kwargs)
    finally:
        if patched:
            owner._keep_in_fp32_modules_strict = saved
    obs: dict[str, Any] = {}
    if kwargs.get("output_loading_info"):
        result, info = result
        obs["loading_info"] = loading_info(info)
    obs["fingerprint"] = jsonable(_common.fingerprint(result))
    return obs


def blob_handles() -> dict[str, int]:
    """The mappings and open fds of patchload's shared blobs (memfds) in this process."""
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        mapped = sum("/memfd:patchload" in line for line in maps)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:patchload")
        except OSError:  # the listing's own fd, closed by now
            pass
    return {"mapped": mapped, "fds": fds}


def op_train(step: dict[str, Any]) -> dict[str, Any]:
    """Load, build an SGD optimizer over the parameters (with ``keep_view``: after keeping a view
    of that parameter), take one step on fixed ids; the weights after it, and (without
    ``keep_view``) whether this rank still maps a shared blob."""
    cls = getattr(transformers, step.get("cls", "AutoModelForCausalLM"))
    model = cls.from_pretrained(step["repo"], **_kwargs(step))
    view = model.get_parameter(step["keep_view"])[:2] if step.get("keep_view") else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    obs: dict[str, Any] = {}
    if view is None:  # this rank's own mapping goes at once (its fds are the leader's, later)
        obs["mapped_after_optimizer"] = blob_handles()["mapped"]
    ids = torch.arange(12).reshape(1, 12) % model.config.vocab_size
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    obs.update(loss=loss.item(), fingerprint=jsonable(_common.fingerprint(model)))
    if view is not None:
        obs["view"] = view.tolist()
    if step.get("hold"):
        _HELD.append(model)
    return obs


def op_trainer(step: dict[str, Any]) -> dict[str, Any]:
    """A ``transformers.Trainer`` job, ``run_clm.py``'s shape on CPU: ``TrainingArguments``
    (under torchrun it builds the gloo process group), ``AutoTokenizer`` and
    ``cls.from_pretrained``, then ``Trainer.train()`` for ``max_steps`` (default 2) steps of one
    fixed sequence per rank (the Trainer wraps the model in DDP). The losses logged and the
    weights after training."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(_common.OUT / f"trainer-{RANK}"), report_to=[],
                             use_cpu=True, max_steps=int(step.get("max_steps", 2)),
                             per_device_train_batch_size=1, learning_rate=1e-3, logging_steps=1,
                             save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(step["repo"])
    cls = getattr(transformers, step.get("cls", "AutoModelForCausalLM"))
    model = cls.from_pretrained(step["repo"], **_kwargs(step))
    ids = [i % model.config.vocab_size for i in range(12)]
    train = [{"input_ids": ids, "labels": ids}] * 4
    trainer = Trainer(model=model, args=args, train_dataset=train, processing_class=tokenizer)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": losses, "fingerprint": jsonable(_common.fingerprint(model))}


_HELD: list[Any] = []  # models a "train" step with "hold" keeps alive until "blob_handles"


def op_model_to(step: dict[str, Any]) -> dict[str, Any]:
    """Load, then ``model.to(step["to"])`` (a dtype name: the weights leave the loaded
    tensors, as with a move to a GPU); the weights after it. The model stays alive until the
    next ``blob_handles``."""
    cls = getattr(transformers, step.get("cls", "AutoModelForCausalLM"))
    model = cls.from_pretrained(step["repo"], **_kwargs(step)).to(_dtype(step["to"]))
    _HELD.append(model)
    return {"fingerprint": jsonable(_common.fingerprint(model))}


def op_blob_handles(step: dict[str, Any]) -> dict[str, Any]:
    """``blob_handles()`` once both are 0 on this rank, or after ``wait_s`` seconds."""
    deadline = time.monotonic() + float(step.get("wait_s", 10.0))
    while any(blob_handles().values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    handles = blob_handles()
    _HELD.clear()
    return {"handles": handles}


def op_config(step: dict[str, Any]) -> dict[str, Any]:
    config = transformers.AutoConfig.from_pretrained(step["repo"], **_kwargs(step))
    return {"class": type(config).__name__, "config": jsonable(config.to_dict())}


def op_generation_config(step: dict[str, Any]) -> dict[str, Any]:
    config = transformers.GenerationConfig.from_pretrained(step["repo"], **_kwargs(step))
    return {"generation_config": jsonable(config.to_dict())}


class _Warnings(logging.Handler):
    """A library's WARNING lines while a step runs (``warnings``: true)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(norm(record.getMessage()))


def op_tokenizer(step: dict[str, Any]) -> dict[str, Any]:
    caught = _Warnings()
    library = logging.getLogger("transformers")
    if step.get("warnings"):
        library.addHandler(caught)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(step["repo"], **_kwargs(step))
    finally:
        library.removeHandler(caught)
    extra: dict[str, Any] = {}
    if step.get("warnings"):
        extra["warnings"] = caught.lines
        backend = getattr(tok, "backend_tokenizer", None)
        extra["pre_tokenizer"] = None if backend is None else \
            json.loads(backend.to_str()).get("pre_tokenizer")
        extra["mistral_ids"] = tok(MISTRAL_SENTENCES)["input_ids"]
    if step.get("chat_template"):  # what a repo's additional_chat_templates/ added
        extra["chat_template"] = jsonable(getattr(tok, "chat_template", None))
    return {**extra, "class": type(tok).__name__, "input_ids": tok(SENTENCES)["input_ids"],
            "len": len(tok), "special_tokens": jsonable(tok.special_tokens_map),
            "model_max_length": tok.model_max_length, "name_or_path": norm(tok.name_or_path),
            # what save_pretrained writes into tokenizer_config.json
            "init_kwargs": jsonable(tok.init_kwargs)}


def saved_files(folder: Path) -> dict[str, Any]:
    """Every file under ``folder``: its sha256 (of the text with the run's directory and the
    hub's address normalised, for a text file) and, for a small text file, the text itself (a
    readable difference)."""
    out: dict[str, Any] = {}
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        try:
            text = norm(data.decode("utf-8"))
        except UnicodeDecodeError:
            text = None
        name = path.relative_to(folder).as_posix()
        out[name] = {"sha256": hashlib.sha256(data if text is None else text.encode()).hexdigest()}
        if text is not None and len(text) < 20_000:
            out[name]["text"] = text
    return out


def _save_dir(step: dict[str, Any]) -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f"save-{RANK}-"))


def op_processor(step: dict[str, Any]) -> dict[str, Any]:
    processor = transformers.AutoProcessor.from_pretrained(step["repo"], **_kwargs(step))
    folder = _save_dir(step)
    processor.save_pretrained(folder)
    return {"class": type(processor).__name__, "saved": saved_files(folder)}


def op_sentence_transformer(step: dict[str, Any]) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(step["repo"], device="cpu", **_kwargs(step))
    folder = _save_dir(step)
    model.save(str(folder))
    embeddings = model.encode(SENTENCES, convert_to_numpy=True)
    return {"saved": saved_files(folder),
            "embeddings": hashlib.sha256(embeddings.tobytes()).hexdigest(),
            # what a later save (after training) asks the hub about
            "card_local_files_only": model.model_card_data.local_files_only}


class Later:
    """An observation read after the step's barrier (``observe_after_barrier``), or at once."""

    def __init__(self, step: dict[str, Any], read: Callable[[], Any]) -> None:
        self.read = read
        self.value = None if step.get("observe_after_barrier") else read()


def settle(record: dict[str, Any]) -> None:
    """Read every :class:`Later` of the step's attempts (after the barrier) into the record."""
    for entry in record.get("attempts", []):
        for key, value in entry.get("obs", {}).items():
            if isinstance(value, Later):
                entry["obs"][key] = value.read() if value.value is None else value.value


def op_hf_hub_download(step: dict[str, Any]) -> dict[str, Any]:
    from huggingface_hub import hf_hub_download

    names = step.get("filenames_by_rank", {}).get(str(RANK), step["filenames"])
    caught = _Warnings()
    library = logging.getLogger("huggingface_hub")
    if step.get("warnings"):
        library.addHandler(caught)
    try:
        paths = [hf_hub_download(step["repo"], name, **_kwargs(step)) for name in names]
    finally:
        library.removeHandler(caught)
    extra = {"warnings": caught.lines} if step.get("warnings") else {}
    return {"files": Later(step, lambda: [download_record(p) for p in paths]), **extra}


def op_thread_pool(step: dict[str, Any]) -> dict[str, Any]:
    from huggingface_hub import hf_hub_download

    names = step["filenames"]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(names)) as pool:
        paths = list(pool.map(lambda name: hf_hub_download(step["repo"], name, **_kwargs(step)),
                              names))
    return {"files": [download_record(p) for p in paths]}


def _download_metadata(path: Path) -> list[str]:
    """A local_dir metadata file's commit and etag, read under huggingface_hub's lock: another
    rank of the node, which shares the folder, may be rewriting it (``open("w")`` empties it
    first), and an unlocked read then sees an empty file where plain and patched agree."""
    from huggingface_hub.utils import WeakFileLock

    with WeakFileLock(path.with_suffix(".lock")):
        return path.read_text().splitlines()[:2]


def op_snapshot_download(step: dict[str, Any]) -> dict[str, Any]:
    from huggingface_hub import snapshot_download

    folder = Path(snapshot_download(step["repo"], **_kwargs(step)))
    return {"folder": norm(str(folder)), "files": Later(step, lambda: _folder_files(folder))}


def _folder_files(folder: Path) -> dict[str, Any]:
    files: dict[str, Any] = {}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if not path.is_file():
            continue
        if name.startswith(".cache/"):  # a local_dir's download metadata: commit and etag
            if name.endswith(".metadata"):  # (its third line is a time)
                files[name] = _download_metadata(path)
            continue
        files[name] = file_sha(path)
    return files


def op_hub_api(step: dict[str, Any]) -> dict[str, Any]:
    import huggingface_hub

    owner = huggingface_hub.HfApi(**step.get("api", {})) if step.get("via") == "HfApi" \
        else huggingface_hub
    result = getattr(owner, step["method"])(step["repo"], *step.get("args", []), **_kwargs(step))
    if inspect.isgenerator(result):
        return {"type": "generator", "items": [norm(repr(item)) for item in result]}
    return {"type": type(result).__name__, "repr": norm(repr(result))}


def fs_view(result: Any) -> Any:
    """An ``HfFileSystem`` result without what differs between runs (commit dates): an entry
    dict as its name, size and type; names sorted; bytes as their length and sha256."""
    if isinstance(result, bytes):
        return {"bytes": len(result), "sha256": hashlib.sha256(result).hexdigest()}
    if isinstance(result, str):
        return {"str": len(result), "sha256": hashlib.sha256(result.encode()).hexdigest()}
    if isinstance(result, dict) and "name" in result:
        return {key: result.get(key) for key in ("name", "size", "type")}
    if isinstance(result, dict):
        return {name: fs_view(entry) for name, entry in sorted(result.items())}
    if isinstance(result, list) and result and all(isinstance(item, bytes) for item in result):
        return [fs_view(item) for item in result]  # successive reads: their order counts
    if isinstance(result, list):
        return sorted((fs_view(item) for item in result), key=lambda v: json.dumps(v))
    return result


def op_hf_fs(step: dict[str, Any]) -> dict[str, Any]:
    from huggingface_hub import HfFileSystem

    fs = HfFileSystem(skip_instance_cache=True)
    if step.get("read"):
        with fs.open(step["path"], step.get("mode", "rb")) as file:
            if "read_sizes" in step:  # partial reads, then the rest
                result: Any = [file.read(size) for size in step["read_sizes"]]
            else:
                result = file.read()
    else:
        result = getattr(fs, step["method"])(step["path"], *step.get("args", []),
                                             **_kwargs(step))
    return {"type": type(result).__name__, "value": jsonable(fs_view(result))}


def _dataset_view(dataset: Any) -> dict[str, Any]:
    return {"rows": jsonable(dataset.to_dict()), "features": jsonable(dataset.features.to_dict()),
            "num_rows": dataset.num_rows, "split": str(dataset.split),
            "fingerprint": dataset._fingerprint}


def op_load_dataset(step: dict[str, Any]) -> dict[str, Any]:
    import datasets

    datasets.disable_progress_bars()  # its bars write to stderr only; nothing a rank compares
    result = datasets.load_dataset(step["repo"], *step.get("args", []), **_kwargs(step))
    if isinstance(result, datasets.Dataset):
        return {"dataset": _dataset_view(result)}
    return {"splits": {name: _dataset_view(split) for name, split in sorted(result.items())}}


OPS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "model": op_model, "config": op_config, "generation_config": op_generation_config,
    "tokenizer": op_tokenizer, "hf_hub_download": op_hf_hub_download,
    "thread_pool": op_thread_pool, "snapshot_download": op_snapshot_download,
    "processor": op_processor, "sentence_transformer": op_sentence_transformer,
    "train": op_train, "trainer": op_trainer, "model_to": op_model_to,
    "blob_handles": op_blob_handles,
    "hub_api": op_hub_api, "hf_fs": op_hf_fs, "load_dataset": op_load_dataset}


# --- running a step -----------------------------------------------------------------------------

def _wait_key(store: Any, key: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"[rank {RANK}] gate {key} not opened within {timeout_s} s")
        time.sleep(0.02)


def run_step(step: dict[str, Any], record: dict[str, Any], barrier: _common.Barrier) -> None:
    gate = step.get("gate")
    if gate not in (None, "rank0_first"):
        raise ValueError(f"unknown gate {gate!r}")
    gate_key = f"gate/{step['name']}"
    if gate and RANK != 0 and barrier.store is not None:
        _wait_key(barrier.store, gate_key)
    time.sleep(float(step.get("sleep_before_s", {}).get(str(RANK), 0.0)))
    seed_everything(step.get("seed", 0) + (RANK if step.get("seed_plus_rank") else 0))
    if step.get("import_first"):
        importlib.import_module(step["import_first"])
    op = OPS[step["op"]]
    attempts = []
    for attempt in range(step.get("attempts", 1)):
        if attempt:
            time.sleep(float(step.get("retry_delay_s", {}).get(str(RANK), 0.0)))
        start = time.monotonic()
        try:
            entry: dict[str, Any] = {"ok": True, "obs": op(step)}
        except Exception as exc:  # noqa: BLE001 - what the rank observed; the test compares it
            entry = {"ok": False, "error": error_record(exc)}
        entry["call_s"] = time.monotonic() - start
        entry["rng"] = rng_hash()
        if step.get("rand_after"):
            entry["rand"] = torch.rand(step["rand_after"]).tolist()
        attempts.append(entry)
        if attempt == 0 and gate and RANK == 0 and barrier.store is not None:
            barrier.store.set(gate_key, "1")
        if entry["ok"]:
            break
    record["attempts"] = attempts


def enter_collective(name: str) -> None:
    import torch.distributed as dist

    if name == "barrier":
        dist.barrier()
    elif name == "all_reduce":
        dist.all_reduce(torch.zeros(1))
    elif name == "ddp":
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    else:
        raise ValueError(f"unknown collective {name!r}")


def body(report: dict[str, Any]) -> None:
    if PLAN.get("init_process_group"):
        import datetime

        import torch.distributed as dist

        # A group built by hand, as a torch.multiprocessing.spawn script does: no launcher
        # variable names this rank (the SLURM ones, if any, are the outer step's).
        dist.init_process_group("gloo", init_method=PLAN["init_process_group"], rank=RANK,
                                world_size=_common.WORLD_SIZE,
                                timeout=datetime.timedelta(seconds=120))
    elif PLAN.get("process_group"):
        import datetime

        import torch.distributed as dist

        dist.init_process_group(PLAN["process_group"], timeout=datetime.timedelta(seconds=120))
    report["installed"] = patchload.is_installed()
    report["cwd"] = norm(os.getcwd())
    report["hf_home"] = norm(os.environ.get("HF_HOME", ""))
    # transformers' own requests (its safetensors auto-conversion thread) carry no rank origin,
    # only this process's session id: the harness attributes them by it.
    report["session_id"] = transformers.utils.hub.SESSION_ID
    barrier = _common.Barrier("plt-differential")
    for step in PLAN["steps"]:
        with _common.step(report, step["name"], barrier) as record:
            if RANK in step.get("ranks", [RANK]):
                run_step(step, record, barrier)
            else:
                record["skipped"] = True
            if step.get("observe_after_barrier"):
                barrier()
            settle(record)
            if step.get("collective"):
                enter_collective(step["collective"])
        _common.write_report(report)  # a later hang still leaves the earlier steps readable


if __name__ == "__main__":
    # A step may have built a process group too (the Trainer's TrainingArguments).
    _common.main(body, skip_finalization=lambda: torch.distributed.is_initialized())
