"""docs/quickstart-rl.md's plain loop runs as written on a tiny model, and does what the page
says: the first round captures, later rounds replay the graphs kept through each sleep (a
capture only for a ladder size no earlier round reached), and each round after a sleep wakes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import graphcap.rollout
from graphcap.rollout import RolloutEngine, RolloutResult
from graphcap.tiny_models import prompts, tiny_model

PAGE = Path(__file__).resolve().parents[1] / "docs" / "quickstart-rl.md"


def plain_loop() -> str:
    """The page's Python block under "A plain loop"."""
    section = PAGE.read_text().split("## A plain loop", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def policy_loss(model: torch.nn.Module, rollout: object) -> torch.Tensor:
    """A stand-in for the user's loss: the rollout's tokens, teacher-forced."""
    sequences = rollout.sequences
    logits = model(input_ids=sequences).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), sequences[:, 1:].flatten())


class Recording(RolloutEngine):
    """The engine, keeping every call's stats."""

    calls: ClassVar[list] = []

    def generate(self, *args: object, **kwargs: object) -> RolloutResult:
        result = super().generate(*args, **kwargs)
        self.calls.append(result.stats)
        return result


def test_the_quickstarts_plain_loop_replays_its_graphs_through_sleeps(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(graphcap.rollout, "RolloutEngine", Recording)
    monkeypatch.setattr(Recording, "calls", [])
    model = tiny_model("llama", vocab_size=32, seed=0, max_position_embeddings=128)
    input_ids, attention_mask = prompts(2, 6, vocab_size=32, seed=1, device=torch.device("cpu"))
    code = plain_loop().replace("max_new_tokens=64", "max_new_tokens=12")
    namespace = {"model": model, "steps": 4, "policy_loss": policy_loss}
    namespace |= {"input_ids": input_ids, "attention_mask": attention_mask}
    exec(compile(code, str(PAGE), "exec"), namespace)
    rounds = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert len(rounds) == 4 and all(path == "static_graph" for path, _, _ in rounds)
    assert rounds[0][1:] == ["True", "None"]  # the first round captures; nothing to wake
    assert all(wake != "None" and float(wake) > 0 for _, _, wake in rounds[1:])
    # one graph per ladder size reached, each captured once and kept through the sleeps
    calls = Recording.calls
    sizes = set().union(*(set(s.batch_steps) or {s.batch_size} for s in calls))
    assert namespace["engine"].captures == len(sizes) == sum(len(s.capture_reasons) for s in calls)
    later = [reason for s in calls[1:] for reason in s.capture_reasons]
    assert all(reason.startswith("batch_ladder size") for reason in later), later
