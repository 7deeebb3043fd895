"""Timing: the first call and the steady state, measured separately.

The first call of a mode pays for capture or compilation once; what a long RL run pays per
rollout is the steady state. Mixing them (a mean over all calls) hides both numbers, so the
first call is timed on its own, ``warmup`` calls are discarded, and the steady figure is the
median of ``repeats`` further calls. Every timed call is bracketed by device synchronisation,
since device work is asynchronous.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from transformers import StoppingCriteria

T = TypeVar("T")


@dataclass
class Timed(Generic[T]):
    """One call's wall time and what it returned."""

    seconds: float
    value: T


@dataclass
class Measurement(Generic[T]):
    """First call, discarded warmup calls, and the steady-state repeats of one mode."""

    first: Timed[T]
    warmup: list[Timed[T]]
    steady: list[Timed[T]]

    @property
    def steady_seconds(self) -> list[float]:
        return [t.seconds for t in self.steady]

    @property
    def steady_median_s(self) -> float:
        return statistics.median(self.steady_seconds)

    @property
    def last(self) -> Timed[T]:
        return self.steady[-1] if self.steady else self.first


def timed_call(
    call: Callable[[], T],
    sync: Callable[[], None],
    clock: Callable[[], float] = time.perf_counter,
) -> Timed[T]:
    """Time ``call`` between two device synchronisations."""
    sync()
    start = clock()
    value = call()
    sync()
    return Timed(clock() - start, value)


def measure(
    call: Callable[[], T],
    *,
    repeats: int,
    warmup: int,
    sync: Callable[[], None],
    clock: Callable[[], float] = time.perf_counter,
    on_call: Callable[[str, int, float], None] | None = None,
) -> Measurement[T]:
    """Run ``call`` once (first), ``warmup`` times (discarded), ``repeats`` times (steady).

    ``on_call(phase, index, seconds)`` reports progress after each call.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")

    def run(phase: str, index: int) -> Timed[T]:
        result = timed_call(call, sync, clock)
        if on_call is not None:
            on_call(phase, index, result.seconds)
        return result

    first = run("first", 0)
    warm = [run("warmup", i) for i in range(warmup)]
    steady = [run("steady", i) for i in range(repeats)]
    return Measurement(first, warm, steady)


class StepClock(StoppingCriteria):
    """A ``generate()`` stopping criterion that timestamps every token and never stops.

    ``generate`` already reads a device flag on the host after every token on CUDA-like devices,
    so synchronising here adds no stall; the intervals between consecutive tokens are the decode
    step times, and the first token's time is the prefill.
    """

    def __init__(
        self,
        sync: Callable[[], None],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__()
        self._sync = sync
        self._clock = clock
        self._false: torch.Tensor | None = None
        self.start = 0.0
        self.stamps: list[float] = []

    def begin(self) -> None:
        self.stamps = []
        self.start = self._clock()

    def __call__(  # type: ignore[override]
        self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object
    ) -> torch.Tensor:
        self._sync()
        self.stamps.append(self._clock())
        if self._false is None or self._false.shape[0] != input_ids.shape[0]:
            self._false = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return self._false

    @property
    def prefill_s(self) -> float | None:
        return self.stamps[0] - self.start if self.stamps else None

    @property
    def decode_step_s(self) -> float | None:
        """Median interval between consecutive tokens after the first."""
        gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]
        return statistics.median(gaps) if gaps else None
