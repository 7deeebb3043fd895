"""How sampled rows draw: per-row keyed streams (the default) and generate's own numbers.

``RolloutConfig.draws="per_row"`` keys every sampled row: its own seed, or one number drawn from
the shared generator per call plus its prompt index. These tests check that contract end to end
(graph == eager, one draw of the shared generator per call, a row equal to itself in any
batch), that the keyed draw samples the warped distribution, and that a step pays only for
what its rows use (no vocabulary sort without truncation, no ``multinomial`` without a row
that draws from the shared generator).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rollout_models import prompts, tiny_model

from graphcap.cpu import CPUBackend
from graphcap.cpu.torch_internals import TorchDispatchMode
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.rollout.sampling import RowSettings, SamplerShape, select

pytestmark = pytest.mark.filterwarnings("error::graphcap.rollout.CaptureFallbackWarning")

NEW = 8
NO_EOS = {"eos_token_id": []}


def engine_on(model, graph: bool = True, **config) -> RolloutEngine:
    config = RolloutConfig(enable_graph_capture=graph, backend=CPUBackend(), **config)
    return RolloutEngine(model, config)


def test_unseeded_rows_draw_their_own_stream_keyed_by_one_draw_of_the_shared_generator():
    model = tiny_model("llama")
    ids, mask = prompts(3, seed=4)
    params = SamplingParams(do_sample=True, max_new_tokens=NEW, **NO_EOS)
    results, states = {}, {}
    for graph in (True, False):
        torch.manual_seed(7)
        results[graph] = engine_on(model, graph).generate(ids, mask, params)
        states[graph] = torch.get_rng_state()
    assert results[True].stats.path == "static_graph"
    assert torch.equal(results[True].sequences, results[False].sequences)
    # the call took exactly one number from the shared generator: its key
    torch.manual_seed(7)
    key = int(torch.randint(0, 2**62, (1,)).item())
    assert torch.equal(torch.get_rng_state(), states[True])
    assert torch.equal(states[True], states[False])
    # prompt i drew the stream of seed key + i: alone, in another batch, it draws the same
    for row in range(3):
        alone = engine_on(model).generate(
            ids[row : row + 1],
            mask[row : row + 1],
            SamplingParams(do_sample=True, max_new_tokens=NEW, seed=key + row, **NO_EOS),
        )
        assert torch.equal(alone.sequences[0], results[True].sequences[row]), row
    # another seed of the shared generator, other tokens
    torch.manual_seed(8)
    other = engine_on(model).generate(ids, mask, params)
    assert not torch.equal(other.sequences, results[True].sequences)


def test_generate_draws_advance_the_shared_generator_as_generate_does():
    model = tiny_model("qwen2")
    ids, mask = prompts(2, seed=1)
    params = SamplingParams(do_sample=True, max_new_tokens=NEW, **NO_EOS)
    torch.manual_seed(3)
    engine_on(model, draws="generate").generate(ids, mask, params)
    after = torch.get_rng_state()
    torch.manual_seed(3)
    engine_on(model).generate(ids, mask, params)  # per row: one draw
    assert not torch.equal(torch.get_rng_state(), after)


def _ops(model, draws: str, **sampling) -> set[str]:
    """The aten operations one eager call issues."""
    seen: set[str] = set()

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    ids, mask = prompts(2, seed=5)
    params = SamplingParams(max_new_tokens=3, **NO_EOS, **sampling)
    engine = engine_on(model, graph=False, draws=draws)
    with Recorder():
        engine.generate(ids, mask, params)
    return seen


@pytest.mark.parametrize(
    ("draws", "sampling", "sorts", "multinomial"),
    [
        ("per_row", {"do_sample": True}, False, False),
        ("per_row", {"do_sample": True, "temperature": 0.6}, False, False),
        ("generate", {"do_sample": True}, False, True),
        ("per_row", {"do_sample": True, "seed": 3}, False, False),
        ("generate", {"do_sample": True, "seed": 3}, False, False),
        ("per_row", {}, False, False),
        # truncation finds each row's kept set with one sort (docs/decisions.md, 67)
        ("per_row", {"do_sample": True, "top_k": 5, "top_p": 0.8}, True, False),
        ("generate", {"do_sample": True, "top_k": 5, "min_p": 0.1}, True, True),
    ],
)
def test_a_step_pays_only_for_what_its_rows_use(draws, sampling, sorts, multinomial):
    """Only truncation sorts the vocabulary; only generate's own draw issues a
    ``multinomial``."""
    ops = _ops(tiny_model("llama"), draws, **sampling)
    assert ("sort" in ops) == sorts, sorted(ops)
    assert ("multinomial" in ops) == multinomial, sorted(ops)


@pytest.mark.parametrize(
    "setting",
    [
        {"temperature": 1.0},
        {"temperature": 0.5},
        {"temperature": 1.0, "top_k": 3},
        {"temperature": 1.0, "top_p": 0.6},
        {"temperature": 2.0, "min_p": 0.2},
    ],
)
def test_the_keyed_draw_samples_the_warped_distribution(setting):
    """Many rows with the same scores and their own keys: the keyed draw's frequencies follow
    generate's warped distribution, and never leave the kept set."""
    rows_n, vocab = 20000, 12
    torch.manual_seed(0)
    logits = torch.randn(vocab) * 1.5
    scores = logits.expand(rows_n, vocab).contiguous()
    params = SamplingParams(do_sample=True, seed=0, **setting)
    rows = RowSettings.allocate(rows_n, vocab, torch.device("cpu"))
    rows.write([params] * rows_n, list(range(rows_n)))
    rows.key.copy_(torch.randint(0, 2**32, (rows_n,)))  # independent streams
    shape = SamplerShape().widen([replace(params, return_logprobs=True)])  # the distribution
    assert shape.keyed and not shape.shared
    finished = torch.zeros(rows_n, dtype=torch.bool)
    chosen, drawn_from, _ = select(scores, rows, finished, torch.tensor(4), None, shape)
    expected = drawn_from[0].softmax(-1)
    counts = torch.bincount(chosen, minlength=vocab).double() / rows_n
    assert (counts[expected == 0] == 0).all()
    # total variation distance of 20,000 draws: well under 0.02 unless the draw is biased
    assert 0.5 * (counts - expected.double()).abs().sum() < 0.02, (counts, expected)
