"""Cost of replaying a CPU graph vs running the same decode step eagerly.

Measures one greedy decode step of tiny random-init Llama models (static cache, 4-D mask,
explicit positions, argmax fed back into the input buffer): the Python model code run eagerly vs
``CPUGraph.replay()`` of the captured step. Before timing, it checks that the replayed step
produces exactly the eager step's logits and tokens, so the figure is for a faithful graph.

    python benchmarks/cpu_replay_cost.py [--out cpu-replay-cost.json] [--steps 24] [--repeats 21]

Eager and replay blocks of ``--steps`` steps alternate ``--repeats`` times; each figure is a
median over blocks (time per step), the ratio the median of per-pair ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

from graphcap.cpu.graph import CPUGraph

VOCAB = 128
MODELS = {
    "llama-h64-l2": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
    "llama-h256-l4": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4},
}
SHAPES = [(1, 64), (4, 64), (4, 256)]  # (batch, cache length)


class DecodeStep:
    """One greedy decode step whose inputs and outputs live in fixed buffers."""

    def __init__(self, model: LlamaForCausalLM, batch: int, cache_len: int) -> None:
        self.model = model
        self.cache = StaticCache(config=model.config, max_cache_len=cache_len)
        self.ids = torch.randint(0, VOCAB, (batch, 1))
        self.positions = torch.zeros(batch, 1, dtype=torch.long)
        self.slots = torch.arange(cache_len).view(1, 1, 1, cache_len)
        prompt = torch.randint(0, VOCAB, (batch, cache_len // 2))
        prompt_mask = torch.zeros(batch, 1, prompt.shape[1], cache_len)
        prompt_mask[..., prompt.shape[1] :] = float("-inf")  # causality inside the prompt is moot
        self.prefill_len = prompt.shape[1]
        with torch.no_grad():  # allocates the cache layers (created lazily on first update)
            model(
                prompt,
                attention_mask=prompt_mask,
                position_ids=torch.arange(prompt.shape[1]).expand(batch, -1),
                past_key_values=self.cache,
            )
        self.logits: torch.Tensor | None = None

    def rewind(self) -> None:
        """Back to right after the prefill: write position, position ids, input token."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(self.prefill_len)
        self.positions.fill_(self.prefill_len)
        self.ids.fill_(1)

    def __call__(self) -> torch.Tensor:
        # The additive mask is built on the device from the position buffer, inside the step.
        visible = self.slots <= self.positions.view(-1, 1, 1, 1)
        mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        out = self.model(
            self.ids,
            attention_mask=mask,
            position_ids=self.positions,
            past_key_values=self.cache,
        )
        logits = out.logits[:, -1]
        self.ids.copy_(logits.argmax(-1, keepdim=True))
        self.positions.add_(1)
        return logits


def _block_ms(run, rewind, steps: int) -> float:
    """Wall time per step over one block of ``steps`` steps, in milliseconds."""
    rewind()
    start = time.perf_counter()
    for _ in range(steps):
        run()
    return (time.perf_counter() - start) / steps * 1e3


def _paired_blocks(eager, replay, rewind, steps: int, repeats: int) -> dict[str, float]:
    """Alternate eager and replay blocks so both see the same machine load; medians of each.

    The machine is shared, so load drifts between blocks: the median of the per-pair ratios is
    the figure to trust, the absolute times less so.
    """
    eager_ms, replay_ms = [], []
    for _ in range(repeats):
        eager_ms.append(_block_ms(eager, rewind, steps))
        replay_ms.append(_block_ms(replay, rewind, steps))
    ratios = [r / e for e, r in zip(eager_ms, replay_ms, strict=True)]
    quartiles = statistics.quantiles(ratios, n=4)
    return {
        "eager_ms_per_step": round(statistics.median(eager_ms), 4),
        "replay_ms_per_step": round(statistics.median(replay_ms), 4),
        "replay_over_eager": round(statistics.median(ratios), 3),
        "replay_over_eager_iqr": [round(quartiles[0], 3), round(quartiles[2], 3)],
    }


def measure(name: str, batch: int, cache_len: int, steps: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2, **MODELS[name]
    )
    model = LlamaForCausalLM(config).eval()
    step = DecodeStep(model, batch, cache_len)

    # Eager reference tokens/logits for a few steps, then the same steps replayed.
    step.rewind()
    with torch.no_grad():
        eager = [(step().clone(), step.ids.clone()) for _ in range(4)]
    step.rewind()
    graph = CPUGraph()
    start = time.perf_counter()
    with torch.no_grad(), graph.capture():
        logits = step()
    capture_ms = (time.perf_counter() - start) * 1e3
    for expected_logits, expected_ids in eager:
        graph.replay()
        torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
        assert torch.equal(step.ids, expected_ids), "replayed tokens differ from eager tokens"

    def eager_step() -> None:
        with torch.no_grad():
            step()

    limit = cache_len - step.prefill_len  # the cache holds this many decode steps
    steps = min(steps, limit)
    timing = _paired_blocks(eager_step, graph.replay, step.rewind, steps, repeats)
    return {
        "model": name,
        "batch": batch,
        "cache_len": cache_len,
        "steps_per_block": steps,
        "blocks": repeats,
        "replayed_ops": graph.num_ops,
        "capture_ms": round(capture_ms, 2),
        **timing,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("cpu-replay-cost.json"))
    parser.add_argument("--steps", type=int, default=24, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=21, help="timed blocks (median taken)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in MODELS:
        for batch, cache_len in SHAPES:
            row = measure(name, batch, cache_len, args.steps, args.repeats)
            print(json.dumps(row))
            rows.append(row)
    result = {
        "benchmark": "cpu_replay_cost",
        "command": "python benchmarks/cpu_replay_cost.py "
        f"--steps {args.steps} --repeats {args.repeats} --threads {args.threads}",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": args.threads,
        "statistic": "medians over alternating eager/replay blocks of wall time per step; "
        "replay_over_eager is the median of per-pair ratios (with its interquartile range)",
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
