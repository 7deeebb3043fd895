"""The generation modes a benchmark compares (one model, one prompt set) and how calls are timed.

A mode is opened for one batch (:meth:`Mode.session`), called repeatedly, and closed (engines
are dropped so the next mode starts from the same memory). A mode that cannot run here says why
up front (:meth:`Mode.unsupported`), and a graph mode that ran eagerly is reported as a fallback
by the runner, never as a graph result. Every timed call is bracketed by device synchronisation,
since device work is asynchronous.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from transformers import PreTrainedModel, StoppingCriteria

from graphcap.backend import Backend
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams

T = TypeVar("T")


def timed_call(call: Callable[[], T], sync: Callable[[], None]) -> tuple[float, T]:
    """Seconds ``call`` took between two device synchronisations, and what it returned."""
    sync()
    start = time.perf_counter()
    value = call()
    sync()
    return time.perf_counter() - start, value


def spread(values: Iterable[float | None]) -> tuple[float | None, float | None, float | None]:
    """(median, min, max) of the known values; Nones when there are none."""
    known = [v for v in values if v is not None]
    return (statistics.median(known), min(known), max(known)) if known else (None, None, None)


def compile_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process, from dynamo's counters: every
    compiled graph (recompilations too) counts, so a difference around a call says whether that
    call compiled anything."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


class StepClock(StoppingCriteria):
    """A ``generate()`` stopping criterion that timestamps every token and never stops.

    ``generate`` already reads a device flag on the host after every token on CUDA-like devices,
    so synchronising here adds no stall; the intervals between consecutive tokens are the decode
    step times, and the first token's time is the prefill.
    """

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync, self.stamps = sync, [0.0]
        self.false: torch.Tensor | None = None  # reused: no allocation per token

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        self.sync()
        self.stamps.append(time.perf_counter())
        if self.false is None or self.false.shape[0] != input_ids.shape[0]:
            self.false = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return self.false

    def generate(self, work: Workload, **kwargs: Any) -> CallOutput:
        """``work.model.generate`` greedy, timing each token."""
        self.stamps = [time.perf_counter()]
        with torch.no_grad():
            out = work.model.generate(
                work.input_ids, attention_mask=work.attention_mask, max_new_tokens=work.new_tokens,
                min_new_tokens=0, do_sample=False, pad_token_id=0, stopping_criteria=[self],
                **kwargs,
            )  # fmt: skip
        gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]
        step = statistics.median(gaps[1:]) if len(gaps) > 1 else None
        return CallOutput(out[:, work.prompt_width :].cpu(), gaps[0] if gaps else None, step, "hf")


@dataclass
class Workload:
    """What every mode generates from; ``continuous_slots`` None means one slot per row."""

    model: PreTrainedModel
    backend: Backend
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    new_tokens: int
    continuous_slots: int | None = None

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prompt_width(self) -> int:
        return int(self.input_ids.shape[1])

    def sampling(self, **overrides: Any) -> SamplingParams:
        """Greedy, exactly ``new_tokens`` per row (the models have EOS off), pad id 0."""
        return SamplingParams(
            max_new_tokens=self.new_tokens, do_sample=False, pad_token_id=0, **overrides
        )


@dataclass
class CallOutput:
    """One generate call: the response tokens (host) and what the mode knows about the call."""

    tokens: torch.Tensor
    prefill_s: float | None = None
    decode_step_s: float | None = None
    path: str | None = None
    captures: int | None = None
    replays: int | None = None
    fallback_reason: str | None = None
    occupancy: float | None = None


@dataclass(frozen=True)
class Mode:
    """One way of generating: transformers' ``generate`` (``hf_kwargs`` set) or graphcap's
    :class:`RolloutEngine` on the path ``expected_path`` (None: graphs off). ``compiles``: the
    first call compiles (tens of seconds per batch size on a device)."""

    name: str
    expected_path: str | None = None
    hf_kwargs: dict[str, Any] | None = None
    compiles: bool = False

    def unsupported(self, backend: Backend) -> str | None:
        """Why this mode cannot run on ``backend`` (``None`` when it can)."""
        if self.expected_path and not backend.supports_graph_capture:
            return f"backend {backend.name!r} cannot capture graphs"
        if self.expected_path and self.compiles and backend.device.type == "cpu":
            return (
                "the CPU reference backend refuses compiled (inductor) regions at capture; "
                "run this mode on an accelerator"
            )
        return None

    @contextmanager
    def session(self, work: Workload) -> Iterator[Callable[[], CallOutput]]:
        """The mode opened on ``work``: yields the call to time, releases everything after."""
        if self.compiles:
            torch._dynamo.reset()  # a cold start: earlier compilations must not help this one
        try:
            if self.hf_kwargs is not None:
                yield functools.partial(
                    StepClock(work.backend.synchronize).generate, work, **self.hf_kwargs
                )
            else:
                with _engine(self, work) as call:
                    yield call
        finally:
            if self.compiles:
                torch._dynamo.reset()


@contextmanager
def _engine(mode: Mode, work: Workload) -> Iterator[Callable[[], CallOutput]]:
    settings: dict[str, Any] = {"enable_graph_capture": mode.expected_path is not None}
    sampling = work.sampling()
    if mode.expected_path == "continuous_graph":
        settings["continuous_batch_size"] = min(
            work.continuous_slots or work.batch_size, work.batch_size
        )
    elif mode.expected_path == "per_position_graph":
        # EOS is off, so pinning min_new_tokens to the length changes no token.
        settings["per_position_graphs"] = True
        sampling = work.sampling(min_new_tokens=work.new_tokens)
    if mode.compiles:
        # An instance attribute shadows the class's forward for this model only; undone below.
        work.model.forward = DecodeCompiledForward(work.model.forward)
    engine = RolloutEngine(work.model, RolloutConfig(backend=work.backend, **settings))

    def call() -> CallOutput:
        result = engine.generate(work.input_ids, work.attention_mask, sampling=sampling)
        s = result.stats
        return CallOutput(
            tokens=result.sequences[:, work.prompt_width :].cpu(),
            prefill_s=s.prefill_s,
            decode_step_s=s.decode_s / s.steps if s.steps else None,
            path=s.path,
            captures=s.captures,
            replays=s.replays,
            fallback_reason=s.fallback_reason,
            occupancy=s.occupancy,
        )

    try:
        yield call
    finally:
        engine.shutdown()
        vars(work.model).pop("forward", None)


class DecodeCompiledForward:
    """A model forward whose single-token (decode) calls run ``torch.compile``'d code.

    The engine's prefill stays eager (as in transformers' own auto-compile), so only the decode
    shape is compiled (``dynamic=False``): compilation happens in the warm-up step before
    capture, and the capture records the compiled kernels. Whether that worked is read from the
    result (a failed capture is a fallback with the reason), never assumed.
    """

    def __init__(self, forward: Any) -> None:
        self.eager = forward
        self.compiled = torch.compile(forward, dynamic=False)
        functools.update_wrapper(self, forward)  # the engine inspects forward's parameters

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        decode = ids is not None and ids.shape[-1] == 1
        return (self.compiled if decode else self.eager)(*args, **kwargs)


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("hf-eager", hf_kwargs={"disable_compile": True}),
        # transformers decides itself whether to compile (only on some device types); the runner
        # counts compiled graphs, so "compiled nothing" and steady recompiles are reported.
        Mode("hf-static-compile", hf_kwargs={"cache_implementation": "static"}, compiles=True),
        Mode("graphcap-eager"),
        Mode("graphcap-graph", "static_graph"),
        Mode("graphcap-graph-compiled", "static_graph", compiles=True),
        Mode("graphcap-continuous", "continuous_graph"),
        Mode("graphcap-per-position", "per_position_graph"),
    )
}


def default_modes(backend: Backend) -> list[str]:
    """Every mode that means something on this backend (compilation only on accelerators)."""
    on_cpu = backend.device.type == "cpu"
    return [name for name, mode in MODES.items() if not (on_cpu and mode.compiles)]


def parse_modes(text: str) -> list[str]:
    """Comma-separated mode names, validated, order kept."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODES]
    if unknown or not names:
        raise ValueError(f"unknown mode(s) {unknown or text!r}; choose from {', '.join(MODES)}")
    return list(dict.fromkeys(names))
