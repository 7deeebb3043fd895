"""The rollout tests' helpers around graphcap's tiny models (:mod:`graphcap.tiny_models`).

Models are cached per configuration (tests that mutate one ask for a fresh copy);
:func:`distinct_tokens_per_row` lets tests assert that outputs change token by token, which the
tiny models' large init std is for.
"""

from __future__ import annotations

import functools

import torch

from graphcap import tiny_models
from graphcap.cpu import CPUBackend
from graphcap.tiny_models import EOS, PAD, VOCAB

#: The families every-family tests run (phi3 and gemma are built for the tests that name them).
FAMILIES = ("gpt2", "llama", "qwen2", "opt", "mistral")
__all__ = ["EOS", "FAMILIES", "PAD", "VOCAB"]  # the ids and sizes tests compare against


@functools.cache
def _cached(family: str, attn: str, overrides: tuple) -> torch.nn.Module:
    return tiny_models.tiny_model(family, attn, **dict(overrides))


def tiny_model(family: str, attn: str = "sdpa", fresh: bool = False, **overrides: object):
    """A 2-layer, hidden-64, vocab-128 fp32 model; cached unless ``fresh`` (tests that mutate)."""
    if fresh:
        return tiny_models.tiny_model(family, attn, **overrides)
    return _cached(family, attn, tuple(sorted(overrides.items())))


def prompts(batch: int, width: int = 6, seed: int = 0, padded: bool = True):
    """Left-padded prompts: row ``i`` has ``width - (i % 3)`` real tokens (ids 3..VOCAB-1)."""
    return tiny_models.prompts(batch, width, seed=seed, pad_cycle=3 if padded else 1)


def distinct_tokens_per_row(result, min_distinct: int = 3) -> bool:
    """Whether every row's response has at least ``min_distinct`` different tokens."""
    width = result.sequences.shape[1] - result.response_mask.shape[1]
    for row, length in enumerate(result.response_lengths.tolist()):
        tokens = result.sequences[row, width : width + length]
        if len(set(tokens.tolist())) < min_distinct:
            return False
    return True


def generate_padded(model, ids, mask, total: int, **kwargs) -> torch.Tensor:
    """``model.generate`` output padded with PAD to ``total`` columns."""
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            pad_token_id=PAD,
            eos_token_id=kwargs.pop("eos_token_id", EOS),
            **kwargs,
        )
    pad = torch.full((out.shape[0], total - out.shape[1]), PAD, dtype=out.dtype)
    return torch.cat([out, pad], dim=1)


class ScriptedMemory(CPUBackend):
    """The CPU reference backend reporting ``free`` bytes available, as a device whose free
    memory the engine's own buffers have taken."""

    name = "scripted-memory"

    def __init__(self, free: int) -> None:
        super().__init__()
        self.free = free

    def memory_available(self) -> int:
        return self.free


def make_engine(model, graph: bool = True, backend=None, **config):
    """The tests' one engine factory: CPU reference backend unless ``backend`` is given."""
    from graphcap.rollout import RolloutConfig, RolloutEngine

    config = RolloutConfig(enable_graph_capture=graph, backend=backend or CPUBackend(), **config)
    return RolloutEngine(model, config)


def run(
    model,
    ids,
    mask,
    graph: bool,
    backend=None,
    generator=None,
    draws="per_row",
    ladder="auto",
    **sampling,
):
    """One ``generate`` call on a fresh engine (CPU reference backend unless given);
    ``draws="generate"`` where sampled tokens are compared with generate's, ``ladder=None``
    where a test counts steps between "all finished" checks."""
    from graphcap.rollout import SamplingParams

    engine = make_engine(model, graph, backend, draws=draws, batch_ladder=ladder)
    result = engine.generate(ids, mask, SamplingParams(**sampling), generator=generator)
    engine.shutdown()
    return result


def assert_rows_equal_alone(model, ids, mask, result, limits, sampling=lambda row: {}):
    """Each row of a continuous ``result`` equals its request decoded alone by the eager loop
    (``max_new_tokens=limits[row]`` and ``sampling(row)``), tokens and finish reason."""
    width = ids.shape[1]
    for row, limit in enumerate(limits):
        alone = run(
            model,
            ids[row : row + 1],
            mask[row : row + 1],
            False,
            max_new_tokens=limit,
            **sampling(row),
        )
        assert torch.equal(result.sequences[row, : width + limit], alone.sequences[0]), row
        assert result.finish_reasons[row] == alone.finish_reasons[0], row


def assert_same_rows(a, b) -> None:
    """Two results with the same tokens, finish reasons and stop sequences; log-probs within
    float rounding (the live-row ladder: a product over fewer rows may take another CPU
    kernel, which rounds the logits' last bits differently)."""
    assert torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.response_mask, b.response_mask)
    assert a.finish_reasons == b.finish_reasons
    assert a.stop_sequences == b.stop_sequences
    if a.logprobs is not None:
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def teacher_forced_logits(model, sequences, mask, new: int) -> torch.Tensor:
    """(B, new, V) logits that predicted each response token, from one full forward."""
    width = sequences.shape[1] - new
    full = torch.cat([mask, torch.ones_like(sequences[:, width:])], dim=1)
    positions = (full.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=full, position_ids=positions).logits
    return logits[:, width - 1 : -1].float()
