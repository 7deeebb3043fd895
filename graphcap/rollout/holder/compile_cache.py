"""Compiled code kept across processes, so a new process with the same model starts in seconds.

A compiled capture's first warm-up traces the model's blocks and generates their kernels; the
generation is most of the cost. PyTorch's portable cache (``torch.compiler.save_cache_artifacts``
/ ``load_cache_artifacts``: inductor's FX graphs, AOT-autograd entries, generated kernels and
their autotuning) is written after a compiled capture to one file per model shape and step
shape (its sampler shape included) and loaded before the next process compiles the same shape,
which then finds every kernel in inductor's cache instead of generating it. Every entry in it
is keyed by PyTorch on what it was built from, so an entry that does not fit is never used: at
worst a file is useless, never wrong.
Our own header adds a checksum and the versions the file was written with; a file that fails
either is reported with a :class:`~graphcap.errors.CompileCacheWarning` and the process compiles
as if it were absent (then replaces it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from graphcap.errors import CompileCacheWarning

#: Environment variable naming the directory of ``RolloutConfig(compile_cache="auto")``.
ENV = "GRAPHCAP_COMPILE_CACHE"
MAGIC = b"graphcap-compile-cache 1\n"
#: Config entries that name a checkpoint rather than shape the computation.
UNSHAPED = ("_name_or_path", "transformers_version", "architectures")


def default_directory() -> Path:
    """``$GRAPHCAP_COMPILE_CACHE``, else ``$XDG_CACHE_HOME/graphcap/compile`` (``~/.cache``)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "graphcap" / "compile"


def resolve_directory(setting: str | os.PathLike[str] | None) -> Path | None:
    """The directory of a ``RolloutConfig.compile_cache`` setting (``None``: no file cache)."""
    if setting is None:
        return None
    return default_directory() if setting == "auto" else Path(setting).expanduser()


def versions() -> dict[str, str]:
    """What generated code depends on besides the model: written into each file's header."""
    found = {"torch": torch.__version__}
    for name in ("graphcap", "triton"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def shape_key(model: torch.nn.Module, description: dict[str, Any]) -> str:
    """A file name for compiled code of ``model``'s shape and the step ``description`` (batch,
    length, dtype, backend, device, compile options); weights and checkpoint names are not in
    it, so every checkpoint of one architecture shares a file."""
    config = getattr(model, "config", None)
    shaped = {} if config is None else config.to_dict()
    for name in UNSHAPED:
        shaped.pop(name, None)
    text = json.dumps(
        {"model": type(model).__qualname__, "config": shaped, **description, **versions()},
        sort_keys=True,
        default=_describe,
    )
    return f"{type(model).__name__}-{hashlib.sha256(text.encode()).hexdigest()[:24]}"


def _describe(value: Any) -> str:
    """A stable description of a value JSON cannot write (a dtype, a graph pass object)."""
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    return type(value).__qualname__


@dataclass
class CacheUse:
    """What one compiled capture did with the cache: ``state`` is ``"loaded"`` (the file was
    read before compiling), ``"new"`` (no file yet), ``"unreadable"`` (a corrupt or foreign file,
    warned about and replaced) or ``"off"``; ``path`` the file."""

    state: str
    path: Path | None = None


class CompileCache:
    """One directory of compiled-code files, one file per :func:`shape_key`."""

    def __init__(self, directory: str | os.PathLike[str] | None) -> None:
        self.directory = None if directory is None else Path(directory)

    @contextlib.contextmanager
    def session(self, key: str) -> Iterator[CacheUse]:
        """Within the block, compile with ``key``'s file loaded; after it (also when the block
        raised: what compiled is valid either way), write what this process's compilations used
        when that differs from what the file held."""
        if self.directory is None:
            yield CacheUse("off")
            return
        path = self.directory / f"{key}.bin"
        with _artefacts_of_this_session():
            loaded = _load(path)
            try:
                state = "loaded" if loaded else "new" if loaded is None else "unreadable"
                yield CacheUse(state, path)
            finally:
                saved = torch.compiler.save_cache_artifacts()
                if saved is not None and _entries(saved[1]) != _entries(loaded or None):
                    _write(path, saved[0])


def _artefacts_of_this_session() -> contextlib.AbstractContextManager[None]:
    """Within the block, PyTorch records (and ``save_cache_artifacts`` returns) only the
    artefacts compiled or loaded in it, not everything the process compiled before: each file
    then holds its own shape, instead of every shape compiled so far (files growing with each
    shape, each load loading them all). PyTorch offers this only on its private artefact
    manager (``torch.compiler._cache``, 2.11 and 2.13 alike); the manager's earlier records
    are put back after the block."""
    from torch.compiler._cache import CacheArtifactManager

    return CacheArtifactManager.with_fresh_cache()


def _entries(info: Any) -> dict[str, set[str]]:
    """The artefact keys a ``CacheInfo`` lists, by kind (empty for ``None``)."""
    if info is None:
        return {}
    return {kind: set(keys) for kind, keys in info.artifacts.items() if keys}


def _load(path: Path) -> Any:
    """Load ``path`` into PyTorch's caches: its ``CacheInfo`` (truthy), ``None`` when there is
    no file, ``False`` when it is unreadable (warned)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return _unreadable(path, f"it cannot be read ({exc})")
    if not data.startswith(MAGIC):
        return _unreadable(path, "it is not a graphcap compile-cache file")
    header, _, payload = data[len(MAGIC) :].partition(b"\n")
    try:
        meta = json.loads(header)
    except ValueError:
        return _unreadable(path, "its header is corrupt")
    if not isinstance(meta, dict):
        return _unreadable(path, f"its header is corrupt (a JSON {type(meta).__name__})")
    if meta.get("versions") != versions():
        return _unreadable(path, f"it was written by {meta.get('versions')}, not {versions()}")
    if meta.get("sha256") != hashlib.sha256(payload).hexdigest():
        return _unreadable(path, "its contents do not match their checksum (truncated or damaged)")
    info = torch.compiler.load_cache_artifacts(payload)
    if info is None:
        return _unreadable(path, "PyTorch could not read its artefacts")
    return info


def _unreadable(path: Path, why: str) -> bool:
    warnings.warn(
        f"graphcap compile cache {path}: {why}; compiling instead (the file is replaced after "
        "this compilation)",
        CompileCacheWarning,
        stacklevel=5,
    )
    return False


def _write(path: Path, payload: bytes) -> None:
    """Write atomically (a reader never sees half a file), with the permissions the umask
    gives a new file (a directory shared between users stays shared); a failure only warns."""
    header = json.dumps({"versions": versions(), "sha256": hashlib.sha256(payload).hexdigest()})
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
        with os.fdopen(os.open(temporary, flags, 0o666), "wb") as out:
            out.write(MAGIC + header.encode() + b"\n" + payload)
        os.replace(temporary, path)
    except OSError as exc:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        warnings.warn(
            f"graphcap compile cache {path}: could not write it ({exc}); the next process "
            "compiles again",
            CompileCacheWarning,
            stacklevel=5,
        )
