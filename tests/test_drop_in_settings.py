"""The drop-in resolves a call's settings exactly as ``generate`` does, over every field of
transformers' ``GenerationConfig``, in every place ``generate`` reads one from: a keyword, the
``generation_config`` passed, ``model.generation_config`` and the legacy ``model.config``.

For each field (listed from ``GenerationConfig`` itself, so a field transformers adds fails
here until it has a value) the drop-in either serves the call with ``generate``'s output, or
hands it to ``generate`` (same output, or the same error); serving it with a field ignored is
the bug this file exists to catch.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rollout_models import EOS, prompts, tiny_model
from test_drop_in import assert_same_output
from transformers import GenerationConfig

from graphcap.rollout import accelerate_generate, drop_in_default_config, restore_generate

#: the drop-in with generate's own random numbers, so sampled calls compare token for token
GENERATE_DRAWS = replace(drop_in_default_config(), draws="generate")

#: Non-default values per field (several where a value means something different: an empty
#: list, token id 0). Every field must be here: see test_every_field_has_values.
VALUES: dict[str, tuple[object, ...]] = {
    "max_length": (11,),
    "max_new_tokens": (5,),
    "min_length": (9,),
    "min_new_tokens": (3,),
    "early_stopping": (True,),
    "max_time": (60.0,),
    "stop_strings": (["ab"],),
    "do_sample": (True, False),
    "num_beams": (2,),
    "use_mtp": (True,),
    "use_cache": (False,),
    "cache_implementation": ("static",),
    "cache_config": ({"max_cache_len": 32},),
    "max_cache_len": (32,),
    "temperature": (0.7,),
    "top_k": (5, 0),
    "top_p": (0.8,),
    "min_p": (0.05,),
    "top_h": (0.5,),
    "typical_p": (0.8,),
    "epsilon_cutoff": (3e-4,),
    "eta_cutoff": (3e-4,),
    "repetition_penalty": (1.3,),
    "encoder_repetition_penalty": (1.3,),
    "length_penalty": (2.0,),
    "no_repeat_ngram_size": (2,),
    "bad_words_ids": ([[5]], []),
    "renormalize_logits": (True,),
    "forced_bos_token_id": (0, 5),
    "forced_eos_token_id": (5,),
    "remove_invalid_values": (True,),
    "exponential_decay_length_penalty": ((2, 1.5),),
    "suppress_tokens": ([5, 6], []),
    "begin_suppress_tokens": ([5],),
    "sequence_bias": ({(5,): -10.0},),
    "token_healing": (True,),
    "guidance_scale": (1.5,),
    "watermarking_config": ({"greenlist_ratio": 0.5},),
    "num_return_sequences": (2,),
    "output_attentions": (True,),
    "output_hidden_states": (True,),
    "output_scores": (True,),
    "output_logits": (True,),
    "return_dict_in_generate": (True,),
    "pad_token_id": (3,),
    "bos_token_id": (3,),
    "eos_token_id": (5, [5, EOS], []),
    "encoder_no_repeat_ngram_size": (2,),
    "decoder_start_token_id": (3,),
    "is_assistant": (True,),
    "num_assistant_tokens": (5,),
    "num_assistant_tokens_schedule": ("heuristic",),
    "assistant_confidence_threshold": (0.5,),
    "prompt_lookup_num_tokens": (3,),
    "max_matching_ngram_size": (2,),
    "assistant_early_exit": (1,),
    "assistant_lookbehind": (5,),
    "target_lookbehind": (5,),
    "assistant_ensemble_weight": (0.5,),
    "speculation_type": ("prompt_lookup",),
    "compile_config": ({"fullgraph": False},),
    "disable_compile": (True,),
    "continuous_batching_config": ({},),
    "low_memory": (True,),
    "penalty_alpha": (0.6,),
    "dola_layers": ("low",),
    "diversity_penalty": (0.5,),
    "num_beam_groups": (2,),
    "constraints": ([],),
    "force_words_ids": ([[5]],),
    "prefill_chunk_size": (2,),
}
#: Bookkeeping entries of ``to_dict()``, not settings.
NOT_SETTINGS = {"transformers_version"}
PLACES = ("keyword", "generation_config", "model.generation_config", "model.config")
BASES = {"greedy": {}, "sampled": {"do_sample": True}}


def fields() -> list[str]:
    return [
        k for k in GenerationConfig().to_dict() if not k.startswith("_") and k not in NOT_SETTINGS
    ]


def test_every_field_has_values():
    assert sorted(VALUES) == sorted(fields())


def outcome(call):
    """What a call gives: its output, or its error's type and message."""
    try:
        return call()
    except Exception as exc:  # generate's own refusals: the drop-in must raise the same
        return (type(exc), str(exc))


def place_setting(model, place: str, name: str, value: object, base: dict) -> dict:
    """Put ``name=value`` in ``place``; the keyword arguments the call then takes."""
    kwargs = dict(base)
    if "length" not in name and "new_tokens" not in name:
        kwargs["max_new_tokens"] = 4
    if place == "keyword":
        return kwargs | {name: value}
    if place == "generation_config":
        config = GenerationConfig()
        setattr(config, name, value)
        return {"generation_config": config} | kwargs
    target = model.generation_config if place == "model.generation_config" else model.config
    setattr(target, name, value)
    return kwargs


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("place", PLACES)
def test_every_generation_field_is_served_as_generate_or_handed_to_it(place, base):
    ids, mask = prompts(2, width=5)
    wrong = []
    for name in fields():
        for value in VALUES[name]:
            model = tiny_model("llama", fresh=True)
            try:
                kwargs = place_setting(model, place, name, value, BASES[base])
            except ValueError:  # the model config refuses it (output_attentions under sdpa)
                continue

            def call(model=model, kwargs=kwargs):
                return model.generate(ids, attention_mask=mask, **kwargs)

            torch.manual_seed(0)
            expected = outcome(call)
            accelerated = accelerate_generate(model, GENERATE_DRAWS)  # generate's numbers
            try:
                torch.manual_seed(0)
                got = outcome(call)
            finally:
                restore_generate(model)
            try:
                if isinstance(expected, tuple):
                    assert got == expected
                else:
                    assert_same_output(expected, got)
            except AssertionError:
                wrong.append((name, value, accelerated.stats.served))
    assert not wrong, f"served unlike generate (field, value, served): {wrong}"


@pytest.mark.parametrize("value", [False, True, None])
def test_use_model_defaults_goes_to_generate(value):
    """``use_model_defaults`` is not a setting this transformers knows (generate rejects it as
    a model input) or one graphcap resolves: never swallowed as neutral."""
    model = tiny_model("llama", fresh=True)
    model.generation_config.top_k = 3
    ids, mask = prompts(2)

    def call():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=4, do_sample=True, use_model_defaults=value
        )

    torch.manual_seed(0)
    expected = outcome(call)
    accelerated = accelerate_generate(model, GENERATE_DRAWS)  # generate's numbers
    try:
        torch.manual_seed(0)
        got = outcome(call)
    finally:
        restore_generate(model)
    if isinstance(expected, tuple):
        assert got == expected and accelerated.stats.served == 0
    else:
        assert_same_output(expected, got)
