"""Graph path == eager path == transformers generate(), token for token (fp32, CPU graphs)."""

from __future__ import annotations

import pytest
import torch
from rollout_models import (
    distinct_tokens_per_row,
    generate_padded,
    prompts,
    run,
    tiny_model,
)

from graphcap.cpu import CPUBackend

# A capture that falls back to eager would still produce equal tokens; make it loud instead.
pytestmark = pytest.mark.filterwarnings("error::graphcap.rollout.CaptureFallbackWarning")

NEW = 10
NO_EOS = {"eos_token_id": []}


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "opt"])
def test_greedy_graph_equals_eager_equals_generate(family, batch):
    model = tiny_model(family)
    ids, mask = prompts(batch, seed=batch)
    total = ids.shape[1] + NEW
    graph = run(model, ids, mask, graph=True, max_new_tokens=NEW, **NO_EOS)
    eager = run(model, ids, mask, graph=False, max_new_tokens=NEW, **NO_EOS)
    reference = generate_padded(
        model, ids, mask, total, max_new_tokens=NEW, do_sample=False, eos_token_id=None
    )
    assert graph.stats.path == "static_graph" and eager.stats.path == "eager"
    assert graph.stats.replays == NEW - 1
    assert distinct_tokens_per_row(graph, min_distinct=3)
    assert torch.equal(graph.sequences, eager.sequences)
    assert torch.equal(graph.sequences, reference)
    assert graph.response_lengths.tolist() == [NEW] * batch
    assert graph.finish_reasons == ["length"] * batch


SAMPLING_CASES = [
    {"temperature": 0.7},
    {"top_k": 5},
    {"top_p": 0.8, "temperature": 1.3},
    {"top_k": 20, "top_p": 0.9, "temperature": 0.8},
    {"repetition_penalty": 1.5, "top_k": 20},
    {"repetition_penalty": 0.7},
    {"min_new_tokens": 6, "top_k": 8},
]


def _generate_kwargs(case: dict) -> dict:
    kwargs = dict(case)
    kwargs["top_k"] = kwargs.get("top_k") or None  # unset = disabled, as in SamplingParams
    return kwargs


@pytest.mark.parametrize("draws", ["generate", "per_row"])
@pytest.mark.parametrize(
    "case", SAMPLING_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items())
)
def test_sampling_graph_equals_eager_equals_generate(case, draws):
    model = tiny_model("llama")
    # No left padding here: transformers 5.17 also penalises pad ids; graphcap does not.
    ids, mask = prompts(4, padded="repetition_penalty" not in case, seed=3)
    total = ids.shape[1] + NEW
    results = {}
    for graph in (True, False):
        torch.manual_seed(11)
        results[graph] = run(
            model, ids, mask, graph, draws=draws, do_sample=True, max_new_tokens=NEW, **case
        )
        results[graph, "rng"] = torch.get_rng_state()
    torch.manual_seed(11)
    reference = generate_padded(
        model, ids, mask, total, max_new_tokens=NEW, do_sample=True, **_generate_kwargs(case)
    )
    assert results[True].stats.path == "static_graph"
    assert torch.equal(results[True].sequences, results[False].sequences)
    assert torch.equal(results[True, "rng"], results[False, "rng"])
    # per-row draws: the same distribution from other random numbers
    assert torch.equal(results[True].sequences, reference) == (draws == "generate")
    width = ids.shape[1]
    assert len(set(results[True].sequences[:, width:].flatten().tolist())) > NEW


def test_min_new_tokens_blocks_eos_until_reached():
    model = tiny_model("llama")
    ids, mask = prompts(4, seed=3)
    width, total = ids.shape[1], ids.shape[1] + NEW
    probe = run(model, ids, mask, False, max_new_tokens=NEW, **NO_EOS)
    eos = int(probe.sequences[0, width + 2])  # row 0 emits it as its third token
    free = run(model, ids, mask, True, max_new_tokens=NEW, eos_token_id=eos)
    pinned = run(model, ids, mask, True, max_new_tokens=NEW, eos_token_id=eos, min_new_tokens=6)
    reference = generate_padded(
        model, ids, mask, total, max_new_tokens=NEW, eos_token_id=eos, min_new_tokens=6
    )
    assert free.response_lengths[0] == 3 and free.finish_reasons[0] == "eos"
    assert torch.equal(pinned.sequences, reference)
    assert not (pinned.sequences[:, width : width + 6] == eos).any()
    assert min(pinned.response_lengths.tolist()) >= 6


def test_sampling_with_explicit_generator_matches_eager():
    model = tiny_model("qwen2")
    ids, mask = prompts(3)
    outs = []
    for graph in (True, False):
        gen = torch.Generator().manual_seed(99)
        outs.append(
            run(
                model, ids, mask, graph, generator=gen, do_sample=True, max_new_tokens=NEW, top_k=10
            )
        )
        outs.append(gen.get_state())
    assert outs[0].stats.path == "static_graph"
    assert torch.equal(outs[0].sequences, outs[2].sequences)
    assert torch.equal(outs[1], outs[3])


def test_num_return_sequences_shares_prefill_and_matches_generate():
    model = tiny_model("gpt2")
    ids, mask = prompts(2, seed=4)
    total = ids.shape[1] + NEW
    sampling = {"do_sample": True, "max_new_tokens": NEW, "top_k": 10, "num_return_sequences": 3}
    torch.manual_seed(5)
    graph = run(model, ids, mask, True, draws="generate", **sampling)
    torch.manual_seed(5)
    eager = run(model, ids, mask, False, draws="generate", **sampling)
    torch.manual_seed(5)
    reference = generate_padded(
        model,
        ids,
        mask,
        total,
        max_new_tokens=NEW,
        do_sample=True,
        top_k=10,
        num_return_sequences=3,
    )
    assert graph.sequences.shape == (6, total)
    assert torch.equal(graph.sequences, eager.sequences)
    assert torch.equal(graph.sequences, reference)
    # the three samples of a prompt share its prompt but not their continuation
    assert torch.equal(graph.sequences[0, : ids.shape[1]], graph.sequences[2, : ids.shape[1]])
    assert len({tuple(r) for r in graph.sequences[:3, ids.shape[1] :].tolist()}) == 3


@pytest.mark.parametrize(
    "family_kwargs",
    [
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
        ("mistral", {"sliding_window": 4}),
    ],
    ids=["qwen2-mixed-layer-types", "mistral-window"],
)
def test_sliding_window_models_match_generate(family_kwargs):
    family, kwargs = family_kwargs
    model = tiny_model(family, **kwargs)
    windowless = tiny_model(family)
    ids, mask = prompts(3, width=7)
    total = ids.shape[1] + NEW
    graph = run(model, ids, mask, True, max_new_tokens=NEW, **NO_EOS)
    reference = generate_padded(
        model, ids, mask, total, max_new_tokens=NEW, do_sample=False, eos_token_id=None
    )
    assert graph.stats.path == "static_graph"
    assert torch.equal(graph.sequences, reference)
    # the window really matters for these prompts (a full-attention mask would be wrong)
    full = run(windowless, ids, mask, True, max_new_tokens=NEW, **NO_EOS)
    assert not torch.equal(full.sequences, graph.sequences)


class BoolMaskBackend(CPUBackend):
    """The CPU reference backend asking for boolean masks (as an NPU fused kernel does)."""

    mask_form = "bool"


def test_bool_mask_form_is_honoured():
    model = tiny_model("llama")
    ids, mask = prompts(3)
    backend = BoolMaskBackend()
    result = run(model, ids, mask, True, backend=backend, max_new_tokens=NEW, **NO_EOS)
    eager = run(model, ids, mask, False, max_new_tokens=NEW, **NO_EOS)
    assert result.stats.path == "static_graph"
    assert torch.equal(result.sequences, eager.sequences)


def test_logprobs_are_those_of_the_chosen_tokens():
    model = tiny_model("llama")
    ids, mask = prompts(3)
    graph = run(model, ids, mask, True, max_new_tokens=NEW, return_logprobs=True, **NO_EOS)
    eager = run(model, ids, mask, False, max_new_tokens=NEW, return_logprobs=True, **NO_EOS)
    assert torch.equal(graph.logprobs, eager.logprobs)
    # recompute with one full forward over prompt + response (greedy: plain log_softmax)
    seq = graph.sequences
    full_mask = torch.cat([mask, torch.ones(3, NEW, dtype=mask.dtype)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=full_mask, position_ids=positions).logits
    width = ids.shape[1]
    logp = torch.log_softmax(logits[:, width - 1 : -1].float(), dim=-1)
    expected = logp.gather(2, seq[:, width:, None]).squeeze(2)
    torch.testing.assert_close(graph.logprobs, expected, atol=1e-4, rtol=1e-4)
    assert run(model, ids, mask, True, max_new_tokens=2).logprobs is None
