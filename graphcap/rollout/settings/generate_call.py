"""How a ``generate()`` call's settings resolve, as ``generate`` resolves them: what the drop-in
(:mod:`graphcap.rollout.drop_in`) reads before it serves a call.

The ``generation_config`` passed (else a blank one), its unset fields from
``model.generation_config``, keyword arguments on top, ``generate``'s defaults for what is still
unset (20 new tokens, ``top_k`` 50 when sampling); lengths counted as ``generate`` counts them.
Each function returns the settings, or a string saying why ``generate`` must serve the call.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from transformers import GenerationConfig

from graphcap.rollout.settings.sampling_params import SamplingParams
from graphcap.rollout.settings.vocabulary import GENERATE_DEFAULTS, unsupported_generation_fields

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: GenerationConfig fields resolved here (lengths as generate counts them, the output's form)
#: or that cannot change the tokens (how generate would cache or compile).
RESOLVED_HERE: tuple[str, ...] = (
    "max_length",
    "min_length",
    "return_dict_in_generate",
    "disable_compile",
    "compile_config",
    "cache_implementation",
    "cache_config",
)
#: Beam-search settings, which ``generate`` ignores when ``num_beams`` is 1 (OpenRLHF passes
#: ``early_stopping=True`` to every sampled call).
BEAM_ONLY: tuple[str, ...] = ("early_stopping", "length_penalty")


def resolved_config(
    model: PreTrainedModel, generation_config: GenerationConfig | None, kwargs: dict[str, Any]
) -> tuple[GenerationConfig, dict[str, Any]] | str:
    """The settings ``generate`` would run with and the keyword arguments it would pass to the
    model, or why graphcap cannot serve them."""
    legacy = legacy_generation_settings(model)
    if generation_config is None and legacy:
        # transformers 5.x refuses these in generate; older releases honoured them: either
        # way, generate decides
        return f"generation settings on model.config, where generate treats them itself: {legacy}"
    config = copy.deepcopy(generation_config) if generation_config is not None else None
    if config is None:
        config = GenerationConfig()
    own = getattr(model, "generation_config", None)
    if own is not None:
        config.update(**own.to_dict(), defaults_only=True, allow_custom_entries=True)
    forward_kwargs = config.update(**kwargs)
    if not config.return_dict_in_generate:  # generate returns scores only in its output dict
        config.output_scores = config.output_logits = False
    ignored = RESOLVED_HERE + (BEAM_ONLY if (config.num_beams or 1) == 1 else ())
    refused = [n for n in unsupported_generation_fields(config) if n not in ignored]
    if refused:
        return f"GenerationConfig fields graphcap does not serve: {refused}"
    return config, forward_kwargs


def legacy_generation_settings(model: PreTrainedModel) -> list[str]:
    """Generation fields set on ``model.config`` (the legacy place) that its class does not set
    by default: what ``generate`` checks before it builds a blank ``GenerationConfig``."""
    found = getattr(model.config, "_get_generation_parameters", None)
    return sorted(found()) if callable(found) else []


def sampling_for(
    model: PreTrainedModel, config: GenerationConfig, width: int
) -> SamplingParams | str:
    """``config``'s settings for prompts ``width`` tokens wide, lengths counted as ``generate``
    counts them; or why they cannot run."""
    max_new, min_new = config.max_new_tokens, config.min_new_tokens
    if max_new is None and config.max_length is not None:
        max_new = config.max_length - width
    elif max_new is None:  # generate's default: 20 new tokens, within the model's positions
        limit = getattr(model.config, "max_position_embeddings", None)
        total = width + GENERATE_DEFAULTS["max_length"]
        max_new = (total if limit is None else min(total, limit)) - width
    if min_new is None:
        min_new = max(0, (config.min_length or 0) - width)
    if max_new < 1:
        return f"no tokens to generate (max_new_tokens {max_new} for {width}-token prompts)"
    config = copy.deepcopy(config)
    for name in RESOLVED_HERE + BEAM_ONLY:  # resolved above: the sampling fields are left
        if hasattr(config, name):
            setattr(config, name, None)
    config.max_new_tokens, config.min_new_tokens = int(max_new), min(int(min_new), int(max_new))
    try:
        return SamplingParams.from_generation_config(config)
    except ValueError as exc:
        return f"settings graphcap refuses: {exc}"
