"""CPU cost of the decode step's work outside the model (issue 11), at realistic vocabularies.

Builds a tiny Llama (hidden 64, 2 layers) with a real vocabulary, a batch of left-padded
prompts, and the engine's own :class:`DecodeStep` (static cache, 4-D additive mask), then times
in isolation, per step: the model's decode forward, the mask update (``attend`` + ``render``)
and ``commit`` (penalty, min-new block, argmax, log-probs, bookkeeping) with neither, the
repetition penalty, log-probs, or both on. Best of repeats, milliseconds; CPU only.

    python benchmarks/step_overhead_cpu.py [--vocab 32000 128256] [--batch 64]
"""

from __future__ import annotations

import argparse
import timeit

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from graphcap.rollout.cache import StaticKVCache
from graphcap.rollout.config import SamplingParams
from graphcap.rollout.masks import MaskBuffers, layer_windows
from graphcap.rollout.sampling import RowPlan, SamplerShape
from graphcap.rollout.step import DecodeState, DecodeStep

SETTINGS = {
    "neither": {},
    "penalty": {"repetition_penalty": 1.3},
    "logprobs": {"return_logprobs": True},
    "both": {"repetition_penalty": 1.3, "return_logprobs": True},
}


def best_ms(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e3


def build_model(vocab: int, length: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=length + 8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def time_setting(model, ids, mask, new: int, extra: dict, number: int) -> dict[str, float]:
    """Per-step times of one sampling setting, half-way through a rollout."""
    batch, width = ids.shape
    total, vocab = width + new, model.config.vocab_size
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    params = SamplingParams(max_new_tokens=new, eos_token_id=[], pad_token_id=0, **extra)
    shape = SamplerShape().widen([params])
    cache = StaticKVCache(StaticKVCache.specs_of(out.past_key_values), batch, total)
    windows = layer_windows(model.config)
    masks = MaskBuffers.for_model(
        model.config, batch, total, torch.float32, ids.device, windows, "additive"
    )
    state = DecodeState.allocate(batch, total, vocab, (), 0, ids.device)
    step = DecodeStep(model, cache, masks, state, shape, None)
    cache.load_prefill(out.past_key_values)
    masks.reset(mask)
    state.reset(ids, positions[:, -1] + 1, RowPlan.build([params] * batch, 1, batch))
    logits = out.logits[:, -1]
    step.commit(logits)
    for _ in range(new // 2):  # fill half the generated columns: a mid-rollout step
        step()
    column = cache.write_pos

    def render() -> None:
        masks.attend(column)
        masks.render(column)

    def forward() -> None:
        model(
            input_ids=state.tokens,
            attention_mask=masks.outputs["full_attention"],
            position_ids=state.positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )

    return {
        "commit": best_ms(lambda: step.commit(logits), number),
        "mask attend+render": best_ms(render, number),
        "model forward": best_ms(forward, number),
    }


def measure(vocab: int, batch: int, width: int, new: int, number: int) -> dict[str, float]:
    model = build_model(vocab, width + new)
    ids = torch.randint(3, vocab, (batch, width))
    mask = torch.ones_like(ids)
    for row in range(batch):  # left padding of 0-6 columns
        mask[row, : row % 7] = 0
        ids[row, : row % 7] = 0
    times: dict[str, float] = {}
    for name, extra in SETTINGS.items():
        parts = time_setting(model, ids, mask, new, extra, number)
        times[f"commit[{name}]"] = parts["commit"]
        if name == "neither":
            times["mask attend+render"] = parts["mask attend+render"]
            times["model forward"] = parts["model forward"]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--number", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    for vocab in args.vocab:
        times = measure(vocab, args.batch, args.width, args.new, args.number)
        print(f"vocab {vocab}, batch {args.batch}, {args.width} + {args.new} columns:")
        for name, ms in times.items():
            print(f"  {name:24s} {ms:8.3f} ms")


if __name__ == "__main__":
    main()
