"""RolloutConfig / SamplingParams validation, the GenerationConfig allow-list, bad input."""

from __future__ import annotations

import warnings

import pytest
import torch
from fakes import NoGraphBackend
from rollout_models import EOS, prompts, tiny_model
from transformers import GenerationConfig

from graphcap.backend import Backend
from graphcap.cpu import CPUBackend
from graphcap.errors import GraphUnsupportedModelError, WouldRunEagerlyError
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.rollout.settings import CallSettings, normalise_request
from graphcap.rollout.settings.rollout_config import GRAPHS_OFF


def test_the_default_engine_captures_where_the_backend_can_and_eager_calls_say_why():
    """``RolloutEngine(model)`` captures on the CPU reference backend; an engine with graphs
    off, or on a backend that cannot capture, runs eagerly and its stats name the reason."""
    assert RolloutConfig().enable_graph_capture is None
    model = tiny_model("llama")
    ids, mask = prompts(2)
    sampling = SamplingParams(max_new_tokens=5, eos_token_id=[])
    default = RolloutEngine(model).generate(ids, mask, sampling)
    assert default.stats.path == "static_graph" and default.stats.captured
    assert default.stats.fallback_reason is None
    off = RolloutEngine(model, RolloutConfig(enable_graph_capture=False))
    eager = off.generate(ids, mask, sampling)
    assert eager.stats.path == "eager" and eager.stats.fallback_reason == GRAPHS_OFF
    assert torch.equal(eager.sequences, default.sequences)
    no_graphs = RolloutEngine(model, RolloutConfig(backend=NoGraphBackend()))
    refused = no_graphs.generate(ids, mask, sampling)
    assert refused.stats.path == "eager" and "cannot capture" in refused.stats.fallback_reason
    assert torch.equal(refused.sequences, default.sequences)


def test_graph_unsafe_attention_is_a_reason_by_default_and_an_error_when_graphs_are_asked():
    """The default captures where the model allows: a model whose attention graphs cannot
    serve runs eagerly with the reason (asked with ``require_graph``, before anything runs);
    ``enable_graph_capture=True`` refuses it by name."""
    model = tiny_model("llama", fresh=True)
    # private: set_attn_implementation refuses flash_attention_2 without flash-attn installed
    model.config._attn_implementation = "flash_attention_2"
    ids, mask = prompts(2)
    with pytest.raises(WouldRunEagerlyError, match="flash_attention_2") as refused:
        RolloutEngine(model).generate(ids, mask, max_new_tokens=4, require_graph=True)
    assert "not graph-safe" in refused.value.reason
    with pytest.raises(GraphUnsupportedModelError, match="flash_attention_2"):
        RolloutEngine(model, RolloutConfig(enable_graph_capture=True)).generate(
            ids, mask, max_new_tokens=4
        )


def test_the_eager_layouts_run_eagerly_by_default_and_refuse_graphs_asked_for():
    config = RolloutConfig(continuous_batch_size=2, trim_cache=True)
    assert config.eager_layout == "trim_cache" and not config.wants_graphs(CPUBackend())
    model = tiny_model("llama")
    ids, mask = prompts(3)
    result = RolloutEngine(model, config).generate(ids, mask, max_new_tokens=4)
    assert result.stats.path == "continuous_eager"
    assert "trim_cache" in result.stats.fallback_reason
    with pytest.raises(ValueError, match="trim_cache"):
        RolloutConfig(continuous_batch_size=2, trim_cache=True, enable_graph_capture=True)
    with pytest.raises(ValueError, match="compile=True"):
        RolloutConfig(continuous_batch_size=2, trim_cache=True, compile=True)
    with pytest.raises(ValueError, match="per_position_graphs"):
        RolloutConfig(enable_graph_capture=False, per_position_graphs=True)


def test_enable_cuda_graph_alias_moves_value_with_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="enable_graph_capture"):
        config = RolloutConfig(enable_cuda_graph=True)
    assert config.enable_graph_capture is True
    assert config.enable_cuda_graph is None


def test_alias_agreeing_with_new_field_is_accepted():
    with pytest.warns(DeprecationWarning):
        config = RolloutConfig(enable_graph_capture=False, enable_cuda_graph=False)
    assert config.enable_graph_capture is False


def test_alias_conflicting_with_new_field_is_an_error():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match="conflicts"):
            RolloutConfig(enable_graph_capture=True, enable_cuda_graph=False)


def test_eos_check_interval_must_be_positive():
    with pytest.raises(ValueError, match="eos_check_interval"):
        RolloutConfig(eos_check_interval=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens"),
        ({"temperature": 0.0, "do_sample": True}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"num_return_sequences": 2}, "do_sample=True"),
    ],
)
def test_sampling_params_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_generation_config_maps_allowed_fields_and_generate_default_top_k():
    params = SamplingParams.from_generation_config(
        GenerationConfig(do_sample=True, max_new_tokens=7, temperature=0.5, eos_token_id=[3, 4])
    )
    assert params.do_sample and params.max_new_tokens == 7 and params.temperature == 0.5
    assert params.top_k == 50  # generate applies 50 when sampling and top_k is unset
    assert params.eos_ids == (3, 4)
    greedy = SamplingParams.from_generation_config(GenerationConfig(max_new_tokens=4))
    assert greedy.effective_top_k == 0 and not greedy.do_sample


@pytest.mark.parametrize("field", ["num_beams", "no_repeat_ngram_size", "typical_p"])
def test_generation_config_refuses_unsupported_field_by_name(field):
    value = {"num_beams": 2, "no_repeat_ngram_size": 2, "typical_p": 0.9}[field]
    config = GenerationConfig(max_new_tokens=4, **{field: value})
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_generation_config(config)


def test_generation_config_without_max_new_tokens_is_refused():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams.from_generation_config(GenerationConfig(max_length=30))


def test_model_generation_config_is_accepted():
    model = tiny_model("llama")
    config = GenerationConfig.from_model_config(model.config)
    config.max_new_tokens = 3
    assert SamplingParams.from_generation_config(config).eos_ids == (EOS,)


@pytest.fixture(scope="module")
def engine():
    return RolloutEngine(tiny_model("gpt2"), RolloutConfig(backend=CPUBackend()))


def test_mask_ids_shape_mismatch(engine):
    ids, mask = prompts(2)
    with pytest.raises(ValueError, match="does not match"):
        engine.generate(ids, mask[:, 1:])


def test_right_padding_is_refused(engine):
    ids, mask = prompts(2, padded=False)
    mask[0, -1] = 0
    with pytest.raises(ValueError, match="left padding"):
        engine.generate(ids, mask)


def test_empty_row_is_refused(engine):
    ids, mask = prompts(2, padded=False)
    mask[1] = 0
    with pytest.raises(ValueError, match="no tokens"):
        engine.generate(ids, mask)


def test_ids_must_be_2d(engine):
    ids, _ = prompts(2)
    with pytest.raises(ValueError, match="2-D"):
        engine.generate(ids[0])


def test_missing_pad_id_is_refused():
    model = tiny_model("gpt2", fresh=True)
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    engine = RolloutEngine(model, RolloutConfig(backend=CPUBackend()))
    ids, mask = prompts(2)
    with pytest.raises(ValueError, match="pad token id"):
        engine.generate(ids, mask, SamplingParams(max_new_tokens=2))
    # eos alone is enough: generate uses it as pad
    result = engine.generate(ids, mask, SamplingParams(max_new_tokens=2, eos_token_id=EOS))
    assert result.sequences.shape == (2, ids.shape[1] + 2)


def test_out_of_vocab_eos_is_refused(engine):
    ids, mask = prompts(2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate(ids, mask, SamplingParams(max_new_tokens=2, eos_token_id=10_000))


def test_unsupported_generation_config_is_refused_by_generate(engine):
    ids, mask = prompts(2)
    with pytest.raises(ValueError, match="num_beams"):
        engine.generate(ids, mask, GenerationConfig(max_new_tokens=2, num_beams=3))


def test_wrong_sampling_type_is_refused(engine):
    ids, mask = prompts(2)
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.generate(ids, mask, {"max_new_tokens": 2})


def test_model_on_another_device_than_backend_is_refused():
    class Elsewhere(Backend):
        name = "elsewhere"
        device_type = "meta"

        @property
        def device(self) -> torch.device:
            return torch.device("meta")

    engine = RolloutEngine(tiny_model("gpt2"), RolloutConfig(backend=Elsewhere()))
    ids, mask = prompts(1)
    with pytest.raises(ValueError, match="move the model"):
        engine.generate(ids, mask)


def test_backend_by_name_uses_registry():
    engine = RolloutEngine(tiny_model("gpt2"), RolloutConfig(backend="cpu"))
    assert engine.backend.name == "cpu"


def test_shutdown_engine_refuses_calls(engine):
    local = RolloutEngine(tiny_model("gpt2"), RolloutConfig(backend=CPUBackend()))
    local.shutdown()
    ids, mask = prompts(1)
    with pytest.raises(RuntimeError, match="shut down"):
        local.generate(ids, mask)


def test_eos_and_pad_defaults_resolve_like_generate():
    params = SamplingParams(max_new_tokens=2)
    assert params.resolved(eos_default=[5, 6], pad_default=7).pad_token_id == 7
    assert params.resolved(eos_default=[5, 6], pad_default=None).pad_token_id == 5
    explicit = SamplingParams(max_new_tokens=2, eos_token_id=9, pad_token_id=8)
    resolved = explicit.resolved(eos_default=5, pad_default=7)
    assert (resolved.eos_ids, resolved.pad_token_id) == ((9,), 8)


def test_generator_on_another_device_is_refused_clearly():
    class AcceleratorGenerator:  # stands in for a torch.Generator of a device absent here
        device = torch.device("cuda", 0)

    engine = RolloutEngine(tiny_model("gpt2"), RolloutConfig(backend=CPUBackend()))
    ids, mask = prompts(2)
    with pytest.raises(ValueError, match="generator is on cuda:0 but the backend samples on cpu"):
        engine.generate(
            ids, mask, SamplingParams(max_new_tokens=3), generator=AcceleratorGenerator()
        )


def test_buckets_are_refused_on_the_continuous_path():
    with pytest.raises(ValueError, match="do not apply to the continuous path"):
        RolloutConfig(continuous_batch_size=4, batch_buckets=(4, 8))


def test_a_calls_settings_are_resolved_once_per_row_into_rows_and_their_shared_settings(
    monkeypatch,
):
    model = tiny_model("gpt2")
    resolved = []
    real = SamplingParams.resolved

    def counted(self, *args):
        resolved.append(self)
        return real(self, *args)

    monkeypatch.setattr(SamplingParams, "resolved", counted)
    rows = [
        SamplingParams(max_new_tokens=4, min_new_tokens=3),
        SamplingParams(do_sample=True, temperature=0.5, seed=1, max_new_tokens=4),
    ]
    request = normalise_request(model, rows, {"max_tokens": 6})
    assert len(resolved) == len(rows)  # one pass over what the user passed
    call = request.call
    assert isinstance(call, CallSettings) and not isinstance(call, SamplingParams)
    assert call.any_sampled and call.min_new_tokens == 0 and call.max_new_tokens == 6
    assert call.eos_ids == (EOS,) and isinstance(call.pad_token_id, int)  # from the model
    per_prompt = request.per_prompt(2)
    assert [p.max_new_tokens for p in per_prompt] == [6, 6] and per_prompt[1].seed == 1
    with pytest.raises(ValueError, match="one per prompt row"):
        request.per_prompt(3)
    seeded = normalise_request(model, SamplingParams(do_sample=True, seed=5), {})
    assert [p.seed for p in seeded.per_prompt(3)] == [5, 6, 7]
    assert not normalise_request(model, None, {}).call.any_sampled
