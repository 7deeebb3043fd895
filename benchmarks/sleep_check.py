"""Sleeps that keep the graphs, step by step on the selected backend, printing as it goes (a
crash in a device library then still shows where it happened): for the default and the
uncompiled configuration, an engine's round after a sleep alone, after a training step alone,
after both, and after every parameter moved, each against a twin engine that never slept (the
twin takes the model's values in place), with the device's free-memory report at every sleep.

GRAPHCAP_BACKEND=cuda python benchmarks/sleep_check.py [CONFIG ...]   # default: every one
"""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import torch

import graphcap
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.tiny_models import tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_training_loop import move_storage, same_values, train_step

CONFIGS = {
    "default": {},
    "uncompiled": {"compile": False, "fuse_projections": False},
    "unfused": {"fuse_projections": False},
}
EVENTS = ("sleep", "train", "sleep+train", "move", "sleep+move")


def say(*parts: object) -> None:
    print(*parts, flush=True)


def check(backend: graphcap.Backend, settings: dict, event: str, sampled: bool) -> None:
    model = tiny_model("llama", seed=0).to(backend.device)
    twin = copy.deepcopy(model)
    rows = 8
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (rows, 6), generator=gen).to(backend.device)
    mask = torch.ones_like(ids)
    params = [SamplingParams(max_new_tokens=12, do_sample=sampled, seed=7 + i) for i in range(rows)]
    config = RolloutConfig(
        enable_graph_capture=True, backend=backend, length_buckets=(8192,), **settings
    )
    engine, reference = RolloutEngine(model, config), RolloutEngine(twin, config)
    first = engine.generate(ids, mask, params)
    same = torch.equal(first.sequences, reference.generate(ids, mask, params).sequences)
    line = [f"first equal {same}"]
    for _ in range(2):
        if "sleep" in event:
            engine.sleep()
            report = engine.last_sleep
            line.append(f"held {report.held_bytes} given back {report.given_back}")
        if "train" in event:
            train_step(model, first.sequences)
            same_values(twin, model)
        if "move" in event:
            move_storage(model, new_values=False)
        again = engine.generate(ids, mask, params)
        expected = reference.generate(ids, mask, params)
        same = torch.equal(again.sequences, expected.sequences)
        line.append(f"captures {again.stats.captures} wake {again.stats.wake_s} equal {same}")
    engine.shutdown()
    reference.shutdown()
    say(" | ".join(line))


def graphs_outside_the_region(backend: graphcap.Backend) -> None:
    """The variant ``default-outside``: captures allocate outside the backend's region (its
    graphs' memory is then not given back at a sleep), to tell whether a difference after a
    sleep comes from the graphs' own memory."""
    region = type(backend.memory_region())
    region.capturing = lambda self, keep=False: contextlib.nullcontext()
    region.graph_pool = lambda self: None


def main() -> None:
    backend = graphcap.get_backend()
    say("backend", backend.name, backend.device_name(), backend.capabilities)
    names = sys.argv[1:] or list(CONFIGS)
    for name in names:
        if name == "default-outside":
            graphs_outside_the_region(backend)
        settings = CONFIGS[name.removesuffix("-outside")]
        for sampled in (False, True):
            for event in EVENTS:
                say(f"== {name}, {'sampled' if sampled else 'greedy'}, {event}:")
                check(backend, settings, event, sampled)
    backend.empty_cache()  # a trainer's empty_cache after the engines are gone
    say("shut down and emptied the cache")


if __name__ == "__main__":
    main()
