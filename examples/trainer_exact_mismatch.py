"""How far a rollout's log-probs are from the trainer's recomputation, default mode against
trainer-exact mode, on a tiny model on the CPU reference backend (docs/trainers.md,
"Trainer-exact rollouts", holds a run's table).

    GRAPHCAP_BACKEND=cpu python examples/trainer_exact_mismatch.py

Each rollout samples ``ROWS`` left-padded prompts for ``NEW`` tokens and records every token's
log-prob at temperature 1 (``logprobs_mode="raw"``). The trainer recomputes them with one
full-sequence forward: the model's own (as TRL calls it: ``model(ids, attention_mask=...)``,
and with ``generate``'s position ids) for the default mode, under
:func:`graphcap.rollout.trainer_exact` for the exact mode. Also times a call and the
trainer's forward and backward in both modes (CPU, tiny model: not a device cost).
"""

from __future__ import annotations

import contextlib
import time

import torch

from graphcap.rollout import RolloutConfig, RolloutEngine, token_logprobs, trainer_exact
from graphcap.tiny_models import prompts, tiny_model

ROWS, WIDTH, NEW = 16, 12, 32


def trainer_side(model, result, width, exact, positions):
    """The trainer's log-probs of the response tokens (and the forward's seconds)."""
    sequences, response = result.sequences, result.response_mask
    mask = torch.cat([(sequences[:, :width] != 0).long(), response], dim=1)
    extra = {}
    if positions:
        extra["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    with trainer_exact(model) if exact else contextlib.nullcontext(), torch.no_grad():
        logits = model(sequences, attention_mask=mask, **extra).logits
    return token_logprobs(logits[:, width - 1 : -1], sequences[:, width:])


def row(name, rollout, trainer, response):
    delta = (rollout - trainer)[response.bool()].abs().double()
    return (
        f"| {name} | {delta.mean():.2e} | {delta.quantile(0.99):.2e} | {delta.max():.2e} "
        f"| {(delta == 0).double().mean():.1%} |"
    )


def timed_backward(model, ids, mask, exact):
    start = time.perf_counter()
    with trainer_exact(model) if exact else contextlib.nullcontext():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(ids, attention_mask=mask, position_ids=positions).logits
    token_logprobs(logits[:, :-1], ids[:, 1:]).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    torch.manual_seed(0)
    ids, mask = prompts(ROWS, WIDTH, pad_cycle=5)
    params = {"max_new_tokens": NEW, "do_sample": True, "seed": 5, "return_logprobs": True}
    params["logprobs_mode"] = "raw"
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model("llama").to(dtype)
        print(f"\n{dtype}: {ROWS} rows x {NEW} sampled tokens, tiny llama, CPU reference")
        print("| rollout -> trainer | mean abs Δlogp | p99 | max | share bitwise equal |")
        print("|---|---|---|---|---|")
        configs = {
            "default eager": RolloutConfig(),
            "default graphs": RolloutConfig(enable_graph_capture=True),
            "trainer_exact graphs": RolloutConfig(enable_graph_capture=True, trainer_exact=True),
        }
        seconds = {}
        for name, config in configs.items():
            engine = RolloutEngine(model, config)
            engine.generate(ids, mask, **params)  # the capture
            start = time.perf_counter()
            result = engine.generate(ids, mask, **params)
            seconds[name] = time.perf_counter() - start
            exact = config.trainer_exact
            sides = (
                [("", True)] if exact else [(" (TRL's call)", False), (" (real positions)", True)]
            )
            for label, positions in sides:
                trainer = trainer_side(model, result, WIDTH, exact, positions)
                print(row(name + label, result.logprobs, trainer, result.response_mask))
        calls = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in seconds.items())
        full, full_mask = result.sequences, torch.ones_like(result.sequences)
        train = {
            e: min(timed_backward(model, full, full_mask, e) for _ in range(3)) for e in (0, 1)
        }
        print(f"a call: {calls}")
        print(
            f"trainer forward+backward: default {train[0] * 1e3:.0f} ms, "
            f"trainer_exact {train[1] * 1e3:.0f} ms ({train[1] / train[0]:.1f}x)"
        )


if __name__ == "__main__":
    main()
