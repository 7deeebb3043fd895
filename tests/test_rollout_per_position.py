"""Per-position graph path: token equality with eager / static / generate, reuse, recapture on a
new prompt width, unpinned-length fallback, attention over written columns only, and capture
failure finishing the call eagerly (CPU reference backend, tiny fp32 models)."""

from __future__ import annotations

import warnings

import pytest
import torch
from fakes import FailingCaptureBackend
from rollout_models import (
    distinct_tokens_per_row,
    generate_padded,
    make_engine,
    prompts,
    run,
    tiny_model,
)
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from graphcap.rollout import CaptureFallbackWarning, RolloutConfig, RolloutEngine, SamplingParams

NEW = 7
PINNED = {"max_new_tokens": NEW, "min_new_tokens": NEW}


def per_position_engine(model, backend=None, **config) -> RolloutEngine:
    return make_engine(model, True, backend, per_position_graphs=True, **config)


def per_position_run(model, ids, mask, draws="per_row", **sampling):
    engine = per_position_engine(model, draws=draws)
    result = engine.generate(ids, mask, SamplingParams(**sampling))
    engine.shutdown()
    return result


@pytest.mark.filterwarnings("error::graphcap.rollout.CaptureFallbackWarning")
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_per_position_equals_eager_static_and_generate(family, batch):
    model = tiny_model(family)
    ids, mask = prompts(batch, seed=batch)
    total = ids.shape[1] + NEW
    per_position = per_position_run(model, ids, mask, **PINNED)
    static = run(model, ids, mask, True, **PINNED)
    eager = run(model, ids, mask, False, **PINNED)
    reference = generate_padded(model, ids, mask, total, do_sample=False, **PINNED)
    stats = per_position.stats
    assert stats.path == "per_position_graph" and stats.fallback_reason is None
    assert stats.captures == NEW - 1 and stats.replays == stats.steps == NEW - 1
    assert static.stats.path == "static_graph"
    assert distinct_tokens_per_row(per_position, min_distinct=3)
    assert torch.equal(per_position.sequences, eager.sequences)
    assert torch.equal(per_position.sequences, static.sequences)
    assert torch.equal(per_position.sequences, reference)


@pytest.mark.filterwarnings("error::graphcap.rollout.CaptureFallbackWarning")
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sampled_per_position_equals_eager_static_and_generate(family):
    model = tiny_model(family)
    ids, mask = prompts(3, seed=5)
    total = ids.shape[1] + NEW
    sampling = {"do_sample": True, "top_k": 20, "temperature": 0.9, **PINNED}
    outs, rng = {}, {}
    for path in ("per_position", "static", "eager"):
        torch.manual_seed(7)
        if path == "per_position":  # generate's own random numbers, to compare with generate
            outs[path] = per_position_run(model, ids, mask, draws="generate", **sampling)
        else:
            outs[path] = run(model, ids, mask, path == "static", draws="generate", **sampling)
        rng[path] = torch.get_rng_state()
    torch.manual_seed(7)
    reference = generate_padded(model, ids, mask, total, **sampling)
    assert outs["per_position"].stats.path == "per_position_graph"
    for path in ("static", "eager"):
        assert torch.equal(outs["per_position"].sequences, outs[path].sequences), path
        assert torch.equal(rng["per_position"], rng[path]), path
    assert torch.equal(outs["per_position"].sequences, reference)
    assert len(set(outs["per_position"].sequences[:, ids.shape[1] :].flatten().tolist())) > NEW


@pytest.mark.filterwarnings("error::graphcap.rollout.CaptureFallbackWarning")
def test_same_signature_replays_and_new_prompt_width_recaptures():
    model = tiny_model("llama")
    # one length bucket: widths 6 and 7 give the same graph signature (total length 16)
    engine = per_position_engine(model, length_buckets=(16,))
    ids, mask = prompts(3, width=6)
    first = engine.generate(ids, mask, SamplingParams(**PINNED))
    again = engine.generate(ids, mask, SamplingParams(**PINNED))
    assert first.stats.captured and first.stats.captures == NEW - 1
    assert not again.stats.captured and again.stats.captures == NEW - 1
    assert again.stats.capture_s == 0.0 and again.stats.recapture_reason == []
    assert again.stats.replays == again.stats.steps == NEW - 1
    assert torch.equal(again.sequences, first.sequences)

    # the static graph would serve this width too, but positions are absolute
    wide_ids, wide_mask = prompts(3, width=7, seed=4)
    wide = engine.generate(wide_ids, wide_mask, SamplingParams(**PINNED))
    assert wide.stats.path == "per_position_graph" and wide.stats.captured
    assert wide.stats.total_len == 16 and wide.stats.captures == 2 * (NEW - 1)
    assert wide.stats.recapture_reason == ["prompt_width"]
    eager = run(model, wide_ids, wide_mask, False, **PINNED)
    assert torch.equal(wide.sequences, eager.sequences)
    engine.shutdown()


@pytest.mark.filterwarnings("error::graphcap.rollout.CaptureFallbackWarning")
def test_unpinned_lengths_use_the_static_graph_with_the_reason():
    model = tiny_model("llama")
    ids, mask = prompts(3)
    engine = per_position_engine(model)
    result = engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW, min_new_tokens=2))
    assert result.stats.path == "static_graph"
    assert "min_new_tokens == max_new_tokens" in result.stats.fallback_reason
    assert result.stats.captures == 1
    eager = run(model, ids, mask, False, max_new_tokens=NEW, min_new_tokens=2)
    assert torch.equal(result.sequences, eager.sequences)
    # a pinned call on the same engine then takes the per-position path
    pinned = engine.generate(ids, mask, SamplingParams(**PINNED))
    assert pinned.stats.path == "per_position_graph" and pinned.stats.fallback_reason is None
    engine.shutdown()


def test_config_refuses_per_position_without_graphs_or_with_continuous():
    with pytest.raises(ValueError, match="enable_graph_capture"):
        RolloutConfig(per_position_graphs=True, enable_graph_capture=False)
    with pytest.raises(ValueError, match="continuous_batch_size"):
        RolloutConfig(enable_graph_capture=True, per_position_graphs=True, continuous_batch_size=2)


KEY_LENGTHS: list[int] = []


def _recording_sdpa(module, query, key, value, attention_mask, **kwargs):
    """sdpa that notes the key length it is given (Python runs at warm-up and capture only)."""
    KEY_LENGTHS.append(key.shape[-2])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("graphcap_recording_sdpa", _recording_sdpa)


@pytest.mark.filterwarnings("error::graphcap.rollout.CaptureFallbackWarning")
def test_each_position_attends_over_written_columns_only():
    model = tiny_model("llama", attn="graphcap_recording_sdpa")
    ids, mask = prompts(3)
    width, total, layers = ids.shape[1], ids.shape[1] + NEW, model.config.num_hidden_layers

    KEY_LENGTHS.clear()
    # the static cache, not the table, at the call's exact length
    static_engine = make_engine(model, kv_block_size=None, length_buckets=None)
    static = static_engine.generate(ids, mask, SamplingParams(**PINNED))
    static_engine.shutdown()
    assert set(KEY_LENGTHS[layers:]) == {total}  # after the prefill: the whole buffer

    engine = per_position_engine(model)
    KEY_LENGTHS.clear()
    result = engine.generate(ids, mask, SamplingParams(**PINNED))
    prefill, decode = KEY_LENGTHS[:layers], KEY_LENGTHS[layers:]
    assert prefill == [width] * layers
    # warm-up and capture of position p each run the model once: 2 * layers calls per position
    expected = [width + p + 1 for p in range(NEW - 1) for _ in range(2 * layers)]
    assert decode == expected
    assert torch.equal(result.sequences, static.sequences)

    KEY_LENGTHS.clear()
    engine.generate(ids, mask, SamplingParams(**PINNED))
    assert [width] * layers == KEY_LENGTHS  # replays run no Python: only the prefill noted
    engine.shutdown()


def test_failed_capture_mid_set_finishes_eagerly_and_stays_eager():
    model = tiny_model("llama")
    ids, mask = prompts(3)
    engine = per_position_engine(model, backend=FailingCaptureBackend(fail_at=3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = engine.generate(ids, mask, SamplingParams(**PINNED))
    assert [w.category for w in caught] == [CaptureFallbackWarning]
    assert result.stats.path == "eager"
    assert "planted capture failure" in result.stats.fallback_reason
    assert result.stats.replays == 2 and result.stats.steps == NEW - 1
    eager = run(model, ids, mask, False, **PINNED)
    assert torch.equal(result.sequences, eager.sequences)
    later = engine.generate(ids, mask, SamplingParams(**PINNED))
    assert later.stats.path == "eager" and later.stats.replays == 0
    assert torch.equal(later.sequences, eager.sequences)
    engine.shutdown()
