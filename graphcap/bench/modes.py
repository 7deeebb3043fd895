"""The generation modes a benchmark compares, all on one model, one set of prompts.

Each mode is opened for one batch, called repeatedly, and closed (engines are dropped so the
next mode starts from the same memory). A mode that cannot run here says why up front
(:meth:`BenchMode.unsupported`), and a graph mode that silently ran eagerly is reported as a
fallback, never as a graph result.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel

from graphcap.backend import Backend
from graphcap.bench.timing import StepClock
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams


@dataclass
class Workload:
    """What every mode generates from: the model, its prompts, and the response length.

    ``continuous_slots`` is the continuous path's slot count (``None``: one slot per row).
    """

    model: PreTrainedModel
    backend: Backend
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    new_tokens: int
    pad_token_id: int = 0
    continuous_slots: int | None = None

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prompt_width(self) -> int:
        return int(self.input_ids.shape[1])


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


class BenchMode(ABC):
    """One way of generating; ``open`` / ``__call__`` / ``close`` around a batch."""

    name: ClassVar[str]
    #: The engine path a graph mode must report; anything else is a fallback (ran eagerly).
    expected_path: ClassVar[str | None] = None
    #: True for modes whose first call compiles (tens of seconds per batch size on a device).
    compiles: ClassVar[bool] = False

    def unsupported(self, backend: Backend) -> str | None:
        """Why this mode cannot run on ``backend`` (``None`` when it can)."""
        return None

    @abstractmethod
    def open(self, work: Workload) -> None: ...

    @abstractmethod
    def __call__(self) -> CallOutput: ...

    @abstractmethod
    def close(self) -> None:
        """Release what ``open`` made (engines, compiled wrappers)."""


class HFEager(BenchMode):
    """``model.generate()`` with its dynamic cache and compilation disabled."""

    name = "hf-eager"
    generate_kwargs: ClassVar[dict[str, Any]] = {"disable_compile": True}

    def open(self, work: Workload) -> None:
        self.work = work
        self.clock = StepClock(work.backend.synchronize)

    def close(self) -> None:
        """Nothing to release: generate() keeps no state between calls."""

    def __call__(self) -> CallOutput:
        work = self.work
        self.clock.begin()
        with torch.no_grad():
            out = work.model.generate(
                work.input_ids,
                attention_mask=work.attention_mask,
                max_new_tokens=work.new_tokens,
                min_new_tokens=0,
                do_sample=False,
                pad_token_id=work.pad_token_id,
                stopping_criteria=[self.clock],
                **self.generate_kwargs,
            )
        return CallOutput(
            tokens=out[:, work.prompt_width :].cpu(),
            prefill_s=self.clock.prefill_s,
            decode_step_s=self.clock.decode_step_s,
            path="hf",
        )


class HFStaticCompile(HFEager):
    """``generate(cache_implementation="static")``: transformers compiles the decode forward.

    transformers decides itself whether to compile (only on some device types); the runner
    counts compiled graphs, so a run where nothing compiled, or one that recompiles in the
    steady state, is reported as such.
    """

    name = "hf-static-compile"
    compiles = True
    generate_kwargs: ClassVar[dict[str, Any]] = {"cache_implementation": "static"}

    def open(self, work: Workload) -> None:
        # A cold start per batch: earlier compilations must not make this first call look cheap.
        torch._dynamo.reset()
        super().open(work)

    def close(self) -> None:
        torch._dynamo.reset()


class GraphcapMode(BenchMode):
    """graphcap's :class:`RolloutEngine`, eager or on the static graph path."""

    name = "graphcap-eager"
    graphs: ClassVar[bool] = False

    def unsupported(self, backend: Backend) -> str | None:
        if self.graphs and not backend.supports_graph_capture:
            return f"backend {backend.name!r} cannot capture graphs"
        return None

    def engine_config(self, work: Workload) -> RolloutConfig:
        return RolloutConfig(enable_graph_capture=self.graphs, backend=work.backend)

    def open(self, work: Workload) -> None:
        self.work = work
        self.engine = RolloutEngine(work.model, self.engine_config(work))
        self.sampling = SamplingParams(
            max_new_tokens=work.new_tokens, do_sample=False, pad_token_id=work.pad_token_id
        )

    def __call__(self) -> CallOutput:
        work = self.work
        result = self.engine.generate(work.input_ids, work.attention_mask, sampling=self.sampling)
        stats = result.stats
        return CallOutput(
            tokens=result.sequences[:, work.prompt_width :].cpu(),
            prefill_s=stats.prefill_s,
            decode_step_s=stats.decode_s / stats.steps if stats.steps else None,
            path=stats.path,
            captures=stats.captures,
            replays=stats.replays,
            fallback_reason=stats.fallback_reason,
            occupancy=stats.occupancy,
        )

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.engine = None


class GraphcapGraph(GraphcapMode):
    """The static graph path: the whole decode step captured once, then replayed."""

    name = "graphcap-graph"
    graphs = True
    expected_path = "static_graph"


class DecodeCompiledForward:
    """A model forward whose single-token (decode) calls run ``torch.compile``'d code.

    The engine's prefill stays eager (as in transformers' own auto-compile), so only the decode
    shape is compiled: one compilation instead of two, each tens of seconds for a large model.
    """

    def __init__(self, forward: Any) -> None:
        self.eager = forward
        self.compiled = torch.compile(forward, dynamic=False)
        # Keep the real signature visible: the engine inspects forward's parameters.
        functools.update_wrapper(self, forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        decode = ids is not None and ids.shape[-1] == 1
        return (self.compiled if decode else self.eager)(*args, **kwargs)


class GraphcapGraphCompiled(GraphcapGraph):
    """The static graph captured around a ``torch.compile``'d decode forward.

    The engine is handed the model with its decode forward compiled (``dynamic=False``):
    compilation happens in the warm-up step before capture, and the capture records the
    compiled kernels. Whether the engine and backend can do that is read from the result (a
    failed capture is a fallback with the reason), never assumed.
    """

    name = "graphcap-graph-compiled"
    compiles = True

    def unsupported(self, backend: Backend) -> str | None:
        reason = super().unsupported(backend)
        if reason is None and backend.device.type == "cpu":
            reason = (
                "the CPU reference backend refuses compiled (inductor) regions at capture; "
                "run this mode on an accelerator"
            )
        return reason

    def open(self, work: Workload) -> None:
        torch._dynamo.reset()
        model = work.model
        # An instance attribute shadows the class's forward for this model only; close() undoes it.
        model.forward = DecodeCompiledForward(model.forward)
        super().open(work)

    def close(self) -> None:
        super().close()
        work = getattr(self, "work", None)
        if work is not None and "forward" in vars(work.model):
            del work.model.forward
        torch._dynamo.reset()


class GraphcapContinuous(GraphcapGraph):
    """The continuous-batching graph path: rows queue through a fixed set of slots.

    With one slot per row (the default) every request is in flight at once, so the figures
    show what the slot machinery costs over the static graph; fewer slots (``--continuous-slots``)
    queue the rows. Rows are only retired at the EOS check interval, so a slot can idle for up
    to ``eos_check_interval - 1`` steps; ``occupancy`` reports the share of slot-steps used.
    """

    name = "graphcap-continuous"
    expected_path = "continuous_graph"

    def engine_config(self, work: Workload) -> RolloutConfig:
        slots = min(work.continuous_slots or work.batch_size, work.batch_size)
        return RolloutConfig(
            enable_graph_capture=True, continuous_batch_size=slots, backend=work.backend
        )


class GraphcapPerPosition(GraphcapGraph):
    """Per-position graphs: one graph per decode position, attending over written columns only.

    Every mode here generates exactly ``new_tokens`` per row (EOS is off), so pinning
    ``min_new_tokens`` to it changes no token; the first call captures one graph per position.
    """

    name = "graphcap-per-position"
    expected_path = "per_position_graph"

    def engine_config(self, work: Workload) -> RolloutConfig:
        return RolloutConfig(
            enable_graph_capture=True, per_position_graphs=True, backend=work.backend
        )

    def open(self, work: Workload) -> None:
        super().open(work)
        self.sampling = replace(self.sampling, min_new_tokens=work.new_tokens)


MODES: dict[str, type[BenchMode]] = {
    cls.name: cls
    for cls in (
        HFEager,
        HFStaticCompile,
        GraphcapMode,
        GraphcapGraph,
        GraphcapGraphCompiled,
        GraphcapContinuous,
        GraphcapPerPosition,
    )
}


def default_modes(backend: Backend) -> list[str]:
    """Every mode that means something on this backend (compilation only on accelerators)."""
    if backend.device.type == "cpu":
        return [
            "hf-eager",
            "graphcap-eager",
            "graphcap-graph",
            "graphcap-continuous",
            "graphcap-per-position",
        ]
    return [
        "hf-eager",
        "hf-static-compile",
        "graphcap-eager",
        "graphcap-graph",
        "graphcap-graph-compiled",
        "graphcap-continuous",
        "graphcap-per-position",
    ]


def parse_modes(text: str) -> list[str]:
    """Comma-separated mode names, validated, order kept."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODES]
    if unknown or not names:
        raise ValueError(f"unknown mode(s) {unknown or text!r}; choose from {', '.join(MODES)}")
    return list(dict.fromkeys(names))
