"""Trainer-exact rollouts (issue 53): every recorded log-prob equals the trainer's bit for bit.

The trainer's side is a full-sequence forward under ``graphcap.rollout.trainer_exact`` and
``token_logprobs``; the rollout's is the engine with ``RolloutConfig(trainer_exact=True)`` on
every path. A row's values depend on neither its batch, slot, padding, sample count nor path:
each is compared with the trainer's, whose own batch and padding are varied too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from graphcap.cpu.backend import CPUBackend
from graphcap.exact_ops import forward_scope, per_forward
from graphcap.rollout import (
    RolloutConfig,
    RolloutEngine,
    SamplingParams,
    accelerate_generate,
    restore_generate,
    token_logprobs,
    trainer_exact,
)
from graphcap.rollout.exact import exact_ops_of
from graphcap.tiny_models import PAD, prompts, tiny_model

#: family -> config overrides: mistral slides a window shorter than a call; qwen3's MLP width
#: leaves a vectorised loop a tail (SiLU rounded its tail differently from its body)
FAMILIES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"intermediate_size": 100},
    "mistral": {"sliding_window": 5},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PATHS = {
    "eager": RolloutConfig(trainer_exact=True),
    "static_graph": RolloutConfig(trainer_exact=True, enable_graph_capture=True),
    "continuous_graph": RolloutConfig(
        trainer_exact=True, enable_graph_capture=True, continuous_batch_size=3
    ),
}
TEMPERATURE = 0.7


class NoExactOps(CPUBackend):
    """A backend that offers no trainer-exact operations."""

    def exact_ops(self) -> None:
        return None


def model_of(family: str, dtype: str) -> torch.nn.Module:
    return tiny_model(family, **FAMILIES[family]).to(DTYPES[dtype])


def sampling(mode: str, new: int = 10, **fields: object) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=new,
        do_sample=True,
        temperature=TEMPERATURE,
        return_logprobs=True,
        logprobs_mode=mode,
        **{"seed": 11} | fields,
    )


def rows_of(sequences: torch.Tensor, response: torch.Tensor, width: int) -> list[list[int]]:
    """Each row's real tokens: its prompt without padding, then its response."""
    out = []
    for row, mask in zip(sequences.tolist(), response.tolist(), strict=True):
        prompt = [t for t in row[:width] if t != PAD]
        out.append(prompt + [t for t, m in zip(row[width:], mask, strict=False) if m])
    return out


def trainer_logprobs(
    model: torch.nn.Module, rows: list[list[int]], responses: list[int], side: str, temp: float
) -> list[torch.Tensor]:
    """The trainer's per-token log-probs of each row's last ``responses[i]`` tokens, from one
    batch padded on ``side`` (``"alone"``: each row its own batch, no padding)."""
    if side == "alone":
        return [
            trainer_logprobs(model, [row], [n], "right", temp)[0]
            for row, n in zip(rows, responses, strict=True)
        ]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        at = slice(0, len(row)) if side == "right" else slice(width - len(row), width)
        ids[i, at], mask[i, at] = torch.tensor(row), 1
    with trainer_exact(model):
        logits = model(ids, attention_mask=mask).logits
    out = []
    for i, (row, n) in enumerate(zip(rows, responses, strict=True)):
        end = len(row) if side == "right" else width
        cut = slice(end - n - 1, end - 1)
        out.append(token_logprobs(logits[i, cut], ids[i, end - n : end], temp).detach())
    return out


def recorded(result: object) -> list[torch.Tensor]:
    """The rollout's log-probs of each row's response tokens."""
    return [lp[m.bool()] for lp, m in zip(result.logprobs, result.response_mask, strict=True)]


def assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for row, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"row {row}: max |Δlogp| {(a - b).abs().max():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_rollout_logprobs_equal_the_trainers_bit_for_bit(family, path, dtype):
    """Every path, at temperature 1 ("raw") and the call's ("temperature"); two samples per
    prompt, left-padded prompts, rows ending at EOS (the ladder moves live rows); the trainer
    left-padded, right-padded and one row at a time."""
    model = model_of(family, dtype)
    engine = RolloutEngine(model, PATHS[path])
    ids, mask = prompts(5, 7)
    for mode, temp in (("raw", 1.0), ("temperature", TEMPERATURE)):
        result = engine.generate(ids, mask, sampling(mode, num_return_sequences=2))
        assert result.stats.attention == "graphcap_exact"
        rows = rows_of(result.sequences, result.response_mask, ids.shape[1])
        lengths = result.response_lengths.tolist()
        got = recorded(result)
        for side in ("left", "right", "alone"):
            assert_bitwise(got, trainer_logprobs(model, rows, lengths, side, temp))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_logprobs_do_not_depend_on_its_batch_padding_samples_or_path(dtype):
    """One seeded prompt alone with extra left padding, in a batch of others, as one of four
    samples, on the eager, graph and continuous paths: the same tokens and log-probs."""
    model = model_of("llama", dtype)
    ids, mask = prompts(4, 7)
    padded = torch.cat([torch.full((1, 5), PAD), ids[1:2]], dim=1)
    padded_mask = torch.cat([torch.zeros(1, 5, dtype=mask.dtype), mask[1:2]], dim=1)
    params = [sampling("raw", new=12, min_new_tokens=12, seed=100 + i) for i in range(4)]
    seen = []
    for config in PATHS.values():
        engine = RolloutEngine(model, config)
        batch = engine.generate(ids, mask, params)
        alone = engine.generate(padded, padded_mask, params[1])
        many = engine.generate(
            ids[1:2], mask[1:2], dataclasses.replace(params[1], num_return_sequences=4)
        )
        seen += [recorded(batch)[1], recorded(alone)[0], recorded(many)[0]]
        tokens = [batch.sequences[1, 7:], alone.sequences[0, 12:], many.sequences[0, 7:]]
        assert all(torch.equal(t, tokens[0]) for t in tokens)
    assert all(torch.equal(s, seen[0]) for s in seen)


def test_the_sampled_tokens_follow_the_recorded_distribution():
    """512 samples of one prompt's first token: their mean recorded log-prob is minus the
    entropy of the recorded distribution (within 5 standard errors), and a greedy call picks
    the trainer's argmax at every position."""
    model = model_of("llama", "fp32")
    engine = RolloutEngine(model, PATHS["eager"])
    ids, mask = prompts(1, 7)
    result = engine.generate(ids, mask, sampling("temperature", new=1, num_return_sequences=512))
    with trainer_exact(model):
        logits = model(ids, attention_mask=mask).logits[0, -1]
    vocab = logits.shape[-1]
    dist = token_logprobs(logits.expand(vocab, -1), torch.arange(vocab), TEMPERATURE).detach()
    first = result.logprobs[:, 0]
    assert torch.equal(first, dist[result.sequences[:, 7]])
    entropy = -(dist.exp() * dist).sum()
    spread = (dist.exp() * dist.square()).sum() - entropy.square()
    assert abs(first.mean() + entropy) < 5 * math.sqrt(spread / 512)

    greedy = engine.generate(ids, mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with trainer_exact(model):
        logits = model(greedy.sequences).logits[0, 6:-1]
    assert torch.equal(greedy.sequences[0, 7:], logits.argmax(-1))


def policy_gradients(dtype: str, exact: bool) -> torch.Tensor:
    """The gradients of a policy-gradient-shaped loss (minus the tokens' log-probs), flat."""
    model = model_of("mistral", dtype)
    ids, mask = prompts(3, 12)
    with trainer_exact(model) if exact else contextlib.nullcontext():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(ids, attention_mask=mask, position_ids=positions).logits
    logp = token_logprobs(logits[:, :-1], ids[:, 1:])
    (-(logp * mask[:, 1:]).sum()).backward()
    return torch.cat([p.grad.float().flatten() for p in model.parameters()])


def test_gradients_under_trainer_exact_agree_with_the_default_forward():
    """The loss backpropagates through the exact forward. fp32: its gradients equal the
    default forward's within float rounding. bf16: they are as close to the fp32 gradients as
    the default bf16 forward's are (both about 9% apart on this tiny random model)."""
    reference = policy_gradients("fp32", exact=False)

    def error(g: torch.Tensor) -> float:
        return float((g - reference).norm() / reference.norm())

    assert error(policy_gradients("fp32", exact=True)) < 1e-5
    assert error(policy_gradients("bf16", exact=True)) < 1.25 * error(
        policy_gradients("bf16", exact=False)
    )


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointed_layers_recompute_the_exact_forward_in_backward(reentrant):
    """transformers' gradient checkpointing recomputes each layer in backward, after the
    ``trainer_exact`` block has ended: the recomputation runs under it again, so the gradients
    are the unchecked forward's, bit for bit, and the layers keep their own checkpoint
    function afterwards."""

    def gradients(checkpointed: bool) -> torch.Tensor:
        model = model_of("llama", "fp32").train()
        if checkpointed:
            kwargs = {"use_reentrant": reentrant}
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        own = [vars(m).get("_gradient_checkpointing_func") for m in model.modules()]
        ids, mask = prompts(3, 8)
        with trainer_exact(model):
            logits = model(ids, attention_mask=mask).logits
        assert [vars(m).get("_gradient_checkpointing_func") for m in model.modules()] == own
        (-(token_logprobs(logits[:, :-1], ids[:, 1:]) * mask[:, 1:]).sum()).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    assert torch.equal(gradients(checkpointed=True), gradients(checkpointed=False))


def test_the_drop_in_serves_trainer_exact_calls_and_hands_generate_the_same_forward():
    """``accelerate_generate`` in exact mode: a served call's logits and a call handed to
    ``generate`` (graphs off) both give the trainer's log-probs bit for bit."""
    model = model_of("qwen2", "bf16")
    ids, mask = prompts(3, 6)
    for graphs in (True, False):
        config = RolloutConfig(trainer_exact=True, enable_graph_capture=graphs)
        installed = accelerate_generate(model, config)
        try:
            with pytest.warns(UserWarning) if not graphs else contextlib.nullcontext():
                out = model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=6,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=PAD,
                )
            assert installed.stats.served == int(graphs)
        finally:
            restore_generate(model)
        new = out.sequences[:, 6:]
        logits = torch.stack(out.logits, 1)
        got = token_logprobs(logits, new)
        full = torch.cat([mask, torch.ones_like(new)], dim=1)
        with trainer_exact(model):
            want = model(out.sequences, attention_mask=full).logits[:, 5:-1]
        assert torch.equal(got, token_logprobs(want, new).detach())


def test_models_and_settings_trainer_exact_cannot_serve_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="llama, mistral, qwen2, qwen3"):
        RolloutEngine(tiny_model("gpt2"), RolloutConfig(trainer_exact=True))
    with pytest.raises(ValueError, match="families"), trainer_exact(tiny_model("opt")):
        pass
    for field in ("compile", "fuse_projections"):
        with pytest.raises(ValueError, match=f"{field}=True"):
            RolloutConfig(trainer_exact=True, enable_graph_capture=True, **{field: True})
    with pytest.raises(ValueError, match="graph_attention"):
        RolloutConfig(trainer_exact=True, graph_attention="sdpa")
    with pytest.raises(ValueError, match="offers no trainer-exact operations"):
        exact_ops_of(NoExactOps())
    with pytest.raises(ValueError, match="offers no trainer-exact operations"):
        RolloutEngine(tiny_model("llama"), RolloutConfig(trainer_exact=True, backend=NoExactOps()))


def test_trainer_exact_restores_the_models_own_forward():
    model = tiny_model("llama")
    ids, mask = prompts(2, 6)
    before = model(ids, attention_mask=mask).logits
    with trainer_exact(model):
        assert model.config._attn_implementation == "graphcap_exact"
    assert model.config._attn_implementation == "sdpa"
    assert not any("forward" in vars(m) for m in model.modules())
    assert torch.equal(model(ids, attention_mask=mask).logits, before)
    assert F.silu is torch.nn.functional.silu


def test_per_forward_keeps_a_value_for_its_objects_until_the_forward_ends():
    """Once per forward scope for the same objects and details; again for other objects,
    other details, a later scope, and every time outside one."""
    calls = []

    def compute():
        calls.append(1)
        return len(calls)

    mask, other = torch.ones(2), torch.ones(2)
    assert per_forward((mask,), 1, compute) == 1 and per_forward((mask,), 1, compute) == 2
    with forward_scope():
        assert per_forward((mask, None), 1, compute) == 3
        assert per_forward((mask, None), 1, compute) == 3
        assert per_forward((other, None), 1, compute) == 4
        assert per_forward((mask, None), 2, compute) == 5
    with forward_scope():
        assert per_forward((mask, None), 1, compute) == 6
    assert per_forward((mask, None), 1, compute) == 7
