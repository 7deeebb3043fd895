"""SamplingParams: how one row's tokens are chosen, and the doors into it.

The constructor takes graphcap's own names (transformers' where they exist);
:meth:`SamplingParams.from_vllm` takes vLLM's keywords with vLLM's meaning and
:meth:`SamplingParams.from_generation_config` a ``GenerationConfig`` through the allow-list of
:mod:`~graphcap.rollout.settings.vocabulary`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import InitVar, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch

from graphcap.rollout.settings.field_types import check_field_types
from graphcap.rollout.settings.vocabulary import (
    GENERATE_DEFAULT_TOP_K,
    GENERATION_CONFIG_FIELDS,
    VLLM_ALIASES,
    VLLM_DEFAULT_LOGPROBS_MODE,
    VLLM_UNSUPPORTED,
    WARPER_NEUTRAL,
    check_warpers_have_do_sample,
    stop_string_sequences,
    unsupported_generation_fields,
    vllm_keywords,
    vllm_logprobs_mode,
)

if TYPE_CHECKING:
    from transformers import GenerationConfig

#: What ``SamplingParams.logprobs`` / ``return_logprobs`` report (docs/rollout.md, "Log-probs"):
#: the distribution the token was drawn from, log_softmax(logits / T), or log_softmax(logits).
LOGPROBS_MODES: tuple[str, ...] = ("sampling", "temperature", "raw")
#: The most alternatives per token ``top_logprobs`` returns (vLLM's default ``max_logprobs``).
MAX_TOP_LOGPROBS: int = 20


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen; every field is either part of the graph signature or per-call.

    ``top_k=None`` disables top-k (unlike ``generate``, which applies 50 when sampling; a
    ``GenerationConfig`` converted by :meth:`from_generation_config` keeps generate's default).
    ``eos_token_id`` / ``pad_token_id`` left ``None`` are taken from the model's generation config
    (pad falls back to the first EOS id, as generate does). ``output_scores`` /
    ``output_logits``: the result also holds every step's processed scores / raw logits, as
    ``generate(output_scores=True)`` / ``output_logits=True`` return them (float32,
    ``(rows, max_new_tokens, vocab)``: recorded inside the step, so they cost that memory,
    counted in the request's memory check; only the record asked for is kept, for this call).
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
    build from vLLM keywords with :meth:`from_vllm`. ``do_sample`` left unset (``None``) is
    greedy: it is ``False`` once constructed.

    ``n``, ``max_tokens``, ``min_tokens`` and ``logprobs`` (vLLM's names of
    ``num_return_sequences``, ``max_new_tokens``, ``min_new_tokens`` and ``return_logprobs`` /
    ``top_logprobs``) are deprecated here: they still work, with a ``DeprecationWarning``, for
    one release; :meth:`from_vllm` is the door for vLLM's keywords.
    """

    do_sample: bool | None = None
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
    n: InitVar[int | None] = None
    max_tokens: InitVar[int | None] = None
    min_tokens: InitVar[int | None] = None
    logprobs: InitVar[bool | int | None] = None

    def __new__(cls, *args: Any, **kwargs: Any) -> SamplingParams:
        # vLLM's other names are read by from_vllm only; say so rather than Python's bare
        # "unexpected keyword argument" (the dataclass __init__ keeps the real signature)
        vllm_only = sorted(k for k in kwargs if k in VLLM_UNSUPPORTED)
        if vllm_only:
            raise TypeError(
                f"SamplingParams() got vLLM's {vllm_only}: the constructor takes graphcap's "
                "names; use SamplingParams.from_vllm(...) for vLLM's keywords"
            )
        # only here is it known that both were given (the field may be given at its default)
        given = [k for k in kwargs if k in VLLM_ALIASES and kwargs[k] is not None]
        both = [k for k in given if VLLM_ALIASES[k] in kwargs]  # replace() passes None aliases
        if both:
            name = VLLM_ALIASES[both[0]]
            raise ValueError(
                f"both {name!r} and its vLLM alias {both[0]!r} were given; set only one"
            )
        return super().__new__(cls)

    def __post_init__(
        self,
        n: int | None,
        max_tokens: int | None,
        min_tokens: int | None,
        logprobs: bool | int | None,
    ) -> None:
        aliases = {"n": n, "max_tokens": max_tokens, "min_tokens": min_tokens, "logprobs": logprobs}
        self._take_vllm_aliases({k: v for k, v in aliases.items() if v is not None})
        decided = self.do_sample is not None
        if not decided:
            object.__setattr__(self, "do_sample", False)
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
        if not decided:
            check_warpers_have_do_sample({k: getattr(self, k) for k in WARPER_NEUTRAL})

    def _take_vllm_aliases(self, given: dict[str, Any]) -> None:
        """The deprecated vLLM keywords of the constructor, as :meth:`from_vllm` reads them."""
        if not given:
            return
        warnings.warn(
            f"SamplingParams({', '.join(f'{k}=...' for k in given)}): vLLM's names in the "
            f"constructor are deprecated; use {', '.join(VLLM_ALIASES[k] for k in given)} or "
            "SamplingParams.from_vllm(...)",
            DeprecationWarning,
            stacklevel=4,
        )
        defaults = {f.name: f.default for f in fields(self)}
        for key in given:
            name = VLLM_ALIASES[key]
            if getattr(self, name) != defaults[name]:
                raise ValueError(
                    f"both {name!r} and its vLLM alias {key!r} were given; set only one"
                )
        for name, value in vllm_keywords(given).items():
            object.__setattr__(self, name, value)

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
        tokens), so the engine itself needs no tokenizer. vLLM's ``n``, ``max_tokens``,
        ``min_tokens`` and ``logprobs`` are read as :data:`VLLM_ALIASES` says; vLLM names with no
        counterpart (:data:`VLLM_UNSUPPORTED`) are dropped where they ask for nothing and
        refused otherwise. ``logprobs_mode``: vLLM's (``"raw_logprobs"``, its default, is
        graphcap's ``"raw"``; ``"processed_logprobs"`` is ``"sampling"``;
        :data:`~graphcap.rollout.settings.vocabulary.VLLM_LOGPROBS_MODES`) or graphcap's own.
        Other names as the constructor."""
        kwargs.setdefault("per_request_seed", True)
        mode = kwargs.pop("logprobs_mode", VLLM_DEFAULT_LOGPROBS_MODE)
        kwargs["logprobs_mode"] = vllm_logprobs_mode(mode)
        temperature = kwargs.pop("temperature", 1.0)
        greedy = _is_zero(temperature)  # any other value is the constructor's to check
        top_k = kwargs.pop("top_k", None)
        kwargs.setdefault("do_sample", not greedy)
        kwargs["temperature"] = 1.0 if greedy else temperature
        kwargs["top_k"] = None if top_k in (None, -1, 0) else top_k
        if kwargs.pop("ignore_eos", False):
            kwargs["eos_token_id"] = []  # stop ids and stop sequences still end rows
        stop = kwargs.pop("stop", None)
        if stop:
            sequences = list(kwargs.pop("stop_sequences", None) or ())
            kwargs["stop_sequences"] = sequences + stop_string_sequences(stop, tokenizer)
        return cls(**vllm_keywords(kwargs))

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


def _is_zero(value: Any) -> bool:
    """Whether ``value`` is a number equal to 0 (vLLM's greedy temperature); text and bools
    are not numbers here, as the constructor's type check says."""
    if isinstance(value, (str, bool)):
        return False
    try:
        return float(value) == 0.0
    except (TypeError, ValueError):
        return False


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


def override(params: SamplingParams, changes: dict[str, Any]) -> SamplingParams:
    """``params`` with ``changes`` (field names or vLLM aliases), as ``generate``'s keyword
    arguments update its generation config; warpers on a greedy base need ``do_sample``."""
    changes = vllm_keywords(dict(changes))
    unknown = sorted(set(changes) - {f.name for f in fields(SamplingParams)})
    if unknown:
        raise TypeError(
            f"generate() got unexpected keyword arguments {unknown}; it takes SamplingParams "
            f"fields ({sorted(f.name for f in fields(SamplingParams))}) and vLLM's "
            f"{sorted(VLLM_ALIASES)}"
        )
    check_warpers_have_do_sample(changes, decided=params.do_sample)
    return replace(params, **changes)
