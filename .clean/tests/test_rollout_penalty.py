"""The repetition penalty over the step's own buffers: written prompt and generated tokens only
(never left pad), per slot on the continuous path, graph == eager == generate."""

from __future__ import annotations

import pytest
import torch
from rollout_models import (
    PAD,
    assert_rows_equal_alone,
    generate_padded,
    make_engine,
    prompts,
    run,
    tiny_model,
)

from graphcap.rollout import SamplingParams

pytestmark = pytest.mark.filterwarnings("error::graphcap.rollout.CaptureFallbackWarning")

NEW = 8
NO_EOS = {"eos_token_id": []}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_greedy_penalty_with_logprobs_graph_equals_eager_equals_generate(family):
    model = tiny_model(family)
    ids, mask = prompts(4, seed=6, padded=False)  # generate penalises pad ids; graphcap does not
    settings = {"max_new_tokens": NEW, "repetition_penalty": 2.5}
    graph = run(model, ids, mask, True, return_logprobs=True, **settings, **NO_EOS)
    eager = run(model, ids, mask, False, return_logprobs=True, **settings, **NO_EOS)
    reference = generate_padded(
        model, ids, mask, ids.shape[1] + NEW, do_sample=False, eos_token_id=None, **settings
    )
    plain = run(model, ids, mask, False, max_new_tokens=NEW, **NO_EOS)
    assert graph.stats.path == "static_graph"
    assert torch.equal(graph.sequences, eager.sequences)
    assert torch.equal(graph.sequences, reference)
    assert not torch.equal(graph.sequences, plain.sequences)  # the penalty mattered
    torch.testing.assert_close(graph.logprobs, eager.logprobs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
def test_ids_only_in_left_padding_are_not_penalised(graph):
    model = tiny_model("llama")
    ids, mask = prompts(6, seed=4)  # rows 1, 2, 4, 5 are left-padded
    width = ids.shape[1]
    settings = {"max_new_tokens": NEW, "repetition_penalty": 50.0, **NO_EOS}
    clean = run(model, ids, mask, graph, **settings)
    # each padded row's pad slots now hold the token that row chooses first: penalising pad
    # slots would turn that choice away
    planted = ids.clone()
    first = clean.sequences[:, width]
    padded = mask == 0
    planted[padded] = first[:, None].expand_as(ids)[padded]
    assert padded.any(dim=1).sum() == 4 and not (ids[:, 1:][~padded[:, 1:]] == PAD).all()
    result = run(model, planted, mask, graph, **settings)
    assert torch.equal(result.sequences[:, width:], clean.sequences[:, width:])


def test_refilled_slot_penalises_its_own_request_only():
    """Two slots, six requests with different prompts and penalties: every request (its slot
    refilled after other requests) equals the same request decoded alone, graph and eager."""
    model = tiny_model("qwen2")
    ids, mask = prompts(6, seed=12)
    penalties = [3.0, 1.0, 0.6, 2.0, 1.0, 4.0]
    limits = [NEW, 3, 6, 2, NEW, 5]
    sampling = [
        SamplingParams(max_new_tokens=NEW, repetition_penalty=p, **NO_EOS) for p in penalties
    ]
    outs = {}
    for graph in (True, False):
        engine = make_engine(model, graph, continuous_batch_size=2, eos_check_interval=1)
        outs[graph] = engine.generate(ids, mask, sampling, request_max_new_tokens=limits)
        engine.shutdown()
    assert outs[True].stats.path == "continuous_graph" and outs[True].stats.slots_refilled == 4
    assert torch.equal(outs[True].sequences, outs[False].sequences)

    def penalty(row: int) -> dict:
        return {"repetition_penalty": penalties[row], **NO_EOS}

    assert_rows_equal_alone(model, ids, mask, outs[True], limits, penalty)
