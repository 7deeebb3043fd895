"""Rollout settings: the engine's own configuration and the per-call sampling settings.

``SamplingParams`` is what the decode step understands. A transformers ``GenerationConfig`` is
accepted through an explicit allow-list so that no generate option is ever silently ignored: a
field outside the list that differs from its default is refused with its name.
"""

from __future__ import annotations

import ast
import functools
import math
import numbers
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from transformers import GenerationConfig, PreTrainedModel

    from graphcap.backend import Backend

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
#: What ``SamplingParams.logprobs`` / ``return_logprobs`` report (docs/rollout.md, "Log-probs"):
#: the distribution the token was drawn from, log_softmax(logits / T), or log_softmax(logits).
LOGPROBS_MODES: tuple[str, ...] = ("sampling", "temperature", "raw")
#: vLLM SamplingParams names accepted by the constructor: the same meaning under another name.
VLLM_ALIASES: dict[str, str] = {
    "n": "num_return_sequences",
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "logprobs": "return_logprobs",
}
#: The most alternatives per token ``top_logprobs`` returns (vLLM's default ``max_logprobs``).
MAX_TOP_LOGPROBS: int = 20
#: The largest ``RolloutConfig.kv_block_size``: a larger block only wastes memory per row.
MAX_KV_BLOCK_SIZE = 4096

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


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen; every field is either part of the graph signature or per-call.

    ``top_k=None`` disables top-k (unlike ``generate``, which applies 50 when sampling; a
    ``GenerationConfig`` converted by :meth:`from_generation_config` keeps generate's default).
    ``eos_token_id`` / ``pad_token_id`` left ``None`` are taken from the model's generation config
    (pad falls back to the first EOS id, as generate does). ``output_scores`` /
    ``output_logits``: the result also holds every step's processed scores / raw logits, as
    ``generate(output_scores=True)`` / ``output_logits=True`` return them (float32,
    ``(rows, max_new_tokens, vocab)``: recorded inside the step, so they cost that memory).
    ``stop_sequences``: token-id sequences that end a row when its generated tokens end with
    one (matched on the device; the tokenisation of a stop string, see :meth:`from_vllm`);
    ``include_stop_str_in_output`` keeps the matched tokens in the response (vLLM's name).
    ``presence_penalty`` / ``frequency_penalty``: vLLM's additive penalties over the tokens the
    row generated (not the prompt), ``score - frequency * count - presence * (count > 0)``,
    after the repetition penalty. ``top_logprobs=k`` (vLLM's ``logprobs=k``): also the ``k``
    most likely tokens of each step and their log-probs, under ``logprobs_mode``'s
    distribution (implies ``return_logprobs``).

    ``seed``: sampled rows draw from their own stream, a hash of (seed, sample index within
    the prompt, token index, token id), never from a torch generator. One ``SamplingParams``
    with a seed ``s`` given for a whole call gives prompt row ``i`` the seed ``s + i``
    (distinct streams per prompt), unless ``per_request_seed`` (what :meth:`from_vllm` sets):
    then every prompt draws from ``s`` itself, vLLM's per-request seed, so a prompt's tokens do
    not depend on its batch position or on the other prompts. A list with one
    ``SamplingParams`` per prompt gives each prompt exactly its own seed.

    Warpers (``temperature``, ``top_p``, ``top_k``, ``min_p``) given without ``do_sample`` are
    refused: transformers would decode greedily, vLLM would sample. Say ``do_sample=True``, or
    build from vLLM keywords with :meth:`from_vllm`.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    num_return_sequences: int = 1
    return_logprobs: bool = False
    seed: int | None = None
    min_p: float = 0.0
    logprobs_mode: str = "sampling"
    stop_token_ids: tuple[int, ...] | None = None
    output_scores: bool = False
    output_logits: bool = False
    stop_sequences: tuple[tuple[int, ...], ...] | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0
    per_request_seed: bool = False

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )
        if self.num_return_sequences < 1:
            raise ValueError(f"num_return_sequences must be >= 1, got {self.num_return_sequences}")
        # greedy ignores temperature (generate accepts temperature=0 with do_sample=False)
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if self.do_sample and self.temperature == 0:
            raise ValueError(
                "temperature=0 with do_sample=True divides the scores by zero; use "
                "do_sample=False for greedy decoding, or a temperature > 0 "
                "(SamplingParams.from_vllm maps vLLM's temperature=0 to greedy)"
            )
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(
                f"top_k must be >= 0 (0 or None disables it), got {self.top_k}; for vLLM's "
                "top_k=-1 (off) use top_k=None, or SamplingParams.from_vllm(top_k=-1, ...)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        self._check_sampling_extras()
        if self.num_return_sequences > 1 and not self.do_sample:
            raise ValueError(
                "num_return_sequences > 1 with greedy decoding would return identical copies; "
                "set do_sample=True (SamplingParams.from_vllm(n=..., temperature=...) samples "
                "as vLLM does)"
            )

    def _check_sampling_extras(self) -> None:
        """Checks of the fields added for RL sampling (min_p, log-prob mode, stop ids, seed)."""
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {self.logprobs_mode!r}"
            )
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs (vLLM's logprobs=k) must be in [0, {MAX_TOP_LOGPROBS}], got "
                f"{self.top_logprobs}"
            )
        if self.top_logprobs:
            object.__setattr__(self, "return_logprobs", True)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(
                    f"{name} must be in [-2, 2] (vLLM's range), got {getattr(self, name)}"
                )
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if isinstance(ids, int) or not all(isinstance(i, int) and i >= 0 for i in ids):
                raise ValueError(
                    f"stop_token_ids must be a list of non-negative token ids, got {ids!r}"
                )
            object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.stop_sequences is not None:
            object.__setattr__(self, "stop_sequences", _stop_sequences(self.stop_sequences))

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends a row: the EOS ids, then ``stop_token_ids``."""
        return self.eos_ids + tuple(i for i in self.stop_token_ids or () if i not in self.eos_ids)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """EOS ids as a tuple (empty when none is set)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(int(i) for i in self.eos_token_id)

    @property
    def effective_top_k(self) -> int:
        """The top-k the sampler applies (0 = disabled); greedy ignores warpers, as generate."""
        return (self.top_k or 0) if self.do_sample else 0

    @classmethod
    def from_vllm(cls, *, tokenizer: Any = None, **kwargs: Any) -> SamplingParams:
        """Build from vLLM ``SamplingParams`` keywords with vLLM's meaning: sampling unless
        ``temperature`` is 0 (vLLM's greedy), ``top_k`` of -1 or 0 disables top-k,
        ``ignore_eos=True`` sets no EOS id, ``seed`` is each request's own
        (``per_request_seed``: every prompt of a call draws from ``seed``, its ``n`` samples
        from distinct streams). ``stop``
        strings become ``stop_sequences`` through ``tokenizer`` (its ``encode``, no special
        tokens), so the engine itself needs no tokenizer. Other names as the constructor."""
        kwargs.setdefault("per_request_seed", True)
        temperature = float(kwargs.pop("temperature", 1.0))
        top_k = kwargs.pop("top_k", None)
        kwargs.setdefault("do_sample", temperature > 0)
        kwargs["temperature"] = temperature if temperature > 0 else 1.0
        kwargs["top_k"] = None if top_k in (None, -1, 0) else top_k
        if kwargs.pop("ignore_eos", False):
            kwargs["eos_token_id"] = []  # stop ids and stop sequences still end rows
        stop = kwargs.pop("stop", None)
        if stop:
            sequences = list(kwargs.pop("stop_sequences", None) or ())
            kwargs["stop_sequences"] = sequences + stop_string_sequences(stop, tokenizer)
        return cls(**kwargs)

    @classmethod
    def from_generation_config(
        cls,
        config: GenerationConfig,
        *,
        return_logprobs: bool = False,
        seed: int | None = None,
        tokenizer: Any = None,
    ) -> SamplingParams:
        """Convert a ``GenerationConfig`` through the allow-list, with generate's defaults
        (``max_new_tokens`` unset: 16, as ``engine.generate`` without ``sampling``).
        ``stop_strings`` need ``tokenizer``, as in ``generate``; they are kept in the output,
        as generate keeps them."""
        refused = unsupported_generation_fields(config)
        if refused:
            raise ValueError(
                f"GenerationConfig field(s) {refused} are not supported by graphcap's rollout "
                f"engine; supported fields are {list(GENERATION_CONFIG_FIELDS)}. Remove them "
                "(or use model.generate() for those features)."
            )
        do_sample = bool(config.do_sample)
        top_k = config.top_k
        if do_sample and top_k is None:
            top_k = GENERATE_DEFAULT_TOP_K
        values: dict[str, Any] = {
            "do_sample": do_sample,
            "temperature": 1.0 if config.temperature is None else float(config.temperature),
            "top_k": top_k,
            "top_p": 1.0 if config.top_p is None else float(config.top_p),
            "repetition_penalty": 1.0
            if config.repetition_penalty is None
            else float(config.repetition_penalty),
            "eos_token_id": config.eos_token_id,
            "pad_token_id": config.pad_token_id,
            "max_new_tokens": int(config.max_new_tokens or cls.max_new_tokens),
            "min_new_tokens": int(config.min_new_tokens or 0),
            "num_return_sequences": int(config.num_return_sequences or 1),
            "min_p": 0.0 if config.min_p is None else float(config.min_p),
            "output_scores": bool(config.output_scores),
            "output_logits": bool(config.output_logits),
            "return_logprobs": return_logprobs,
            "seed": seed,
        }
        if config.stop_strings:
            values["stop_sequences"] = stop_string_sequences(config.stop_strings, tokenizer)
            values["include_stop_str_in_output"] = True
        return cls(**values)

    def resolved(self, eos_default: Any, pad_default: int | None) -> SamplingParams:
        """Fill EOS / pad from the model's defaults; pad falls back to the first EOS id."""
        eos = self.eos_token_id if self.eos_token_id is not None else eos_default
        params = replace(self, eos_token_id=eos)
        pad = self.pad_token_id if self.pad_token_id is not None else pad_default
        if pad is None and params.eos_ids:
            pad = params.eos_ids[0]
        if pad is None:
            raise ValueError(
                "no pad token id: set SamplingParams(pad_token_id=...) (or eos_token_id, which "
                "is used as pad like generate does) or model.generation_config.pad_token_id"
            )
        return replace(params, pad_token_id=int(pad))


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


def _stop_sequences(value: Any) -> tuple[tuple[int, ...], ...]:
    """``stop_sequences`` as a tuple of non-empty tuples of non-negative ids, else refused."""
    out = []
    for seq in value if isinstance(value, (list, tuple)) else [None]:
        if isinstance(seq, torch.Tensor):
            seq = seq.tolist()
        if (
            not isinstance(seq, (list, tuple))
            or not seq
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in seq)
        ):
            raise ValueError(
                "stop_sequences must be a list of non-empty token-id lists (e.g. "
                f"[[13, 29]]), got {value!r}; for stop strings use "
                "SamplingParams.from_vllm(stop=[...], tokenizer=tok)"
            )
        out.append(tuple(seq))
    return tuple(out)


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


def _vllm_keywords(kwargs: dict[str, Any]) -> dict[str, Any]:
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


def _neutral(name: str, value: Any) -> bool:
    """Whether vLLM's ``name`` at ``value`` asks for nothing (:data:`VLLM_UNSUPPORTED`)."""
    return any(type(value) is type(off) and value == off for off in VLLM_UNSUPPORTED[name])


def override(params: SamplingParams, changes: dict[str, Any]) -> SamplingParams:
    """``params`` with ``changes`` (field names or vLLM aliases), as ``generate``'s keyword
    arguments update its generation config; warpers on a greedy base need ``do_sample``."""
    changes = _vllm_keywords(dict(changes))
    unknown = sorted(set(changes) - {f.name for f in fields(SamplingParams)})
    if unknown:
        raise TypeError(
            f"generate() got unexpected keyword arguments {unknown}; it takes SamplingParams "
            f"fields ({sorted(f.name for f in fields(SamplingParams))}) and vLLM's "
            f"{sorted(VLLM_ALIASES)}"
        )
    check_warpers_have_do_sample(changes, decided=params.do_sample)
    return replace(params, **changes)


def _accepting_vllm_names(init: Any) -> Any:
    @functools.wraps(init)
    def __init__(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
        keywords = _vllm_keywords(dict(kwargs))
        init(self, *args, **keywords)  # type and value checks first
        given = {k: getattr(self, k) for k in keywords}
        check_warpers_have_do_sample(given, decided=bool(args))  # args[0] is do_sample

    return __init__


SamplingParams.__init__ = _accepting_vllm_names(SamplingParams.__init__)  # type: ignore[method-assign]


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


@dataclass
class RolloutConfig:
    """Engine-wide settings.

    ``enable_cuda_graph`` is the deprecated name of ``enable_graph_capture``: its value moves to
    the new field with a ``DeprecationWarning``; both set to different values is an error.
    ``backend`` is a :class:`graphcap.Backend`, a backend name, or ``None`` for
    ``graphcap.get_backend()`` (which honours ``GRAPHCAP_BACKEND``).
    ``batch_buckets`` / ``length_buckets`` pad the batch (rows x samples) and the total length
    (prompt width + max_new_tokens) up to the smallest listed size that fits, so varying
    requests reuse a few graphs; a request larger than every bucket runs at its own size.
    ``length_buckets="auto"`` (the default) pads graph engines' total lengths to powers of two
    (:meth:`total_length`), on the continuous path too. ``continuous_batch_size=N`` runs the
    batch's rows as a request queue through ``N`` slots
    (docs/continuous.md); ``align_decode_fronts`` / ``trim_cache`` are eager-only layouts of
    that path (they move cache rows and columns, which a captured graph cannot allow).
    ``per_position_graphs=True`` captures one graph per decode position for calls with pinned
    lengths (``min_new_tokens == max_new_tokens``); other calls use the static graph path, with
    the reason in the stats (docs/rollout.md, "Per-position graphs").
    ``process_group``: the tensor-parallel group this rank decodes with; the graph decision and
    the periodic "finished" checks are then all-reduced over it so ranks never diverge in
    collectives (docs/rollout.md, "Tensor parallelism"). ``None``: no communication.
    ``graph_attention``: the attention implementation captured decode steps run. ``"auto"``
    takes the backend's graph-safe attention (``Capabilities.graph_attention``) where it offers
    one, else the model's own; ``None`` always keeps the model's own; a name selects that
    registered implementation. Eager calls and the prefill always use the model's own.
    ``max_request_bytes``: refuse a call whose estimated allocation exceeds it (calls above the
    memory the backend reports available are refused in any case).
    ``compile``: ``None`` (the default) compiles captured steps where the backend declares that
    it pays (``Capabilities.compile_by_default``: CUDA), ``False`` never, ``True`` always
    (refused with the reason where the backend cannot capture compiled code). Per-position
    graphs never compile; tensor-parallel steps (``process_group``) compile only when asked.
    ``compile_cache``: where compiled code is kept between processes
    (:mod:`graphcap.rollout.holder.compile_cache`): ``"auto"`` is ``$GRAPHCAP_COMPILE_CACHE`` or
    ``~/.cache/graphcap/compile``, a path (a string or ``os.PathLike``) that directory,
    ``None`` none beyond torch's own caches. Compiled captures run the blocks around attention
    (each decoder layer with its attention left out, the rotary function and embedding, the
    K/V cache writes) through ``torch.compile``, traced once per block class
    (:func:`graphcap.rollout.plan.regions.compiled_regions`); the compilation happens in the
    warm-up before the first capture, so it is part of that call's ``warmup_s``,
    ``capture_s`` and ``first_call_s`` (``stats.compiled`` says so). The captured projections
    compute through the backend's one-row product where it offers one
    (``Backend.one_row_product``: batch-1 steps), and every region compiles with the backend's
    inductor options (``Backend.compile_options``). Compiled code rounds
    differently: steps equal eager ones within float rounding, not bit for bit. Needs a backend
    that declares ``captures_compiled``; elsewhere calls run eagerly with the reason.
    ``kv_block_size``: where decode steps keep K/V. ``"auto"`` (the default) follows the
    backend (``Capabilities.kv_block_size``: a block table of that block size, or the static
    cache), ``None`` always the static cache, an int a block table of that many columns per
    block (docs/continuous.md, "The block table"). Eager layouts that move cache columns
    (``align_decode_fronts``, ``trim_cache``) and per-position graphs keep the static cache
    (``stats.kv_layout`` says which ran).
    ``fuse_projections``: projections that read one input (q/k/v, gate/up) run as one product
    over their weights fused in one buffer, whose views the parameters become
    (:mod:`graphcap.rollout.plan.fusion`; ``stats.fused_projections`` counts the groups), in
    every step and the prefill of a call, eager or captured; results equal the unfused
    model's within float rounding. ``None`` (the default) fuses in graph engines where the
    backend declares that it pays (``Capabilities.fuse_projections_by_default``: CUDA),
    ``True`` always, ``False`` never.
    ``batch_ladder``: the batch sizes a static graph call shrinks to as rows end, so a step
    computes only rows still generating: ``"auto"`` (the default) every power of two below the
    call's batch, a tuple those sizes, ``None`` never (docs/rollout.md, "The live-row
    ladder"). Each size is one more graph, captured when a call first reaches it and kept.
    Not with ``draws="generate"`` (moving rows would change how many numbers a step draws),
    per-position graphs or ``process_group``.
    ``draws``: how sampled rows draw. ``"per_row"`` (the default): each row from its own
    counter-based stream (its ``seed``, or one number drawn from the shared generator per call
    plus its prompt index), so a row's tokens do not depend on the rest of the batch and a
    step reads the scores once; ``"generate"``: unseeded rows draw ``multinomial`` from the
    shared generator over all rows, generate's own random numbers (docs/rollout.md, "Random
    numbers").
    """

    enable_graph_capture: bool | None = None
    eos_check_interval: int = 16
    backend: Backend | str | None = None
    batch_buckets: tuple[int, ...] | None = None
    length_buckets: tuple[int, ...] | Literal["auto"] | None = "auto"
    continuous_batch_size: int | None = None
    align_decode_fronts: bool = False
    trim_cache: bool = False
    per_position_graphs: bool = False
    process_group: ProcessGroup | None = None
    graph_attention: str | None = "auto"
    compile: bool | None = None
    compile_cache: str | None = "auto"
    fuse_projections: bool | None = None
    enable_cuda_graph: bool | None = field(default=None, repr=False)
    max_request_bytes: int | None = None
    kv_block_size: int | Literal["auto"] | None = "auto"
    draws: Literal["per_row", "generate"] = "per_row"
    batch_ladder: tuple[int, ...] | Literal["auto"] | None = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.compile_cache, os.PathLike):  # a pathlib.Path names a directory too
            self.compile_cache = os.fspath(self.compile_cache)
        check_field_types(self)
        self._check_kv_block_size()
        _check_backend(self.backend)
        if self.enable_cuda_graph is not None:
            warnings.warn(
                "RolloutConfig.enable_cuda_graph is deprecated; use enable_graph_capture "
                "(graphs are captured on any backend that can, not only CUDA)",
                DeprecationWarning,
                stacklevel=3,
            )
            if (
                self.enable_graph_capture is not None
                and self.enable_graph_capture != self.enable_cuda_graph
            ):
                raise ValueError(
                    f"enable_cuda_graph={self.enable_cuda_graph} conflicts with "
                    f"enable_graph_capture={self.enable_graph_capture}; set only "
                    "enable_graph_capture"
                )
            self.enable_graph_capture = bool(self.enable_cuda_graph)
            self.enable_cuda_graph = None
        if self.enable_graph_capture is None:
            self.enable_graph_capture = False
        if self.max_request_bytes is not None and self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.eos_check_interval < 1:
            raise ValueError(f"eos_check_interval must be >= 1, got {self.eos_check_interval}")
        self.batch_buckets = _buckets("batch_buckets", self.batch_buckets)
        if self.batch_ladder not in (None, "auto"):
            self.batch_ladder = _buckets("batch_ladder", self.batch_ladder)
        if self.length_buckets != "auto":
            self.length_buckets = _buckets("length_buckets", self.length_buckets)
        self._check_continuous()
        self._check_per_position()
        if self.compile is True and not self.enable_graph_capture:
            raise ValueError(
                "compile=True compiles the captured decode step: set enable_graph_capture=True "
                "too (eager calls always run the model as it is)"
            )
        if self.compile is True and self.per_position_graphs:
            raise ValueError(
                "compile=True with per_position_graphs=True would compile the forward once per "
                "decode position (each attends over a different width); set only one"
            )
        if self.compile_cache == "":
            raise ValueError(
                'compile_cache="" names no directory; use "auto", a directory, or None for '
                "torch's own caches only"
            )
        if self.process_group is not None:
            check_process_group(self.process_group)

    def total_length(self, model: PreTrainedModel, total: int) -> int:
        """The total length (prompt width + new tokens) a call's buffers get: ``total`` padded
        to ``length_buckets``. ``"auto"`` pads graph engines' calls to the next power of two
        from 64 up to the model's ``max_position_embeddings``, so calls whose prompts come
        padded to another width reuse one graph (eager engines keep ``total``)."""
        if self.length_buckets != "auto":
            return bucket_size(total, self.length_buckets)
        if not self.enable_graph_capture:
            return total
        limit = getattr(model.config, "max_position_embeddings", None) or 2**16
        padded = max(64, 1 << (total - 1).bit_length())
        return padded if padded <= limit else total

    def wants_compile(self, backend: Backend) -> bool:
        """Whether captured steps compile on ``backend``: ``compile`` where set, else the
        backend's declared default, except for per-position graphs (never) and tensor-parallel
        steps (``process_group`` set: compiled TP steps have not run anywhere yet, so they
        compile only when asked)."""
        if self.per_position_graphs:
            return False
        if self.compile is None:
            return self.process_group is None and backend.capabilities.compile_by_default
        return self.compile

    def wants_fusion(self, backend: Backend) -> bool:
        """Whether calls fuse q/k/v and gate/up products on ``backend``: ``fuse_projections``
        where set, else in graph engines where the backend declares that fusing pays (eager
        engines run the model as it is unless asked)."""
        if self.fuse_projections is None:
            return self.enable_graph_capture and backend.capabilities.fuse_projections_by_default
        return self.fuse_projections

    def _check_kv_block_size(self) -> None:
        value = self.kv_block_size
        if value is None or value == "auto":
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"RolloutConfig.kv_block_size must be a positive int (columns per block), "
                f'"auto" (the backend\'s block size) or None (the static cache), got {value!r}'
            )
        if value > MAX_KV_BLOCK_SIZE:
            raise ValueError(
                f"RolloutConfig.kv_block_size {value} is over {MAX_KV_BLOCK_SIZE} columns: every "
                f"row holds at least one block, so a block that large only wastes memory; use "
                f"16-512 (or None for the static cache)"
            )

    def _check_per_position(self) -> None:
        if not self.per_position_graphs:
            return
        if not self.enable_graph_capture:
            raise ValueError(
                "per_position_graphs=True captures graphs: set enable_graph_capture=True too"
            )
        if self.continuous_batch_size is not None:
            raise ValueError(
                "per_position_graphs needs every row to run the same positions, but "
                "continuous_batch_size refills slots at different positions; set only one"
            )

    def _check_continuous(self) -> None:
        if self.continuous_batch_size is not None and self.continuous_batch_size < 1:
            raise ValueError(
                f"continuous_batch_size must be >= 1, got {self.continuous_batch_size}"
            )
        explicit_lengths = self.length_buckets not in (None, "auto")
        if self.continuous_batch_size is not None and (self.batch_buckets or explicit_lengths):
            raise ValueError(
                "batch_buckets / length_buckets do not apply to the continuous path (its slot "
                "count already fixes the batch shape); drop them or continuous_batch_size"
            )
        for name in ("align_decode_fronts", "trim_cache"):
            if not getattr(self, name):
                continue
            if self.continuous_batch_size is None:
                raise ValueError(f"{name} is a continuous-path mode: set continuous_batch_size")
            if self.enable_graph_capture:
                raise ValueError(
                    f"{name}=True moves cache rows/columns between steps, but a captured graph "
                    f"replays on fixed addresses; drop {name} or set enable_graph_capture=False "
                    "(the eager continuous loop supports it)"
                )


def check_process_group(group: object) -> None:
    """Refuse anything but a ``torch.distributed`` process group of an initialised job."""
    if not dist.is_available():
        raise ValueError(
            "process_group is set but this torch build has no torch.distributed; leave "
            "process_group=None"
        )
    if not dist.is_initialized():
        raise ValueError(
            "process_group is set but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group(...) before building the RolloutConfig"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"process_group must be a torch.distributed.ProcessGroup (e.g. "
            f"torch.distributed.new_group(...) or the default group), got {type(group).__name__}"
        )


def _check_backend(backend: object) -> None:
    from graphcap.backend import Backend

    if backend is not None and not isinstance(backend, (Backend, str)):
        raise TypeError(
            f"RolloutConfig.backend must be a graphcap.Backend, a backend name (str) or None, "
            f"got {type(backend).__name__}"
        )


def _buckets(name: str, sizes: tuple[int, ...] | None) -> tuple[int, ...] | None:
    if sizes is None:
        return None
    values = tuple(sorted(set(sizes)))
    if not values or values[0] < 1:
        raise ValueError(f"{name} must be a non-empty list of positive sizes, got {sizes!r}")
    return values


def bucket_size(value: int, buckets: tuple[int, ...] | None) -> int:
    """The smallest bucket >= ``value``; ``value`` itself when no bucket fits or none is set."""
    return next((b for b in buckets or () if b >= value), value)


# ---- field types ----------------------------------------------------------------------------
# Each dataclass field is checked against its own annotation, so a new field is covered by
# writing its type. Annotation parts outside this table (``Backend``, ``ProcessGroup``) are
# left to the field's own check.
_TYPE_NAMES = {
    "None": "None",
    "bool": "a bool",
    "int": "an int",
    "float": "a float",
    "str": "a str",
    "list[int]": "a list of ints",
    "tuple[int, ...]": "a tuple of ints",
}
_NO_MATCH = object()


def check_field_types(obj: Any) -> None:
    """Refuse a dataclass field value of the wrong type, naming the field and the type wanted.

    ``"no"`` is not a bool, ``8.5`` and ``"5"`` are not ints, ``"0.7"`` is not a float. What
    ``generate`` accepts as a number passes and is normalised to the Python type: numpy scalars
    and 0-d tensors (``eos_token_id=np.int64(1)``), ints for floats (``temperature=1``), and
    1-d integer tensors / arrays for id lists.
    """
    for f in fields(obj):
        parts = [p.strip() for p in str(f.type).split("|")]
        if any(p not in _TYPE_NAMES and not p.startswith("Literal[") for p in parts):
            continue
        value = getattr(obj, f.name)
        for part in parts:
            converted = _convert(part, value)
            if converted is not _NO_MATCH:
                break
        else:
            wanted = " or ".join(_TYPE_NAMES.get(p) or _literal_name(p) for p in parts)
            raise TypeError(
                f"{type(obj).__name__}.{f.name} must be {wanted}, got {value!r} "
                f"({type(value).__name__})"
            )
        if converted is not value:
            object.__setattr__(obj, f.name, converted)


def _literal_values(kind: str) -> tuple[Any, ...]:
    """The values of a ``Literal[...]`` annotation part."""
    return ast.literal_eval(f"({kind[len('Literal[') : -1]},)")


def _literal_name(kind: str) -> str:
    return " or ".join(repr(v) for v in _literal_values(kind))


def _convert(kind: str, value: Any) -> Any:
    """``value`` as ``kind``, or ``_NO_MATCH``; never converts text or bools to numbers."""
    if kind.startswith("Literal["):
        values = _literal_values(kind)
        return value if isinstance(value, str) and value in values else _NO_MATCH
    if kind == "None":
        return value if value is None else _NO_MATCH
    if kind == "str":
        return value if isinstance(value, str) else _NO_MATCH
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.item()
        elif value.dim() == 1 and kind in ("list[int]", "tuple[int, ...]"):
            value = value.tolist()
        else:
            return _NO_MATCH
    elif hasattr(value, "dtype") and hasattr(value, "tolist"):  # numpy scalars and arrays
        value = value.tolist()
    if kind == "bool":
        return value if isinstance(value, bool) else _NO_MATCH
    if isinstance(value, bool):
        return _NO_MATCH
    if kind == "int":
        return int(value) if isinstance(value, numbers.Integral) else _NO_MATCH
    if kind == "float":
        return float(value) if isinstance(value, numbers.Real) else _NO_MATCH
    if isinstance(value, (list, tuple)):
        ints = [_convert("int", v) for v in value]
        if _NO_MATCH in ints:
            return _NO_MATCH
        return ints if kind == "list[int]" else tuple(ints)
    return _NO_MATCH
