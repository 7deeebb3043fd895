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
from graphcap.bench.models import DTYPES, PRESETS, default_dtype_name, parse_bandwidth
from graphcap.bench.modes import MODES, default_modes, parse_modes


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers, e.g. ``1,8,32``."""
    if min(int(v) if v.strip().isdigit() else 0 for v in text.split(",")) < 1:
        raise ValueError(f"expected comma-separated positive integers such as 1,8,32, got {text!r}")
    return [int(v) for v in text.split(",")]


def option(help: str, default: Any = None, **metadata: Any) -> Any:
    """A dataclass field that is also a ``--field-name`` option (see the module docstring)."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class BenchConfig:
    """What to measure. The RL loop runs after the mode sweep, outside ``budget_s``. ``round``
    in a field's metadata: its (CPU, device) defaults in the rl-round workload."""

    workload: str = option(
        "step: fixed-length greedy steps at each batch size; rl-round: a GRPO-shaped round of "
        "sampled rows that end at EOS ids (docs/benchmarks.md)",
        "step",
        choices=("step", "rl-round"),
    )
    model: str | None = option(
        f"a preset ({', '.join(PRESETS)}; random weights) or a local model directory",
        cpu="tiny-llama",
        device="llama-1b",
    )
    dtype: str | None = option(
        "weights dtype (default: fp32 on CPU, fp16 for gpt2 presets, bf16 otherwise)",
        choices=sorted(DTYPES),
    )
    batch_sizes: list[int] | None = option(
        "e.g. 1,8,32,64", type=int_list, cpu=[1, 4], device=[1], ge=1
    )
    compile_batch_sizes: list[int] | None = option(
        "run the compiling modes only at these batch sizes (default: all)", type=int_list
    )
    prompt_len: int | None = option("prompt tokens per row", type=int, cpu=16, device=128, ge=1)
    new_tokens: int | None = option(
        "generated tokens per row (a round's cap)",
        type=int,
        cpu=16,
        device=128,
        ge=2,
        round=(16, 1024),
    )
    repeats: int | None = option(
        "steady-state calls (rounds)", type=int, cpu=3, device=5, ge=1, round=(2, 3)
    )
    warmup: int | None = option(
        "discarded calls after the first", type=int, cpu=1, device=2, ge=0, round=(0, 0)
    )
    hf_repeats: int | None = option(
        "steady calls of the hf modes (default: --repeats; 0: their first call is the steady one, "
        "and no warm-up)",
        type=int,
        ge=0,
    )
    prompts: int | None = option("a round's prompts", type=int, cpu=4, device=32, ge=1)
    samples: int | None = option("a round's samples per prompt", type=int, cpu=4, device=8, ge=1)
    prompt_widths: list[int] | None = option(
        "least,most prompt tokens of a round's prompts (left-padded)",
        type=int_list,
        cpu=[4, 12],
        device=[64, 256],
        ge=1,
    )
    eos_fraction: float = option(
        "a round's mean response length before the cap, as a share of --new-tokens: sets the "
        "number of EOS ids (vocab / (share x new tokens))",
        0.4,
        type=float,
    )
    temperature: float = option("a round's sampling temperature", 1.0, type=float)
    top_k: int = option("a round's top-k (0: off)", 0, type=int, ge=0)
    top_p: float = option("a round's top-p (1: off)", 1.0, type=float)
    draws: str | None = option(
        "RolloutConfig.draws of the graphcap modes, where this graphcap has that field"
    )
    modes: list[str] | None = option(
        f"comma-separated subset of {', '.join(MODES)} (default: those that run here)",
        type=parse_modes,
    )
    continuous_slots: int | None = option(
        "slots of graphcap-continuous (default: one per row)", type=int, ge=1
    )
    # One thread on the CPU: more do not speed up a tiny model and add noise on a busy machine.
    threads: int | None = option("intra-op threads (0: torch's)", type=int, cpu=1, device=0, ge=0)
    seed: int = option("weights and prompts seed", 0, type=int)
    peak_bandwidth: float | None = option(
        "memory bandwidth for the roofline, e.g. 4.8TB/s (default: known devices)",
        type=parse_bandwidth,
    )
    peak_flops: float | None = option(
        "products' FLOP/s for a round's limit, e.g. 790TFLOP/s (default: known devices)",
        type=parse_bandwidth,
    )
    budget_s: float | None = option(
        "time limit for the mode sweep; pairs not started in time are reported skipped", type=float
    )
    isolate: bool = option(
        "run each mode and batch size in a fresh Python process, so that none inherits another's "
        "compiled code, allocator state or caches (costs one process start and model build per "
        "pair; the backend is found again by name)",
        False,
        action="store_true",
    )
    backend: str | None = option("graphcap backend name (default: $GRAPHCAP_BACKEND)")
    graph_attention: str = option("graph steps' attention: auto (backend's), model, a name", "auto")
    fuse_projections: bool | None = option(
        "graphcap modes join q/k/v and gate/up products (RolloutConfig.fuse_projections; "
        "default: where the backend declares it pays)",
        action=argparse.BooleanOptionalAction,
    )
    compile_cache: str = option(
        "where compiled captures keep compiled code between processes (RolloutConfig."
        "compile_cache): auto ($GRAPHCAP_COMPILE_CACHE or ~/.cache/graphcap/compile), a "
        "directory, or none",
        "auto",
    )
    rl_loop: int = option("also run N generate -> train iterations", 0, type=int, metavar="N", ge=0)
    rl_batch_size: int | None = option("RL loop batch size (default: the first)", type=int, ge=1)
    rl_optimizer: str = option("RL loop optimizer", "sgd", choices=("sgd", "adamw"))
    rl_lr: float = option("RL loop learning rate", 1e-3, type=float)


def add_fields(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--field-name`` option per field of the dataclass ``cls``."""
    for f in fields(cls):
        m = f.metadata
        kwargs = {k: v for k, v in m.items() if k not in ("cpu", "device", "ge", "round")}
        if "cpu" in m:
            kwargs["help"] += f" (default: {m['cpu']} on CPU, {m['device']} on a device)"
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
    if rounds:
        if c.isolate or c.rl_loop:
            raise ValueError("--isolate and --rl-loop measure the step workload, not rl-round")
        c.batch_sizes, c.compile_batch_sizes = [c.prompts * c.samples], None
        c.continuous_slots = c.continuous_slots or max(1, c.batch_sizes[0] // 2)
        if len(c.prompt_widths) != 2 or c.prompt_widths[0] > c.prompt_widths[1]:
            raise ValueError(f"--prompt-widths takes least,most, got {c.prompt_widths}")
        if not 0 < c.eos_fraction <= 1 or not 0 < c.top_p <= 1 or c.temperature <= 0:
            raise ValueError("rounds sample: --eos-fraction and --top-p in (0, 1], temperature > 0")
    c.rl_batch_size = c.batch_sizes[0] if c.rl_batch_size is None else c.rl_batch_size
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
