"""The rl-round workload as a trainer lives it: what happens between two rounds.

``--between sleep-train``: the engine sleeps (a colocated trainer needs its memory) and one
training step runs on the last round's rows (forward, backward and an in-place SGD step, in
micro-batches), as a GRPO iteration does. ``--between move``: every parameter gets new
storage with the same values, as a sharded trainer's gather leaves them. ``nothing``: steady
rounds back to back. Each pause reports its training time and what the sleep gave back.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from graphcap.bench.modes import CallOutput, Workload
from graphcap.rollout import RolloutEngine

BETWEEN = ("nothing", "sleep-train", "move")
#: rows per forward and backward of the training step (its logits are the largest tensor)
MICRO_BATCH = 4
#: SGD's step: the update's size does not matter here, its cost and its being in place do
LEARNING_RATE = 1e-6


@dataclass
class Pause:
    """One pause between rounds: the training step's seconds (``None``: none ran); what the
    engine held and what the device reported free after its sleep and not before (``None``:
    no sleep, or the device does not say)."""

    train_s: float | None = None
    held_bytes: int | None = None
    given_back_bytes: int | None = None


def pause(
    between: str, work: Workload, engine: RolloutEngine | None, last: CallOutput, rows: int
) -> Pause:
    """What a trainer does between two rounds (see the module); untimed by the caller."""
    if between == "move":
        with torch.no_grad():
            for p in work.model.parameters():
                p.data = p.data.clone()
        return Pause()
    if between != "sleep-train":
        return Pause()
    done = Pause()
    if engine is not None:
        engine.sleep()  # a no-op where the drop-in already slept after its call
        report = engine.last_sleep
        if report is not None:
            done.held_bytes, done.given_back_bytes = report.held_bytes, report.given_back
    start = time.perf_counter()
    train_step(work, last.tokens, rows)
    work.backend.synchronize()
    done.train_s = time.perf_counter() - start
    return done


def train_step(work: Workload, responses: torch.Tensor, rows: int) -> None:
    """One step of next-token loss over the first ``rows`` rows of the round (prompt and
    response), gradients accumulated over micro-batches, then SGD in place."""
    model, device = work.model, work.input_ids.device
    samples = responses.shape[0] // work.input_ids.shape[0]
    prompts = work.input_ids.repeat_interleave(samples, 0)
    batch = torch.cat([prompts, responses.to(device)], 1)[:rows]
    training = model.training
    model.train()
    try:
        for chunk in batch.split(MICRO_BATCH):
            logits = model(input_ids=chunk).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1)
            )
            (loss * len(chunk) / len(batch)).backward()
            del logits, loss
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-LEARNING_RATE)
                    p.grad = None
    finally:
        model.train(training)


def summary(
    pauses: list[Pause], first: CallOutput, calls: list[CallOutput], steady_s: list[float]
) -> dict:
    """The iteration's figures for the report: per steady round its seconds, the graphs it
    captured (a size of the live-row ladder no earlier round reached, or a recapture) with the
    reasons, and its wake; per pause its training time and what the sleep gave back; the
    rollout's share of an iteration (round over round plus training step, medians)."""
    trains = [p.train_s for p in pauses if p.train_s is not None]
    stats = [c.stats for c in calls]
    counts = [s.captures if s else 0 for s in [first.stats, *stats]]
    captured = [b - a for a, b in itertools.pairwise(counts)]
    measured = [(p.given_back_bytes, p.held_bytes) for p in pauses if p.held_bytes]
    measured = [(g, h) for g, h in measured if g is not None]
    round_s = sorted(steady_s)[len(steady_s) // 2]
    train_s = sorted(trains)[len(trains) // 2] if trains else None
    return {
        "rounds_s": steady_s,
        "captured": captured,
        "recapture_reasons": [s.recapture_reason if s else [] for s in stats],
        "wake_s": [s.wake_s if s else None for s in stats],
        "train_s": trains,
        "held_bytes": [p.held_bytes for p in pauses],
        "given_back_bytes": [p.given_back_bytes for p in pauses],
        "given_back_share": min(g / h for g, h in measured) if measured else None,
        "rollout_share": round_s / (round_s + train_s) if train_s else None,
    }
