"""The two vocabularies a request arrives in: transformers' ``GenerationConfig`` and vLLM's names.

Vocabulary in, keyword dicts out: which fields map onto ``SamplingParams``, which are refused
(by name, with what to do instead) and which ask for nothing. Nothing here builds settings.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import GenerationConfig

#: GenerationConfig fields that map onto SamplingParams (same names, same meaning).
GENERATION_CONFIG_FIELDS: tuple[str, ...] = (
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "eos_token_id",
    "pad_token_id",
    "max_new_tokens",
    "min_new_tokens",
    "num_return_sequences",
    "min_p",
    "output_scores",
    "output_logits",
    "stop_strings",
)
#: Fields accepted and ignored because they cannot change a decoder-only continuation.
GENERATION_CONFIG_IGNORED: tuple[str, ...] = ("bos_token_id", "use_cache", "transformers_version")
#: vLLM SamplingParams names with graphcap's meaning under another name (``from_vllm`` and
#: ``generate``'s keyword overrides take them).
VLLM_ALIASES: dict[str, str] = {
    "n": "num_return_sequences",
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "logprobs": "return_logprobs",
}

#: vLLM's ``logprobs_mode`` values (an engine setting there; ``from_vllm`` takes it per request)
#: as graphcap's ``SamplingParams.logprobs_mode``: ``raw_logprobs`` (vLLM's default) is
#: log_softmax of the model's logits, before any penalty; ``processed_logprobs`` that of the
#: scores the token was drawn from (penalties, temperature, top-k, top-p, min-p applied).
VLLM_LOGPROBS_MODES: dict[str, str] = {"raw_logprobs": "raw", "processed_logprobs": "sampling"}
#: vLLM's default ``logprobs_mode``
VLLM_DEFAULT_LOGPROBS_MODE = "raw_logprobs"
#: vLLM's ``logprobs_mode`` values that return logits, which the per-step records hold instead
VLLM_LOGITS_MODES: dict[str, str] = {
    "raw_logits": "output_logits=True (every step's raw logits, result.logits)",
    "processed_logits": "output_scores=True (every step's processed scores, result.scores)",
}

#: What to do instead of a refused vLLM name, where there is something better than "remove it".
VLLM_INSTEAD: dict[str, str] = {
    "stop": (
        "stop strings need a tokenizer: SamplingParams.from_vllm(stop=[...], tokenizer=tok), "
        "or stop_sequences=[tok.encode(s, add_special_tokens=False), ...]"
    ),
    "prompt_logprobs": (
        "score the prompt (e.g. for a reference-model KL) with one forward of the model over "
        "result.sequences: log_softmax(model(sequences).logits[:, :-1]).gather(...)"
    ),
    "best_of": "use n (num_return_sequences) and pick on the host",
    "ignore_eos": "use eos_token_id=[], or SamplingParams.from_vllm(ignore_eos=True, ...)",
}
#: vLLM SamplingParams names with no counterpart here, each with the values that ask for
#: nothing (vLLM's "off", or what graphcap does anyway: it returns token ids, never text): those
#: are accepted and dropped, any other value is refused by name, never ignored.
VLLM_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "stop": (None, [], ()),
    "best_of": (None, 1),
    "ignore_eos": (False,),
    "prompt_logprobs": (None,),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "bad_words": (None, [], ()),
    "skip_special_tokens": (True, False),
    "spaces_between_special_tokens": (True, False),
    "detokenize": (False,),
    "logits_processors": (None, [], ()),
    "truncate_prompt_tokens": (None,),
    "guided_decoding": (None,),
    "structured_outputs": (None,),
    "output_kind": (None,),
    "extra_args": (None, {}),
}
#: The values transformers' ``generate`` gives the fields of a ``GenerationConfig`` left unset
#: (transformers keeps this table private; tests/test_drop_in.py fails when it drifts).
#: A field set to its value here changes nothing, so it is not refused.
GENERATE_DEFAULTS: dict[str, Any] = {
    "max_length": 20,
    "min_length": 0,
    "do_sample": False,
    "use_cache": True,
    "early_stopping": False,
    "num_beams": 1,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "typical_p": 1.0,
    "repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "num_return_sequences": 1,
    "output_scores": False,
    "return_dict_in_generate": False,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "remove_invalid_values": False,
    "exponential_decay_length_penalty": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "encoder_repetition_penalty": 1.0,
    "num_assistant_tokens": 20,
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.4,
    "assistant_lookbehind": 10,
    "target_lookbehind": 10,
    "num_beam_groups": 1,
    "diversity_penalty": 0.0,
}
#: generate() applies top_k=50 when sampling and top_k is unset; mirrored here.
GENERATE_DEFAULT_TOP_K: int = GENERATE_DEFAULTS["top_k"]

#: Warpers whose values differ in meaning between transformers (greedy unless do_sample) and
#: vLLM (sampling unless temperature is 0), with the value that means "off" in both.
WARPER_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "temperature": (1.0, 0.0),
    "top_p": (1.0,),
    "top_k": (None, 0),
    "min_p": (0.0,),
}


def stop_string_sequences(stop: str | Sequence[str], tokenizer: Any) -> list[list[int]]:
    """Each stop string's token ids (``tokenizer.encode``, no special tokens)."""
    strings = [stop] if isinstance(stop, str) else list(stop)
    if tokenizer is None:
        raise ValueError(
            f"stop strings {strings!r} need a tokenizer to become token sequences: pass "
            "tokenizer=... (the engine itself stays tokenizer-free), or give "
            "stop_sequences=[tokenizer.encode(s, add_special_tokens=False), ...]"
        )
    if not all(isinstance(text, str) and text for text in strings):
        raise ValueError(f"stop strings must be non-empty strings, got {strings!r}")
    return [list(tokenizer.encode(text, add_special_tokens=False)) for text in strings]


def check_warpers_have_do_sample(keywords: dict[str, Any], decided: bool = False) -> None:
    """Refuse warpers set without ``do_sample`` (unless ``decided`` elsewhere): transformers would
    decode greedily, vLLM would sample, so either reading is a silent surprise for someone."""
    if "do_sample" in keywords or decided:
        return
    set_ = sorted(
        k for k, off in WARPER_NEUTRAL.items() if k in keywords and keywords[k] not in off
    )
    if set_:
        given = ", ".join(f"{k}={keywords[k]!r}" for k in set_)
        raise ValueError(
            f"{given} without do_sample is ambiguous: transformers decodes greedily, vLLM "
            "samples. Say do_sample=True to sample (do_sample=False for greedy), or use "
            f"SamplingParams.from_vllm({given}, ...) for vLLM's meaning"
        )


def vllm_keywords(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Constructor keywords with vLLM's one-to-one names translated, vLLM's names at values that
    ask for nothing dropped, the rest of vLLM's refused (each with what to do instead)."""
    if "max_tokens" in kwargs and kwargs["max_tokens"] is None:
        raise ValueError(
            "max_tokens=None (vLLM: up to the model's context) is not supported: graphcap "
            "sizes a call's buffers by its token budget; give max_tokens=N (at most the "
            "model's max_position_embeddings minus the prompt width)"
        )
    neutral = [k for k in kwargs if k in VLLM_UNSUPPORTED and _neutral(k, kwargs[k])]
    kwargs = {k: v for k, v in kwargs.items() if k not in neutral}
    refused = sorted(k for k in kwargs if k in VLLM_UNSUPPORTED)
    if refused:
        instead = "; ".join(f"{k}: {VLLM_INSTEAD[k]}" for k in refused if k in VLLM_INSTEAD)
        raise ValueError(
            f"SamplingParams does not support vLLM's {refused}"
            + (f" ({instead})" if instead else "; remove them")
            + f". vLLM names it accepts: {sorted(VLLM_ALIASES)}, stop_token_ids, seed, min_p, "
            "presence_penalty, frequency_penalty, include_stop_str_in_output and the shared "
            "sampling fields"
        )
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        name = VLLM_ALIASES.get(key, key)
        if name in out:
            raise ValueError(f"both {name!r} and its vLLM alias were given; set only one")
        if key == "logprobs":
            out[name] = value is not None and value is not False
            if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0:
                out["top_logprobs"] = value
        else:
            out[name] = value
    return out


def vllm_logprobs_mode(mode: str) -> str:
    """vLLM's ``logprobs_mode`` as graphcap's (graphcap's own names pass as they are); the
    logits modes are refused with the record that holds them."""
    if mode in VLLM_LOGITS_MODES:
        raise ValueError(
            f"logprobs_mode={mode!r} returns logits where graphcap returns log-probs: use "
            f"{VLLM_LOGITS_MODES[mode]}, or logprobs_mode='raw_logprobs' / 'processed_logprobs'"
        )
    return VLLM_LOGPROBS_MODES.get(mode, mode)


def _neutral(name: str, value: Any) -> bool:
    """Whether vLLM's ``name`` at ``value`` asks for nothing (:data:`VLLM_UNSUPPORTED`)."""
    return any(type(value) is type(off) and value == off for off in VLLM_UNSUPPORTED[name])


def unsupported_generation_fields(config: GenerationConfig) -> list[str]:
    """Names of the fields ``config`` sets that graphcap neither maps nor may ignore."""
    return sorted(
        k
        for k, v in config.to_diff_dict().items()
        if not k.startswith("_")
        and k not in GENERATION_CONFIG_IGNORED
        and k not in GENERATION_CONFIG_FIELDS
        and not _is_default(k, v)
    )


def _is_default(name: str, value: Any) -> bool:
    """Whether a GenerationConfig value means "not set": its default, the value ``generate``
    applies when it is unset (:data:`GENERATE_DEFAULTS`), or False where the default is
    ``None`` (model configs write ``output_attentions=False``). Not 0 or an empty list: token
    id 0 is a token, and ``generate`` refuses ``bad_words_ids=[]``."""
    from transformers import GenerationConfig

    default = getattr(GenerationConfig(), name, None)
    return value in (default, GENERATE_DEFAULTS.get(name, default)) or (
        default is None and value is False
    )
