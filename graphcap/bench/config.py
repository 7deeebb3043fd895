"""What a bench run measures: one dataclass whose fields' metadata (help, ``type``, defaults on
``cpu`` / ``device`` where ``None`` means the default, ``ge`` the least value) also builds
``graphcap bench``'s options."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from graphcap.backend import Backend
from graphcap.bench.iteration import BETWEEN
from graphcap.bench.models import parse_bandwidth
from graphcap.bench.modes import MODES, default_modes, parse_modes
from graphcap.preset_models import DTYPES, PRESETS, default_dtype_name


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers, e.g. ``1,8,32``."""
    if min(int(v) if v.strip().isdigit() else 0 for v in text.split(",")) < 1:
        raise ValueError(f"expected comma-separated positive integers such as 1,8,32, got {text!r}")
    return [int(v) for v in text.split(",")]


def option(help: str, default: Any = None, on: tuple | None = None, **metadata: Any) -> Any:
    """A dataclass field that is also a ``--field-name`` option; ``on``: its (CPU, device)
    defaults (see the module docstring)."""
    where = {} if on is None else {"cpu": on[0], "device": on[1]}
    return field(default=default, metadata={"help": help, **where, **metadata})


@dataclass
class BenchConfig:
    """What to measure (docs/benchmarks.md, "Options"). ``round`` in a field's metadata: its
    (CPU, device) defaults in the rl-round workload."""

    workload: str = option("step or rl-round", "step", choices=("step", "rl-round"))
    model: str | None = option(f"a preset ({', '.join(PRESETS)}) or a local model directory",
        on=("tiny-llama", "llama-1b"))  # fmt: skip
    dtype: str | None = option("weights dtype (default: fp32 on CPU, fp16 for gpt2, else bf16)",
        choices=sorted(DTYPES))  # fmt: skip
    batch_sizes: list[int] | None = option("e.g. 1,8,32", on=([1, 4], [1]), type=int_list, ge=1)
    compile_batch_sizes: list[int] | None = option("compiling modes' sizes", type=int_list)
    prompt_len: int | None = option("prompt tokens per row", on=(16, 128), type=int, ge=1)
    new_tokens: int | None = option("generated tokens per row (a round's most)", on=(16, 128),
        type=int, ge=2, round=(16, 1024))  # fmt: skip
    repeats: int | None = option("steady calls (rounds)", on=(3, 5), type=int, ge=1, round=(2, 3))
    warmup: int | None = option("dropped calls", on=(1, 2), type=int, ge=0, round=(0, 0))
    hf_repeats: int | None = option("hf modes' steady calls (0: the first)", type=int, ge=0)
    prompts: int | None = option("a round's prompts", on=(4, 32), type=int, ge=1)
    samples: int | None = option("a round's samples per prompt", on=(4, 8), type=int, ge=1)
    prompt_widths: list[int] | None = option("least,most prompt tokens of a round",
        on=([4, 12], [64, 256]), type=int_list, ge=1)  # fmt: skip
    eos_fraction: float = option("a round's mean length / --new-tokens", 0.4, type=float)
    temperature: float = option("a round's temperature", 1.0, type=float)
    top_k: int = option("a round's top-k (0: off)", 0, type=int, ge=0)
    top_p: float = option("a round's top-p (1: off)", 1.0, type=float)
    draws: str | None = option("RolloutConfig.draws, where graphcap has the field")
    between: str = option("rl-round: before each steady round, nothing, sleep-train (the "
        "engine sleeps, a training step runs) or move (weights in new storage)", "nothing",
        choices=BETWEEN)  # fmt: skip
    train_rows: int = option("rl-round: the training step's rows", 32, type=int, ge=1)
    modes: list[str] | None = option(f"some of {', '.join(MODES)}", type=parse_modes)
    continuous_slots: int | None = option("graphcap-continuous's slots", type=int, ge=1)
    # One thread on the CPU: more do not speed up a tiny model and add noise on a busy machine.
    threads: int | None = option("intra-op threads (0: torch's)", on=(1, 0), type=int, ge=0)
    seed: int = option("weights, prompts and draws seed", 0, type=int)
    peak_bandwidth: float | None = option("e.g. 4.8TB/s (default: known devices)",
        type=parse_bandwidth)  # fmt: skip
    peak_flops: float | None = option("e.g. 790TFLOP/s (default: known devices)",
        type=parse_bandwidth)  # fmt: skip
    budget_s: float | None = option("seconds for the mode sweep (then: skipped)", type=float)
    isolate: bool = option("a fresh process per mode and size", False, action="store_true")
    backend: str | None = option("graphcap backend name (default: $GRAPHCAP_BACKEND)")
    graph_attention: str = option("graph steps' attention: auto, model, a name", "auto")
    fuse_projections: bool | None = option("join q/k/v and gate/up (default: the backend's)",
        action=argparse.BooleanOptionalAction)  # fmt: skip
    compile_cache: str = option("auto, a directory, or none", "auto")
    trainer_exact: bool = option("graphcap modes run RolloutConfig(trainer_exact=True)", False,
        action="store_true")  # fmt: skip


def add_fields(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--field-name`` option per field of the dataclass ``cls``."""
    for f in fields(cls):
        m = f.metadata
        kwargs = {k: v for k, v in m.items() if k not in ("cpu", "device", "ge", "round")}
        if "cpu" in m:
            rounds = f"; rounds: {m['round'][0]}, {m['round'][1]}" if "round" in m else ""
            kwargs["help"] += f" (default: {m['cpu']} on CPU, {m['device']} on a device{rounds})"
        if "type" in kwargs:
            kwargs["type"] = functools.partial(_usage_error, kwargs["type"])
        parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, **kwargs)


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """The dataclass ``cls`` filled from the options :func:`add_fields` added."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def _usage_error(parse: Callable[[str], Any], text: str) -> Any:
    try:  # keeps parse's message in argparse's usage error
        return parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def resolve(config: BenchConfig, backend: Backend) -> BenchConfig:
    """Fill unset fields with this device's defaults, and validate."""
    where, rounds = backend.device.type != "cpu", config.workload == "rl-round"
    defaults = {
        f.name: f.metadata["round"][where] if rounds and "round" in f.metadata else f.metadata[k]
        for f in fields(config)
        if getattr(config, f.name) is None and (k := ("cpu", "device")[where]) in f.metadata
    }
    c = replace(config, **defaults)
    c.dtype = c.dtype or default_dtype_name(c.model, backend.device.type)
    c.modes = parse_modes(",".join(c.modes or default_modes(backend, c.workload)))
    if not rounds and c.between != "nothing":
        raise ValueError("--between is an rl-round option (--workload rl-round)")
    if rounds:
        if c.isolate:
            raise ValueError("--isolate measures the step workload, not rl-round")
        if c.between != "nothing" and c.repeats < 1:
            raise ValueError("--between acts before steady rounds: --repeats must be >= 1")
        c.batch_sizes, c.compile_batch_sizes = [c.prompts * c.samples], None
        c.continuous_slots = c.continuous_slots or max(1, c.batch_sizes[0] // 2)
        if len(c.prompt_widths) != 2 or c.prompt_widths[0] > c.prompt_widths[1]:
            raise ValueError(f"--prompt-widths takes least,most, got {c.prompt_widths}")
        if not 0 < c.eos_fraction <= 1 or not 0 < c.top_p <= 1 or c.temperature <= 0:
            raise ValueError("rounds sample: --eos-fraction and --top-p in (0, 1], temperature > 0")
    for f in fields(c):
        value, m, what = getattr(c, f.name), f.metadata, f.name.replace("_", " ")
        if "choices" in m and value not in m["choices"]:
            raise ValueError(f"unknown {what} {value!r}; choose one of {list(m['choices'])}")
        least = min(value) if isinstance(value, list) else value
        if "ge" in m and least is not None and least < m["ge"]:
            raise ValueError(f"{what} must be >= {m['ge']}, got {value}")
    if c.budget_s is not None and c.budget_s <= 0:
        raise ValueError(f"the time budget must be positive, got {c.budget_s}")
    return c
