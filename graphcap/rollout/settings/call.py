"""One call's sampling settings, normalised once: from what the user passed to what a step needs.

A call's settings arrive as a ``SamplingParams``, a ``GenerationConfig``, a list with one
``SamplingParams`` per prompt, or nothing (the model's generation config), with ``generate``'s
keyword overrides on top. :func:`normalise_request` reads them once, fills EOS and pad from the
model, and returns a :class:`RequestSettings`: the rows' resolved settings and the
:class:`CallSettings` they share, which the input checks, the plan and the paths read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeAlias

from transformers import GenerationConfig

from graphcap.errors import warn_once
from graphcap.rollout.settings.sampling_params import SamplingParams, override
from graphcap.rollout.settings.vocabulary import (
    GENERATION_CONFIG_FIELDS,
    unsupported_generation_fields,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Sampling: TypeAlias = "SamplingParams | GenerationConfig | Sequence[SamplingParams] | None"
#: Fields that shape the whole call: a per-row list must agree on them.
CALL_FIELDS: tuple[str, ...] = (
    "max_new_tokens",
    "num_return_sequences",
    "eos_token_id",
    "pad_token_id",
    "return_logprobs",
    "stop_token_ids",
    "output_scores",
    "output_logits",
    "stop_sequences",
    "include_stop_str_in_output",
    "top_logprobs",
)
#: What to do, beyond "give every row the same value", when rows differ in a call field.
CALL_FIELD_HINTS: dict[str, str] = {
    "num_return_sequences": (
        " (every prompt of a call gets n samples: run greedy evaluation rows and n > 1 sampled "
        "rows as two generate calls)"
    ),
}


@dataclass(frozen=True)
class CallSettings:
    """What a call's rows share: the lengths, ids and outputs that shape the whole call.

    Not a row's settings (those are per-row :class:`SamplingParams`): ``any_sampled`` says
    whether some row samples, ``min_new_tokens`` is the smallest of the rows'; every other
    field is one the rows agree on (:data:`CALL_FIELDS`).
    """

    any_sampled: bool
    min_new_tokens: int
    max_new_tokens: int
    num_return_sequences: int
    eos_ids: tuple[int, ...]
    pad_token_id: int
    stop_ids: tuple[int, ...]  # the EOS ids, then the stop token ids
    stop_sequences: tuple[tuple[int, ...], ...]
    include_stop_str_in_output: bool
    return_logprobs: bool
    top_logprobs: int
    output_scores: bool
    output_logits: bool

    @classmethod
    def of(cls, rows: Sequence[SamplingParams]) -> CallSettings:
        """The settings shared by ``rows`` (resolved, agreeing on :data:`CALL_FIELDS`)."""
        first = rows[0]
        return cls(
            any_sampled=any(r.do_sample for r in rows),
            min_new_tokens=min(r.min_new_tokens for r in rows),
            max_new_tokens=first.max_new_tokens,
            num_return_sequences=first.num_return_sequences,
            eos_ids=first.eos_ids,
            pad_token_id=int(first.pad_token_id),
            stop_ids=first.stop_ids,
            stop_sequences=first.stop_sequences or (),
            include_stop_str_in_output=first.include_stop_str_in_output,
            return_logprobs=first.return_logprobs,
            top_logprobs=first.top_logprobs,
            output_scores=first.output_scores,
            output_logits=first.output_logits,
        )


@dataclass(frozen=True)
class RequestSettings:
    """A call's settings after :func:`normalise_request`: ``call``, what its rows share, and
    ``given``, the resolved settings as given (one for every prompt, or one per prompt)."""

    call: CallSettings
    given: SamplingParams | tuple[SamplingParams, ...]

    def per_prompt(self, prompts: int) -> list[SamplingParams]:
        """One :class:`SamplingParams` per prompt row (see :func:`per_prompt_params`)."""
        return per_prompt_params(self.given, prompts)


def normalise_request(
    model: PreTrainedModel, sampling: Sampling, overrides: dict[str, Any]
) -> RequestSettings:
    """``sampling`` (the model's generation config when ``None``) with ``generate``'s keyword
    overrides applied to every row (``max_new_tokens=8``, vLLM's ``max_tokens=8``, ...), as
    ``model.generate(**kwargs)`` updates its generation config; EOS and pad filled from the
    model's generation config. A per-row list must agree on :data:`CALL_FIELDS`."""
    if isinstance(sampling, (list, tuple)):
        rows = tuple(_resolve_one(model, s, overrides) for s in sampling)
        if not rows:
            raise ValueError("sampling is an empty list; give one SamplingParams per prompt row")
        for name in CALL_FIELDS:
            differing = [
                i for i, r in enumerate(rows) if getattr(r, name) != getattr(rows[0], name)
            ]
            if differing:
                raise ValueError(
                    f"sampling rows {differing} differ from row 0 in {name}, which applies to the "
                    f"whole call; give every row the same value{CALL_FIELD_HINTS.get(name, '')}"
                )
        return RequestSettings(CallSettings.of(rows), rows)
    one = _resolve_one(model, sampling, overrides)
    return RequestSettings(CallSettings.of([one]), one)


def per_prompt_params(call: SamplingParams | Sequence[SamplingParams], rows: int) -> list:
    """One :class:`SamplingParams` per prompt row: a list as given, or the call's settings
    repeated, where a call ``seed`` ``s`` gives prompt row ``i`` the seed ``s + i`` (distinct
    streams per prompt; run a row alone with ``seed=s + i`` to reproduce it), or ``s`` itself
    where it is ``per_request_seed`` (vLLM's: a prompt draws alike at any batch position)."""
    if isinstance(call, SamplingParams):
        if call.seed is None or call.per_request_seed:
            return [call] * rows
        return [replace(call, seed=(call.seed + i) % 2**64) for i in range(rows)]
    if len(call) != rows:
        raise ValueError(
            f"sampling has {len(call)} SamplingParams but input_ids has {rows} prompt rows; give "
            "one per prompt row (or a single SamplingParams for all)"
        )
    return list(call)


def model_sampling(model: PreTrainedModel) -> SamplingParams:
    """The settings generate() uses when given none: the model's ``generation_config``.

    Its allow-listed fields (sampling, lengths, ids) are followed, with generate's defaults
    (``top_k`` 50 when sampling); ``max_new_tokens`` unset means SamplingParams' 16. Fields
    graphcap cannot apply (``num_beams``, ``max_length``, ...) are named in a one-time warning.
    """
    gen = getattr(model, "generation_config", None)
    if gen is None:
        return SamplingParams()
    values = {k: getattr(gen, k, None) for k in GENERATION_CONFIG_FIELDS if k != "stop_strings"}
    values = {k: v for k, v in values.items() if v is not None}
    ignored = unsupported_generation_fields(gen) + (["stop_strings"] if gen.stop_strings else [])
    if ignored:
        warn_once(
            f"{type(model).__name__}.generation_config sets {ignored}, which graphcap does not "
            "apply; generate() was called without sampling=, so only its sampling, length and "
            "token-id fields are followed. Pass sampling=SamplingParams(...) to silence this."
        )
    return SamplingParams.from_generation_config(GenerationConfig(**values))


def _resolve_one(
    model: PreTrainedModel,
    sampling: SamplingParams | GenerationConfig | None,
    overrides: dict[str, Any],
) -> SamplingParams:
    """One row's settings: as given (or the model's), with the overrides, EOS and pad filled."""
    if sampling is None:
        sampling = model_sampling(model)
    elif isinstance(sampling, GenerationConfig):
        sampling = SamplingParams.from_generation_config(sampling)
    elif not isinstance(sampling, SamplingParams):
        raise TypeError(
            f"sampling must be SamplingParams, transformers.GenerationConfig or a list of "
            f"SamplingParams (one per prompt row), got {type(sampling).__name__}"
        )
    if overrides:
        sampling = override(sampling, overrides)
    gen_config = getattr(model, "generation_config", None)
    eos = getattr(gen_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    return sampling.resolved(eos, getattr(gen_config, "pad_token_id", None))
