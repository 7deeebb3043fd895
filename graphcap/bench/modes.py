"""The generation modes a benchmark compares, each opened for one batch, called repeatedly and
closed (so the next mode starts from the same memory), and how a call is timed."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import PreTrainedModel, StoppingCriteria

from graphcap.backend import Backend
from graphcap.rollout import RolloutConfig, RolloutEngine, RolloutStats, SamplingParams, drop_in
from graphcap.rollout.plan import DecodePath


def timed_call(call: Callable[[], Any], sync: Callable[[], None]) -> tuple[float, Any]:
    """Seconds ``call`` took between two device synchronisations, and what it returned."""
    sync()
    start, value = time.perf_counter(), call()
    sync()
    return time.perf_counter() - start, value


def spread(values: Iterable[float | None]) -> tuple[float | None, float | None, float | None]:
    """(median, min, max) of the known values (Nones when none is known)."""
    known = [v for v in values if v is not None]
    return (statistics.median(known), min(known), max(known)) if known else (None, None, None)


def compile_counts() -> tuple[int, int, float]:
    """(graphs compiled, recompilations included; graph breaks; seconds dynamo spent compiling,
    inductor's part included, by its own clock) so far in this process: the seconds separate
    compiling from a warm-up's first kernel uses."""
    # private: dynamo's counters and phase times are torch's only record of what it compiled
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))
    return (
        int(counters["stats"]["unique_graphs"]),
        int(sum(counters["graph_break"].values())),
        seconds,
    )


@dataclass
class Workload:
    """What every mode generates from; ``continuous_slots`` None means one slot per row.
    ``settings``: RolloutConfig keywords of the graphcap modes; ``sampling``: generate()'s and
    SamplingParams' keywords (none: greedy, EOS off), each mode's draws seeded by ``seed``;
    ``costs``: a round's limit costs (models.round_costs)."""

    model: PreTrainedModel
    backend: Backend
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    new_tokens: int
    continuous_slots: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    costs: tuple | None = None

    def __post_init__(self) -> None:
        prompts, self.prompt_width = self.input_ids.shape
        self.batch_size = prompts * self.sampling.get("num_return_sequences", 1)
        self.lengths = {"max_new_tokens": self.new_tokens, "min_new_tokens": 0, "pad_token_id": 0}
        greedy = {"attention_mask": self.attention_mask, "do_sample": False, **self.lengths}
        self.generate_kwargs = {**greedy, **self.sampling}  # a ``generate`` call's keywords


def engine_settings(
    attention: str, fuse: bool | None, cache: str, draws: str | None, exact: bool = False
) -> dict:
    """RolloutConfig keywords from the bench's options (``draws``: the engine's default when
    ``None``; ``exact``: trainer-exact calls, which run their own attention)."""
    settings = {"graph_attention": None if attention == "model" else attention}
    settings.update(fuse_projections=fuse, compile_cache=None if cache == "none" else cache)
    if exact:
        settings.update(trainer_exact=True, graph_attention="auto")
    return settings if draws is None else {**settings, "draws": draws}


@dataclass
class CallOutput:
    """One call: response tokens (host), prefill and decode step times, the engine's stats (None
    for transformers' generate), and the call's wall time (set by the runner)."""

    tokens: torch.Tensor
    prefill_s: float | None
    decode_step_s: float | None
    stats: RolloutStats | None = None
    seconds: float | None = None

    @classmethod
    def of(cls, tokens: torch.Tensor, s: RolloutStats) -> CallOutput:  # an engine call's
        return cls(tokens.cpu(), s.prefill_s, s.decode_s / s.steps if s.steps else None, s)


class StepClock(StoppingCriteria):
    """A ``generate()`` stopping criterion that timestamps every token and never stops (generate
    syncs on every token anyway); the first interval is the prefill, the later ones decode steps."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync, self.stamps, self.false = sync, [0.0], torch.zeros(0, dtype=torch.bool)

    def __call__(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.sync()
        self.stamps.append(time.perf_counter())
        if self.false.shape[0] != input_ids.shape[0]:  # reused: no allocation per token
            self.false = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return self.false

    def generate(self, work: Workload, **kwargs: Any) -> CallOutput:
        self.stamps, kwargs = [time.perf_counter()], {**work.generate_kwargs, **kwargs}
        with torch.no_grad():
            out = work.model.generate(work.input_ids, **kwargs, stopping_criteria=[self])
        gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]
        return CallOutput(out[:, work.prompt_width :].cpu(), gaps[0], spread(gaps[1:])[0])


@dataclass(frozen=True)
class Mode:
    """transformers' ``generate`` with ``hf_kwargs``, or graphcap's engine on ``expected_path``
    (None: graphs off; another path is a fallback) with ``RolloutConfig(compile=compile)``,
    called directly or (``drop_in``) through ``model.generate`` after ``accelerate_generate``."""

    name: str
    expected_path: DecodePath | None = None
    hf_kwargs: dict[str, Any] | None = None
    compile: bool | None = None
    drop_in: bool = False

    def config(self, **settings: Any) -> RolloutConfig:
        """The engine's configuration in this mode (the drop-in's default one), and ``settings``."""
        path, settings["compile"] = self.expected_path, self.compile if self.expected_path else None
        if self.drop_in:
            return replace(drop_in.drop_in_default_config(), **settings)
        positions = path is DecodePath.PER_POSITION_GRAPH
        return RolloutConfig(
            enable_graph_capture=bool(path), per_position_graphs=positions, **settings
        )

    def compiles(self, backend: Backend) -> bool:
        """Whether this mode's first call compiles on ``backend``: transformers' static cache
        (where it can), graphcap's graphs where ``compile`` or the backend says so."""
        if self.hf_kwargs is not None:
            return self.hf_kwargs.get("cache_implementation") == "static"
        config = replace(self, drop_in=False).config()
        return config.enable_graph_capture and config.wants_compile(backend)

    def unsupported(self, backend: Backend) -> str | None:
        """Why this mode cannot run on ``backend`` (``None`` when it can)."""
        if self.expected_path and not backend.capabilities.graph_capture:
            return f"backend {backend.name!r} cannot capture graphs"
        if self.expected_path and self.compile and backend.device.type == "cpu":
            return "the CPU reference backend refuses compiled (inductor) regions at capture"
        return None

    @contextmanager
    def session(
        self, work: Workload
    ) -> Iterator[tuple[Callable[[], CallOutput], RolloutEngine | None]]:
        """The mode opened on ``work``: yields the call to time and the engine serving it
        (``None`` for transformers' generate), releases everything after."""
        compiles, path, close, engine = self.compiles(work.backend), self.expected_path, None, None
        if compiles:  # a cold start in this process: earlier compilations must not help it
            torch.compiler.reset()
        if work.sampling:  # every mode's first call draws from the same generator state
            torch.manual_seed(work.seed)
            work.backend.manual_seed(work.seed)
        settings, rows = {"backend": work.backend, **work.settings}, work.batch_size
        if path is DecodePath.CONTINUOUS_GRAPH:  # one slot per row unless given fewer
            settings["continuous_batch_size"] = min(work.continuous_slots or rows, rows)
        try:
            if self.hf_kwargs is not None:
                clock = StepClock(work.backend.synchronize)
                call = functools.partial(clock.generate, work, **self.hf_kwargs)
            elif self.drop_in:
                config = self.config(**settings)
                installed = drop_in.accelerate_generate(work.model, config)
                call, close = functools.partial(_drop_in_call, work, installed), installed.restore
                engine = installed.engine
            else:
                engine = RolloutEngine(work.model, self.config(**settings))
                call, close = functools.partial(_engine_call, work, engine, path), engine.shutdown
            yield call, engine
        finally:
            if close is not None:
                close()  # the drop-in's restore shuts its engine down
            if compiles:
                torch.compiler.reset()


def _engine_call(work: Workload, engine: RolloutEngine, path: DecodePath | None) -> CallOutput:
    # EOS is off in steps: pinning min_new_tokens (per-position graphs need it) changes no token.
    pin = work.new_tokens if path is DecodePath.PER_POSITION_GRAPH else 0
    sampling = SamplingParams(**{**work.lengths, "min_new_tokens": pin}, **work.sampling)
    out = engine.generate(work.input_ids, work.attention_mask, sampling=sampling)
    return CallOutput.of(out.sequences[:, work.prompt_width :], out.stats)


def _drop_in_call(work: Workload, installed: drop_in.AcceleratedGenerate) -> CallOutput:
    """``model.generate`` served by the drop-in; a call it handed to ``generate`` is an error."""
    served = installed.stats.served
    with torch.no_grad():
        out = work.model.generate(work.input_ids, **work.generate_kwargs)
    if installed.stats.served == served:
        reasons = ", ".join(installed.stats.fallbacks)
        raise RuntimeError(f"the drop-in handed the call to generate(): {reasons}")
    return CallOutput.of(out[:, work.prompt_width :], installed.stats.last)


# transformers decides whether hf-static-compile compiles; the runner counts compiled graphs.
# graphcap-graph is the default configuration (RolloutConfig(enable_graph_capture=True)).
MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("hf-eager", hf_kwargs={"disable_compile": True}),
        Mode("hf-static-compile", hf_kwargs={"cache_implementation": "static"}),
        Mode("graphcap-eager"),
        Mode("graphcap-graph", DecodePath.STATIC_GRAPH),
        Mode("graphcap-graph-uncompiled", DecodePath.STATIC_GRAPH, compile=False),
        Mode("graphcap-continuous", DecodePath.CONTINUOUS_GRAPH),
        Mode("graphcap-per-position", DecodePath.PER_POSITION_GRAPH),
        Mode("graphcap-drop-in", DecodePath.STATIC_GRAPH, drop_in=True),
    )
}
#: The rl-round workload's modes: transformers' generate, the drop-in, the engine's two paths.
ROUND_MODES = ["hf-eager", "graphcap-drop-in", "graphcap-graph", "graphcap-continuous"]


def default_modes(backend: Backend, workload: str = "step") -> list[str]:
    """The modes that mean something here: HF's compile on accelerators, the uncompiled graph where
    the default one compiles; the drop-in in rounds (in steps it is graphcap-graph)."""
    if workload == "rl-round":
        return ROUND_MODES
    skip = {"graphcap-drop-in"} | ({"hf-static-compile"} if backend.device.type == "cpu" else set())
    skip |= set() if MODES["graphcap-graph"].compiles(backend) else {"graphcap-graph-uncompiled"}
    return [name for name in MODES if name not in skip]


def parse_modes(text: str) -> list[str]:
    """Comma-separated mode names, validated, order kept."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODES]
    if unknown or not names:
        raise ValueError(f"unknown mode(s) {unknown or text!r}; choose from {', '.join(MODES)}")
    return list(dict.fromkeys(names))
