"""The compile cache: compiled code written after a compiled capture and loaded by the next
process; a corrupt or foreign file is warned about, compiled around and replaced, never used.

Real inductor compilations on the CPU (C++ kernels, so a few seconds each): the file format,
the cross-process load and the engine's use of it are what is tested, not a stand-in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from rollout_models import prompts, run, tiny_model

from graphcap.cpu import CPUBackend
from graphcap.errors import CaptureFallbackWarning, CompileCacheWarning
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.rollout.holder import compile_cache as cc

NEW = 5
NO_EOS = {"eos_token_id": []}


def silu_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x @ w) * 2 + 1


INPUTS = (torch.arange(32.0).view(4, 8) / 32, torch.eye(8) * 0.5)


def compiled_in(cache: cc.CompileCache, key: str = "k") -> tuple[str, torch.Tensor]:
    """Compile ``silu_product`` afresh (dynamo forgets earlier compilations) inside a session."""
    torch.compiler.reset()
    with cache.session(key) as use:
        out = torch.compile(silu_product)(*INPUTS)
    return use.state, out


@pytest.fixture
def fresh_inductor(tmp_path, monkeypatch):
    """Inductor's own on-disk cache in an empty directory, so only our file can supply hits."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))


def test_a_compile_writes_the_file_and_the_next_session_loads_it(tmp_path, fresh_inductor):
    cache = cc.CompileCache(tmp_path / "graphcap")
    state, out = compiled_in(cache)
    assert state == "new" and torch.allclose(out, silu_product(*INPUTS))
    path = tmp_path / "graphcap" / "k.bin"
    written = path.read_bytes()
    assert written.startswith(cc.MAGIC)
    state, out = compiled_in(cache)
    assert state == "loaded" and torch.allclose(out, silu_product(*INPUTS))
    assert path.read_bytes() == written  # nothing new to write


HEADERS = {"list-header": b"[]", "null-header": b"null", "number-header": b"1"}


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    head, _, payload = data[len(cc.MAGIC) :].partition(b"\n")
    if how == "garbage":
        path.write_bytes(b"\x00not a cache\xff" * 50)
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flipped":
        path.write_bytes(data[:-10] + bytes(b ^ 0xFF for b in data[-10:]))
    elif how in HEADERS:  # valid JSON, not an object
        path.write_bytes(cc.MAGIC + HEADERS[how] + b"\n" + payload)
    elif how == "foreign":
        meta = json.loads(head)
        meta["versions"]["torch"] = "0.0.1"
        path.write_bytes(cc.MAGIC + json.dumps(meta).encode() + b"\n" + payload)


@pytest.mark.parametrize("how", ["garbage", "truncated", "flipped", "foreign", *HEADERS])
def test_a_damaged_or_foreign_file_warns_compiles_and_is_replaced(tmp_path, fresh_inductor, how):
    cache = cc.CompileCache(tmp_path)
    compiled_in(cache)
    damage(tmp_path / "k.bin", how)
    with pytest.warns(CompileCacheWarning, match="compiling instead"):
        state, out = compiled_in(cache)
    assert state == "unreadable" and torch.allclose(out, silu_product(*INPUTS))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileCacheWarning)
        assert compiled_in(cache)[0] == "loaded"  # the file was rewritten whole


def payload(path: Path) -> bytes:
    """A file's artefacts as PyTorch serialised them (after our header)."""
    return path.read_bytes()[len(cc.MAGIC) :].partition(b"\n")[2]


def cube(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) ** 3 - 1


def test_each_file_holds_only_its_own_compilations_and_is_shared_by_the_umask(
    tmp_path, fresh_inductor
):
    """A file written after another compilation in the same process holds only its own
    artefacts (not everything compiled so far: files grew with every shape, and loading the
    Nth loaded N shapes); files get the umask's permissions (not 0600), so a directory shared
    between users is shared."""
    cache = cc.CompileCache(tmp_path)
    compiled_in(cache, "first")
    torch.compiler.reset()
    with cache.session("second"):
        torch.compile(cube)(*INPUTS)
    first, second = payload(tmp_path / "first.bin"), payload(tmp_path / "second.bin")
    # PyTorch's serialiser appends: a file holding the process's earlier compilations starts
    # with the earlier file's artefacts (and is about twice its size for a like kernel)
    assert first and second and first not in second
    assert len(second) < 1.5 * len(first)
    umask = os.umask(0)
    os.umask(umask)
    for name in ("first.bin", "second.bin"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def test_an_unwritable_directory_only_warns(tmp_path, fresh_inductor):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the directory should be")
    with pytest.warns(CompileCacheWarning) as seen:
        state, out = compiled_in(cc.CompileCache(blocker / "cache"))
    assert "could not write" in str(seen[-1].message)
    assert state == "unreadable" and torch.allclose(out, silu_product(*INPUTS))


def test_another_process_compiles_from_the_file(tmp_path):
    """A second process with an empty inductor cache finds its kernel in our file (inductor's
    own counters, a private table, are the only record of a cache hit)."""
    script = textwrap.dedent(
        f"""
        import sys, torch
        from torch._dynamo.utils import counters  # private: dynamo counts its compiles only here
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_compile_cache import INPUTS, compiled_in, silu_product
        from graphcap.rollout.holder.compile_cache import CompileCache
        state, out = compiled_in(CompileCache(sys.argv[1]))
        assert torch.allclose(out, silu_product(*INPUTS))
        print(state, counters["inductor"]["fxgraph_cache_hit"])
        """
    )

    def child(inductor: str) -> str:
        env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / inductor)}
        done = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / "graphcap")],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.split()[-2:]

    assert child("inductor-a") == ["new", "0"]
    assert child("inductor-b") == ["loaded", "1"]


def test_the_key_follows_the_shape_not_the_weights():
    a, b = tiny_model("llama", fresh=True), tiny_model("llama", fresh=True)
    with torch.no_grad():
        b.model.norm.weight.add_(1.0)
    description = {"batch": 2, "dtype": torch.float32, "options": {"p": object()}}
    assert cc.shape_key(a, description) == cc.shape_key(b, description)
    assert cc.shape_key(a, description) != cc.shape_key(a, {**description, "batch": 3})
    assert cc.shape_key(a, description) != cc.shape_key(tiny_model("qwen2"), description)


def test_the_directory_setting(tmp_path, monkeypatch):
    monkeypatch.setenv(cc.ENV, str(tmp_path / "env"))
    assert cc.resolve_directory("auto") == tmp_path / "env"
    assert cc.resolve_directory(str(tmp_path / "x")) == tmp_path / "x"
    assert cc.resolve_directory(None) is None
    monkeypatch.delenv(cc.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cc.resolve_directory("auto") == tmp_path / "xdg" / "graphcap" / "compile"


class CompilingBackend(CPUBackend):
    """Claims that captures record compiled code and that compiling pays (as CUDA does). The
    CPU reference graph refuses compiled regions at capture, so each call finishes eagerly
    after its warm-up compiled: the compile cache is used exactly as on a device."""

    captures_compiled = True
    compile_by_default = True


def engine_call(model, directory: Path, **sampling) -> tuple[object, torch.Tensor]:
    torch.compiler.reset()
    config = RolloutConfig(
        enable_graph_capture=True, backend=CompilingBackend(), compile_cache=str(directory)
    )
    ids, mask = prompts(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureFallbackWarning)
        result = RolloutEngine(model, config).generate(
            ids, mask, SamplingParams(max_new_tokens=NEW, **NO_EOS, **sampling)
        )
    return result.stats, result.sequences


def test_each_sampler_shape_compiles_into_its_own_file(tmp_path, fresh_inductor):
    """A greedy step and a truncating one compile different code: each shape keeps its own
    file, so a process alternating them loads what it compiled (one shared file held only the
    last shape's code, and the other compiled afresh in every new process)."""
    model = tiny_model("llama", fresh=True)
    truncating = {"do_sample": True, "top_p": 0.9, "seed": 1}
    assert engine_call(model, tmp_path)[0].compile_cache == "new"
    assert engine_call(model, tmp_path, **truncating)[0].compile_cache == "new"
    assert len(list(tmp_path.glob("*.bin"))) == 2
    assert engine_call(model, tmp_path)[0].compile_cache == "loaded"
    assert engine_call(model, tmp_path, **truncating)[0].compile_cache == "loaded"


def test_the_engine_loads_writes_and_survives_a_corrupt_file(tmp_path, fresh_inductor):
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(2)
    expected = run(model, ids, mask, False, max_new_tokens=NEW, **NO_EOS).sequences
    stats, tokens = engine_call(model, tmp_path)
    assert stats.compile_cache == "new" and torch.equal(tokens, expected)
    assert stats.warmup_s > 0 and len(list(tmp_path.glob("*.bin"))) == 1
    stats, tokens = engine_call(model, tmp_path)
    assert stats.compile_cache == "loaded" and torch.equal(tokens, expected)
    (file,) = tmp_path.glob("*.bin")
    damage(file, "flipped")
    with pytest.warns(CompileCacheWarning):
        stats, tokens = engine_call(model, tmp_path)
    assert stats.compile_cache == "unreadable" and torch.equal(tokens, expected)
