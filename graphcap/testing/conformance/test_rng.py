"""Random sampling inside graphs: graph and eager paths consume the generator identically.

This is what makes a sampled graph rollout equal an eager one for a fixed seed: capture does not
move the generator, each replay draws what one eager step draws, and restoring the generator
state reproduces a run.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from graphcap.backend import Backend
from graphcap.testing.graphs import capture, replay, warm_up

VOCAB = 32
ROWS = 4


def _sampling_step(backend: Backend) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """A decode-like sampling step writing into static buffers: tokens and uniform noise."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(ROWS, VOCAB, generator=generator).to(backend.device)
    tokens = torch.zeros(ROWS, dtype=torch.long, device=backend.device)
    noise = torch.zeros(ROWS, 64, device=backend.device)

    def step() -> None:
        probs = torch.softmax(logits / 0.8, dim=-1)
        tokens.copy_(torch.multinomial(probs, 1).squeeze(-1))
        noise.copy_(torch.rand(ROWS, 64, device=backend.device))

    return step, tokens, noise


def _draws(
    run: Callable[[], None], tokens: torch.Tensor, noise: torch.Tensor, k: int
) -> list[tuple[list[int], list[list[float]]]]:
    draws = []
    for _ in range(k):
        run()
        draws.append((tokens.cpu().tolist(), noise.cpu().tolist()))
    return draws


def test_capture_does_not_advance_generator(gc_rng_backend: Backend) -> None:
    backend = gc_rng_backend
    step, _, _ = _sampling_step(backend)
    backend.manual_seed(11)
    warm_up(backend, step)
    before = backend.get_rng_state().clone()
    capture(backend, step)
    after = backend.get_rng_state()
    assert torch.equal(before, after), "capture moved the generator; an eager step would not"


def test_replays_draw_what_eager_steps_draw(gc_rng_backend: Backend) -> None:
    backend = gc_rng_backend
    step, tokens, noise = _sampling_step(backend)
    warm_up(backend, step)
    graph, _ = capture(backend, step)
    k = 4

    backend.manual_seed(2024)
    replayed = _draws(lambda: replay(backend, graph), tokens, noise, k)
    backend.manual_seed(2024)

    def eager() -> None:
        step()
        backend.synchronize()

    eager_draws = _draws(eager, tokens, noise, k)
    assert replayed == eager_draws, f"{k} replays drew other numbers than {k} eager steps"
    noises = [draw[1] for draw in replayed]
    assert all(a != b for a, b in itertools.pairwise(noises)), (
        "consecutive replays drew the same numbers: the graph froze its random state"
    )


def test_restoring_generator_state_reproduces_run(gc_rng_backend: Backend) -> None:
    backend = gc_rng_backend
    step, tokens, noise = _sampling_step(backend)
    warm_up(backend, step)
    graph, _ = capture(backend, step)
    backend.manual_seed(99)
    replay(backend, graph)  # start from a state that is not a fresh seed
    state = backend.get_rng_state().clone()
    first = _draws(lambda: replay(backend, graph), tokens, noise, 3)
    backend.set_rng_state(state)
    second = _draws(lambda: replay(backend, graph), tokens, noise, 3)
    assert first == second, "restoring the generator state did not reproduce the replays"
