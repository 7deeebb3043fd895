"""Random sampling inside graphs: graph and eager paths consume the generator identically.

This is what makes a sampled graph rollout equal an eager one for a fixed seed: each replay draws
what one eager step draws, from the generator's current state (never a state frozen at capture),
and restoring or re-seeding the generator reproduces a run. The engine samples from the default
generator, or from an explicit ``torch.Generator`` the caller passes (re-seeded per call when
``SamplingParams.seed`` is set); both are checked, captured through the engine's ``capture_step``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from graphcap.backend import Backend
from graphcap.rollout.holder.capture import capture_step
from graphcap.testing.conformance.replay import replay

VOCAB = 32
ROWS = 4
#: Replays per check: enough to catch a generator offset that wraps or stops after a few.
DRAWS = 24

Draw = tuple[list[int], list[list[float]]]


class SamplingStep:
    """A decode-like sampling step writing into static buffers: tokens and uniform noise."""

    def __init__(self, backend: Backend, generator: torch.Generator | None = None) -> None:
        self.backend, self.generator = backend, generator
        seed = torch.Generator().manual_seed(7)
        self.logits = torch.randn(ROWS, VOCAB, generator=seed).to(backend.device)
        self.tokens = torch.zeros(ROWS, dtype=torch.long, device=backend.device)
        self.noise = torch.zeros(ROWS, 64, device=backend.device)

    def __call__(self) -> None:
        probs = torch.softmax(self.logits / 0.8, dim=-1)
        self.tokens.copy_(torch.multinomial(probs, 1, generator=self.generator).squeeze(-1))
        self.noise.copy_(torch.rand(ROWS, 64, device=self.backend.device, generator=self.generator))

    def capture(self) -> object:
        return capture_step(self.backend, self, [self.tokens, self.noise], self.generator)

    def draws(self, run: Callable[[], None], k: int) -> list[Draw]:
        out = []
        for _ in range(k):
            run()
            self.backend.synchronize()
            out.append((self.tokens.cpu().tolist(), self.noise.cpu().tolist()))
        return out


def _all_different(draws: list[Draw]) -> bool:
    return all(a[1] != b[1] for a, b in itertools.pairwise(draws))


def test_replays_draw_what_eager_steps_draw(gc_rng_backend: Backend) -> None:
    backend = gc_rng_backend
    step = SamplingStep(backend)
    graph = step.capture()
    backend.manual_seed(2024)
    replayed = step.draws(lambda: replay(backend, graph), DRAWS)
    backend.manual_seed(2024)
    eager = step.draws(step, DRAWS)
    assert replayed == eager, f"{DRAWS} replays drew other numbers than {DRAWS} eager steps"
    assert _all_different(replayed), (
        "consecutive replays drew the same numbers: the graph froze its random state"
    )


def test_explicit_generator_replays_draw_what_eager_draws(gc_rng_backend: Backend) -> None:
    """As ``engine.generate(..., generator=g)`` with ``SamplingParams(seed=...)``: the graph is
    captured once, the generator is re-seeded before each call and advanced by each replay."""
    backend = gc_rng_backend
    generator = torch.Generator(device=backend.device).manual_seed(5)
    step = SamplingStep(backend, generator)
    graph = step.capture()
    runs: dict[int, list[Draw]] = {}
    for seed in (2024, 7):
        generator.manual_seed(seed)
        replayed = step.draws(lambda: replay(backend, graph), DRAWS)
        generator.manual_seed(seed)
        eager = step.draws(step, DRAWS)
        assert replayed == eager, (
            f"seed {seed}: {DRAWS} replays drew other numbers from the explicit generator than "
            f"{DRAWS} eager steps"
        )
        assert _all_different(replayed), (
            "consecutive replays drew the same numbers: the graph froze the explicit generator"
        )
        runs[seed] = replayed
    assert runs[2024] != runs[7], "re-seeding the explicit generator did not change the replays"
    # The default generator is not the one sampled from: moving it must not change the draws.
    generator.manual_seed(2024)
    backend.manual_seed(1)
    assert step.draws(lambda: replay(backend, graph), 2) == runs[2024][:2], (
        "replays read the default generator instead of the explicit one captured"
    )


def test_restoring_generator_state_reproduces_run(gc_rng_backend: Backend) -> None:
    backend = gc_rng_backend
    step = SamplingStep(backend)
    graph = step.capture()
    backend.manual_seed(99)
    replay(backend, graph)  # start from a state that is not a fresh seed
    state = backend.get_rng_state().clone()
    first = step.draws(lambda: replay(backend, graph), 3)
    backend.set_rng_state(state)
    second = step.draws(lambda: replay(backend, graph), 3)
    assert first == second, "restoring the generator state did not reproduce the replays"
