"""Call identity: the arguments that decide a patched call's result, rendered the same on every rank.

Two ranks meet at one call only when their renderings are equal, so rendering is conservative:

- by parameter name (positional and keyword spellings agree);
- the source (the first positional argument, or ``pretrained_model_name_or_path`` and the like),
  when it names an existing local file or directory, adds its real absolute path as
  ``__source__`` (``./ckpt`` in two working directories names two checkpoints; the caller
  fingerprints it); so does any other string argument that names one (``config="./cfg"``), as
  ``__path__<name>``, except the folders a call writes (``cache_dir``, sentence-transformers'
  ``cache_folder``, ``local_dir``: a leader creates them meanwhile);
- a folder a call downloads into (``local_dir``, sentence-transformers' ``cache_folder``) adds its
  real absolute path, existing or not, as ``__dir__<name>`` (``local_dir="model"`` in two working
  directories names two folders: ranks that name two folders never meet at one call);
- containers recursively (sets sorted), configs by their ``to_dict()``, dtypes and devices by
  name, tensors and modules by structure (names, shapes, dtypes), never by their values' bytes;
- anything else that has no stable, bounded rendering (an object whose ``repr`` raises or names
  an address, a callable, a very large value) makes the whole call **unrenderable**: it is then
  not matched across ranks at all (the caller runs it plainly).

Rendering never raises and its cost is bounded by ``_MAX_ITEMS`` items and ``_MAX_CHARS``
characters per argument.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import os
import re
from typing import Any, Callable, Final

from .._libraries import facts

__all__ = ["DOWNLOAD_DIRS", "Unrenderable", "credentials_digest", "deciding_arguments", "digest",
           "process_state"]

_MAX_ITEMS: Final = 100_000
_MAX_CHARS: Final = 1_000_000
_ADDRESS: Final = re.compile(r" at 0x[0-9a-fA-F]+")

# Arguments that never change what a call returns, or differ per rank without meaning.
_VOLATILE: Final = frozenset({
    "tqdm_class", "user_agent", "headers", "proxies", "etag_timeout", "library_name",
    "library_version", "max_workers", "resume_download", "_from_auto", "_from_pipeline",
    "_commit_hash",
})
# Credentials: identity by hash only (two users' tokens may see two different repos).
_SECRETS: Final = frozenset({"token", "use_auth_token"})
# What a call loads from: a repo id, or a local path (then rendered as ``path:<real path>``): the
# argument names the patch registry gives (``LibraryFacts.source_names``, handed down by install()),
# and the name of the first positional argument of a call whose signature does not bind.
_UNBOUND_SOURCE: Final = "arg0"
# Folders a call writes into: whether they exist yet says nothing about the result.
_OUTPUTS: Final = frozenset({"cache_dir", "cache_folder", "local_dir", "offload_folder"})
# Folders a call downloads into whose real path is part of its identity (``cache_dir`` is the
# caller's: see ``call._cache_dir``).
DOWNLOAD_DIRS: Final = frozenset({"cache_folder", "local_dir"})


class Unrenderable(Exception):
    """An argument has no stable, bounded rendering; the call is not matched across ranks."""


class _Budget:
    def __init__(self) -> None:
        self.items = 0

    def spend(self) -> None:
        self.items += 1
        if self.items > _MAX_ITEMS:
            raise Unrenderable(f"more than {_MAX_ITEMS} items")


def _local_path(value: Any) -> str | None:
    """``path:<real path>`` when ``value`` names an existing local file or directory
    (transformers and diffusers then load from it, not from the hub), else None."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value or len(value) > 4096:
        return None
    try:
        return "path:" + os.path.realpath(value) if os.path.exists(value) else None
    except (OSError, ValueError):
        return None


def _folder(value: Any) -> str | None:
    """``dir:<real path>`` of a folder a call downloads into, whether it exists yet or not (with
    ``~`` expanded, and not: huggingface_hub 0.x takes it literally, 1.x expands it), else
    None."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value or len(value) > 4096:
        return None
    try:
        real = {os.path.realpath(value), os.path.realpath(os.path.expanduser(value))}
    except (OSError, ValueError):
        return None
    return "dir:" + "|".join(sorted(real))


def _render(value: Any, budget: _Budget) -> str:
    budget.spend()
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, os.PathLike):
        return "pathlike:" + repr(os.fspath(value))
    if isinstance(value, bytes):
        return "bytes:" + hashlib.sha1(value).hexdigest()
    if isinstance(value, dict):
        items = sorted((_render(k, budget), _render(v, budget)) for k, v in value.items())
        return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    if isinstance(value, (list, tuple)):
        return type(value).__name__ + "[" + ",".join(_render(v, budget) for v in value) + "]"
    if isinstance(value, (set, frozenset)):
        return "set{" + ",".join(sorted(_render(v, budget) for v in value)) + "}"
    module = type(value).__module__
    if module.startswith("torch"):
        return _render_torch(value, budget)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict) and not isinstance(value, type):  # configs, quantization configs
        try:
            data = to_dict()
        except Exception as err:  # noqa: BLE001 - the user's object: any failure is "no rendering"
            raise Unrenderable(f"{type(value).__name__}.to_dict() raised {err!r}") from err
        return f"{module}.{type(value).__qualname__}" + _render(data, budget)
    if isinstance(value, type):
        return f"class:{value.__module__}.{value.__qualname__}"
    if dataclasses.is_dataclass(value):  # by its fields: datasets' feature types are callable
        fields = {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
        return f"{module}.{type(value).__qualname__}" + _render(fields, budget)
    if callable(value) or inspect.ismodule(value):
        raise Unrenderable(f"a {type(value).__name__} argument")
    try:
        text = repr(value)
    except Exception as err:  # noqa: BLE001 - repr of a user object may raise anything
        raise Unrenderable(f"repr() of a {type(value).__name__} raised {err!r}") from err
    if _ADDRESS.search(text) or len(text) > _MAX_CHARS:
        raise Unrenderable(f"a {type(value).__name__} without a stable repr")
    return f"{module}.{type(value).__qualname__}:{text}"


def _render_torch(value: Any, budget: _Budget) -> str:
    import torch

    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, torch.Tensor):  # by structure: hashing values costs as much as a load
        return f"tensor({value.dtype},{tuple(value.shape)},{value.device.type})"
    if isinstance(value, torch.nn.Module):  # not state_dict(): it runs hooks (FSDP gathers)
        parts = [f"module:{type(value).__module__}.{type(value).__qualname__}"]
        config = getattr(value, "config", None)
        if config is not None:
            parts.append(_render(config, budget))
        for name, tensor in [*value.named_parameters(remove_duplicate=False),
                             *value.named_buffers(remove_duplicate=False)]:
            budget.spend()
            parts.append(f"{name}:{tensor.dtype}{tuple(tensor.shape)}")
        return "|".join(parts)
    raise Unrenderable(f"a {type(value).__name__} argument")


@functools.lru_cache(maxsize=256)
def _signature(wrapped: Callable[..., Any]) -> inspect.Signature:
    """``inspect.signature(wrapped)``, once per function (a wrapped one's costs about 0.1 ms,
    paid by every call of a warm loop otherwise)."""
    return inspect.signature(wrapped)


def deciding_arguments(wrapped: Callable[..., Any], args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> dict[str, str]:
    """The arguments that decide a call's result, by parameter name, rendered as stable strings.

    Args:
        wrapped: the original function (its signature names the positional arguments).
        args, kwargs: the caller's arguments.

    Returns:
        ``{name: rendering}`` without the arguments that never change the result, plus
        ``__source__: "path:<real path>"`` when the source is a local path and
        ``__path__<name>: "path:<real path>"`` for every other argument naming one, and
        ``__dir__<name>: "dir:<real path>"`` for each folder of :data:`DOWNLOAD_DIRS` given.

    Raises:
        Unrenderable: an argument has no stable, bounded rendering (the message says which).
    """
    try:
        signature = _signature(wrapped)
        named = dict(signature.bind_partial(*args, **kwargs).arguments)
        for name, param in signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD and name in named:
                named.update(named.pop(name))
    except (TypeError, ValueError):  # no signature, or arguments that do not bind
        named = {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
    sources = {*facts().source_names, _UNBOUND_SOURCE}
    rendered = {}
    # The source: the first positional argument (transformers 5's Auto classes take
    # ``*model_args``) or a source parameter given by name.
    candidates = [args[0]] if args else []
    candidates += [value for name, value in named.items() if name in sources]
    for value in candidates:
        if (source := _local_path(value)) is not None:
            rendered["__source__"] = source
            break
    for name, value in named.items():
        if name in _VOLATILE:
            continue
        if name not in sources and name not in _OUTPUTS and (path := _local_path(value)):
            rendered[f"__path__{name}"] = path  # the same string names another file elsewhere
        if name in DOWNLOAD_DIRS and (folder := _folder(value)):
            rendered[f"__dir__{name}"] = folder
        if name in _SECRETS:
            token = value if isinstance(value, (str, bool, type(None))) else repr(type(value))
            rendered[name] = _secret_digest(token)
            continue
        budget = _Budget()
        try:
            text = _render(value, budget)
        except Unrenderable as err:
            raise Unrenderable(f"argument {name!r}: {err}") from None
        except RecursionError:
            raise Unrenderable(f"argument {name!r}: nested too deeply") from None
        except Exception as err:  # noqa: BLE001 - a user object's attribute access may raise
            raise Unrenderable(f"argument {name!r}: rendering raised {err!r}") from None
        if len(text) > _MAX_CHARS:
            raise Unrenderable(f"argument {name!r}: more than {_MAX_CHARS} characters")
        rendered[name] = text
    return rendered


def _secret_digest(token: Any) -> str:
    """A credential's identity in a key: a digest, never the token itself."""
    return hashlib.sha256(repr(token).encode()).hexdigest()[:16]


def credentials_digest() -> str:
    """The digest (never the token) of the credentials huggingface_hub sends by default:
    ``HF_TOKEN`` (or ``HUGGING_FACE_HUB_TOKEN``), else the token file. Not part of a call's key:
    ranks with other credentials share a call where any credentials could fetch what it got
    (:mod:`.credentials`). Never raises (an unreadable token file counts as no token)."""
    from huggingface_hub import constants

    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if token is None:
        try:
            with open(constants.HF_TOKEN_PATH, encoding="utf-8") as f:
                token = f.read().strip() or None
        except (OSError, ValueError):
            token = None
    return _secret_digest(token)


def process_state(*, loads_model: bool) -> dict[str, str]:
    """What decides a call's result besides its arguments and may differ from rank to rank, as
    key parts: the hub endpoint (``HF_ENDPOINT``, a mirror on some ranks), offline mode
    (``HF_HUB_OFFLINE``), and for a model load whether it runs inside
    ``torch.inference_mode()`` (tensors made on the calling thread are inference tensors then)
    and torch's default dtype and device (transformers 4 builds a model without ``torch_dtype``
    in the default dtype).

    Ranks that differ in one of them never share a call: each gets what its own plain call gets.
    The default credentials are not among them (:func:`credentials_digest`). Never raises.
    """
    from huggingface_hub import constants

    state = {"__endpoint__": constants.ENDPOINT,
             "__offline__": str(bool(constants.HF_HUB_OFFLINE))}
    if loads_model:
        import torch

        state["__inference_mode__"] = str(torch.is_inference_mode_enabled())
        state["__default_dtype__"] = str(torch.get_default_dtype())
        state["__default_device__"] = str(torch.get_default_device())
    return state


def digest(name: str, deciding: dict[str, str], *extra: str) -> str:
    """A short hex digest of a call's function name, deciding arguments and ``extra`` parts."""
    return hashlib.sha1(repr((name, sorted(deciding.items()), extra)).encode()).hexdigest()[:20]
