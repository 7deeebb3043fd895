"""graphcap under an existing model's ``generate``: one call to put it there, one to take it off.

Trainers that do not use vLLM (TRL's GRPOTrainer and RLOOTrainer, many PPO/GRPO loops) call the
policy's own ``model.generate(input_ids, attention_mask=..., generation_config=...)``.
:func:`accelerate_generate` replaces ``generate`` on the model instance with one that serves what
the engine can serve through a held :class:`~graphcap.rollout.engine.RolloutEngine` and returns
what ``generate`` returns (the same tensor, or a ``GenerateDecoderOnlyOutput`` with the same
fields); every other call goes to the original ``generate`` with the reason recorded.

The generation settings are resolved as ``generate`` resolves them
(:mod:`graphcap.rollout.settings.generate_call`). Like ``generate``, a call leaves the model's
train/eval flags as they are (TRL calls it in ``train()``) and runs under ``no_grad`` with
gradient checkpointing off, which is restored after.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import transformers
from packaging.version import Version
from transformers import GenerationConfig

from graphcap.errors import GenerateFallbackWarning, RequestTooLargeError, WouldRunEagerlyError
from graphcap.rollout.engine import RolloutEngine
from graphcap.rollout.exact import trainer_exact
from graphcap.rollout.results import RolloutStats
from graphcap.rollout.settings.generate_call import resolved_config, sampling_for
from graphcap.rollout.settings.rollout_config import RolloutConfig
from graphcap.rollout.settings.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger("graphcap.rollout")

#: ``generate`` keyword arguments that change nothing when empty / ``None`` / ``False``.
NEUTRAL_KWARGS: tuple[str, ...] = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "tokenizer",
)


@dataclass
class DropInStats:
    """What the drop-in did since it was installed: ``served`` calls ran on graphcap's engine
    (``last`` holds the latest one's stats), the others went to ``generate`` for the reasons
    counted in ``fallbacks``."""

    served: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)
    last: RolloutStats | None = None
    replays: int = 0
    captures: int = 0

    @property
    def calls(self) -> int:
        return self.served + sum(self.fallbacks.values())


class AcceleratedGenerate:
    """The installed ``generate`` of one model: the engine, the original method, the stats."""

    def __init__(
        self, model: PreTrainedModel, config: RolloutConfig, sleep_between_calls: bool | None
    ) -> None:
        self.model = model
        self.engine = RolloutEngine(model, config)
        keeps = self.engine.backend.capabilities.keeps_addresses_on_release
        #: whether the engine gives its memory back after every served call (see
        #: :func:`accelerate_generate`)
        self.sleep_between_calls = (
            keeps and config.sleep_keeps_graphs
            if sleep_between_calls is None
            else sleep_between_calls
        )
        self.original: Callable[..., Any] = model.generate
        self.stats = DropInStats()
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        #: the thread inside a served call (a nested call from it must not wait on the lock)
        self._serving: int | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._serving == threading.get_ident():
            self._fall_back(NESTED)
            return self.original(*args, **kwargs)
        request, reason = self._request(args, kwargs)
        if reason is None:
            try:
                served = self._serve(request)
            except RequestTooLargeError as exc:  # generate gets the memory the engine held
                self.engine.sleep()
                reason = f"graphcap refused the call: {exc}; its buffers were freed for generate"
            except (ValueError, TypeError) as exc:  # refused by the engine's input checks
                reason = f"graphcap refused the call: {exc}"
            else:
                if served is not None:
                    return served
        if reason is not None:
            self._fall_back(reason)
        if self.engine.config.trainer_exact:  # generate's forwards are the trainer's too
            with trainer_exact(self.model, self.engine.backend):
                return self.original(*args, **kwargs)
        return self.original(*args, **kwargs)

    def restore(self) -> None:
        """Put the original ``generate`` back and release the engine's buffers and graphs."""
        if self.model.__dict__.get("generate") is self.patched:
            del self.model.generate
        self.engine.shutdown()

    @functools.cached_property
    def patched(self) -> InstalledGenerate:
        """What is installed as the model's ``generate``."""
        return InstalledGenerate(self)

    def _request(self, args: tuple, kwargs: dict[str, Any]) -> tuple[Request | None, str | None]:
        """The call as graphcap would serve it, or the reason it goes to ``generate``."""
        try:
            bound = inspect.signature(self.original).bind(*args, **kwargs)
        except TypeError as exc:
            return None, f"generate() rejects these arguments ({exc})"
        given = dict(bound.arguments)
        given.update(given.pop("kwargs", {}))
        input_ids = given.pop("inputs", None)
        if input_ids is None:
            input_ids = given.pop("input_ids", None)
        attention_mask = given.pop("attention_mask", None)
        generation_config = given.pop("generation_config", None)
        busy = sorted(k for k in NEUTRAL_KWARGS if k in given and _active(given.pop(k)))
        if busy:
            return None, f"generate() arguments graphcap does not take: {busy}"
        if not isinstance(input_ids, torch.Tensor):
            return None, "no input_ids tensor (inputs_embeds or another input form)"
        dropout = active_dropout(self.model)
        if dropout:
            return None, (
                f"the model is in train() with dropout on ({', '.join(dropout[:3])}): generate "
                "draws dropout masks in every forward, a captured rollout cannot match them; "
                "call model.eval() (or set the dropout probabilities to 0) to be served"
            )
        settings = resolved_config(self.model, generation_config, given)
        if isinstance(settings, str):
            return None, settings
        config, forward_kwargs = settings
        if forward_kwargs:
            return None, f"model inputs graphcap does not pass on: {sorted(forward_kwargs)}"
        sampling = sampling_for(self.model, config, input_ids.shape[-1])
        if isinstance(sampling, str):
            return None, sampling
        if sampling.repetition_penalty != 1 and PENALISES_PADDING and _padded(attention_mask):
            return None, (
                f"transformers {transformers.__version__} applies the repetition penalty to "
                "left-padding tokens too (5.23 stopped); graphcap never does"
            )
        return Request(input_ids, attention_mask, sampling, config), None

    def _serve(self, request: Request) -> Any | None:
        """The call served by the engine, or ``None`` where the engine's plan would run its
        steps eagerly (graphcap's eager loop is no faster than ``generate``, so ``generate``
        serves those): the engine answers before the call runs (``require_graph``)."""
        with self._lock:
            self._serving = threading.get_ident()
            try:
                result = self.engine.generate(
                    request.input_ids,
                    request.attention_mask,
                    request.sampling,
                    require_graph=True,
                )
                if self.sleep_between_calls:  # the trainer gets the memory until the next call
                    self.engine.sleep()
            except WouldRunEagerlyError as exc:
                self._fall_back(f"no graph for this call: {exc.reason}")
                return None
            finally:
                self._serving = None
        width = request.input_ids.shape[-1]
        # generate stops once every row has finished: its width is the longest response
        sequences = result.sequences[:, : width + int(result.response_lengths.max())]
        stats = self.stats
        stats.served += 1
        if stats.served == 1:  # one line says graphcap serves (the logger's level silences it)
            logger.info(
                "graphcap: model.generate is served by graphcap's engine (backend %s, path %s)",
                self.engine.backend.name,
                result.stats.path,
            )
        stats.last = result.stats
        stats.replays += result.stats.replays
        stats.captures = result.stats.captures
        if not request.config.return_dict_in_generate:
            return sequences
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        steps = sequences.shape[1] - width
        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=_per_step(result.scores, steps),
            logits=_per_step(result.logits, steps),
        )

    def _fall_back(self, reason: str) -> None:
        self.stats.fallbacks[reason] += 1
        logger.info("graphcap: model.generate served by transformers: %s", reason)
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(
                f"graphcap: this generate() call runs transformers' own generate: {reason}",
                GenerateFallbackWarning,
                stacklevel=4,
            )


class InstalledGenerate:
    """The model's ``generate`` while graphcap serves it: calls ``graphcap`` (the
    :class:`AcceleratedGenerate`), with the original's signature and doc.

    A copy of the model (``copy.deepcopy``, ``pickle``, ``torch.save``) gets its own class's
    plain ``generate`` in this one's place: the copy has its own weights, and an engine is bound
    to the model it was built for (its graphs read that model's parameters), so a copy must not
    run it; ``accelerate_generate(copy)`` gives the copy an engine of its own. A saved model
    therefore loads without graphcap.
    """

    def __init__(self, graphcap: AcceleratedGenerate) -> None:
        self.graphcap = graphcap
        functools.update_wrapper(self, graphcap.original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.graphcap(*args, **kwargs)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        # rebuilt before the copy's __dict__ is filled in: the lookup finds its class's generate
        return getattr, (self.graphcap.model, "generate")


def _per_step(record: torch.Tensor | None, steps: int) -> tuple[torch.Tensor, ...] | None:
    """A ``(rows, steps, vocab)`` record as generate's tuple of one ``(rows, vocab)`` a step."""
    return None if record is None else tuple(record[:, t] for t in range(steps))


@dataclass(frozen=True)
class Request:
    """A ``generate`` call graphcap serves."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    sampling: SamplingParams
    config: GenerationConfig


#: Why a ``generate`` call made while this thread's served call runs (from a forward hook, a
#: streamer, a stopping criterion) goes to transformers: the engine is busy with the outer call.
NESTED = "a generate() call nested inside a call graphcap is serving"


DROPOUTS = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


def active_dropout(model: torch.nn.Module) -> list[str]:
    """The modules (by name) that apply dropout in this forward: in training mode with a
    ``torch.nn.Dropout`` of p > 0 or a float ``*dropout`` attribute > 0 (attention modules keep
    their probability as ``attention_dropout`` and apply it only while training)."""
    found = []
    for name, module in model.named_modules():
        if not module.training:
            continue
        if isinstance(module, DROPOUTS):
            if module.p > 0:
                found.append(name)
            continue
        if any(
            "dropout" in key and isinstance(value, float) and value > 0
            for key, value in vars(module).items()
        ):
            found.append(name)
    return found


#: Whether this transformers' repetition penalty also penalises the pad id where it fills the
#: prompts' left padding (before 5.23); graphcap's looks only at real tokens.
PENALISES_PADDING = Version(transformers.__version__) < Version("5.23")


def _padded(attention_mask: torch.Tensor | None) -> bool:
    """Whether some prompt is padded (unknown without a mask: taken as padded)."""
    return attention_mask is None or bool((attention_mask == 0).any())


def _active(value: Any) -> bool:
    """Whether a keyword argument asks for something (an empty processor list does not)."""
    if value is None or value is False:
        return False
    return not (isinstance(value, (list, tuple)) and len(value) == 0)


def generating_model(model: torch.nn.Module) -> PreTrainedModel:
    """The module whose ``generate`` runs in the end: through DDP / accelerate / DeepSpeed
    wrappers (``.module``) and PEFT (``get_base_model()``: a PEFT model's ``generate`` calls the
    base model's)."""
    while not hasattr(model, "generation_config") and isinstance(
        getattr(model, "module", None), torch.nn.Module
    ):
        model = model.module
    base = getattr(model, "get_base_model", None)
    if callable(base):
        model = base()
    if not callable(getattr(model, "generate", None)):
        raise TypeError(
            f"{type(model).__name__} has no generate(); pass a transformers model (or a wrapper "
            "of one: DDP, accelerate, PEFT)"
        )
    return model


def drop_in_default_config() -> RolloutConfig:
    """The config :func:`accelerate_generate` uses when given none: graphs where the backend
    can (the engine's default; calls it would run eagerly go to ``generate``); total lengths
    padded to powers of two (trainers pass prompts of a new width every call; each bucket is
    one graph, captured once); the finished flag read after every step, as ``generate`` reads
    it (:func:`drop_in_config`). Extend it with ``dataclasses.replace``."""
    return RolloutConfig(eos_check_interval=1)


def drop_in_config(config: RolloutConfig) -> RolloutConfig:
    """The config the drop-in runs for ``config``. Under ``draws="generate"`` (generate's own
    random numbers), what makes a sampled call draw exactly the numbers ``generate`` draws (so
    this call's tokens and every later call's match) is set here, whatever ``config`` says: the
    finished flag is read after every step (``eos_check_interval=1``: a call whose rows all end
    early stops on generate's step, not up to an interval later, drawing for steps generate
    never ran), and the batch is not padded (``batch_buckets``: a padding row would draw too).
    A batch bucket, or an interval chosen other than the default, is dropped with a warning;
    the continuous path, which samples its rows in another order, is refused. Per-row draws
    (the default) take one number from the generator per call whatever the call's shape, so
    ``config`` is used as it is."""
    if config.draws != "generate":
        return config
    if config.continuous_batch_size is not None:
        raise ValueError(
            'accelerate_generate with draws="generate" serves generate()\'s calls on the static '
            "path: continuous_batch_size samples rows in another order than generate (drop it, "
            'or use draws="per_row")'
        )
    default = RolloutConfig.__dataclass_fields__["eos_check_interval"].default
    dropped = [f"batch_buckets={config.batch_buckets}"] if config.batch_buckets else []
    if config.eos_check_interval not in (1, default):
        dropped.append(f"eos_check_interval={config.eos_check_interval}")
    if dropped:
        warnings.warn(
            f"graphcap: accelerate_generate runs without {', '.join(dropped)} (it uses "
            "eos_check_interval=1 and no batch buckets, so sampled calls draw generate's "
            "random numbers)",
            UserWarning,
            stacklevel=3,
        )
    return dataclasses.replace(config, eos_check_interval=1, batch_buckets=None)


def accelerate_generate(
    model: torch.nn.Module,
    config: RolloutConfig | None = None,
    *,
    sleep_between_calls: bool | None = None,
) -> AcceleratedGenerate:
    """Serve ``model.generate`` with graphcap's engine until :func:`restore_generate`.

    ``model``: a transformers model, or a wrapper of one (DDP, accelerate-prepared, PEFT): the
    replacement is installed on the model whose ``generate`` finally runs, so calls through the
    wrapper reach it. ``config``: the engine's settings (default:
    :func:`drop_in_default_config`), as :func:`drop_in_config` adjusts them.
    ``sleep_between_calls``: the engine gives its device memory back when a served call ends
    (``engine.sleep()``) and maps it again at the next one, as ``generate`` frees its cache.
    ``None`` (the default): where that keeps the graphs
    (``Capabilities.keeps_addresses_on_release`` and ``config.sleep_keeps_graphs``), so a call
    pays only the mapping (``stats.last.wake_s``); elsewhere the engine holds its memory, since
    a sleep there means capturing again at every call.
    Returns the installed object (``.stats``, ``.engine``, ``.restore()``).
    """
    target = generating_model(model)
    installed = getattr(target.__dict__.get("generate"), "graphcap", None)
    if installed is not None:
        raise RuntimeError(
            "graphcap already serves this model's generate(); call "
            "graphcap.rollout.restore_generate(model) first to change its config"
        )
    config = drop_in_config(config or drop_in_default_config())
    accelerated = AcceleratedGenerate(target, config, sleep_between_calls)
    half = getattr(target, "dtype", None) in (torch.float16, torch.bfloat16)
    if half and not config.trainer_exact:  # exact calls compute as the trainer does
        warnings.warn(
            f"graphcap: this model computes in {target.dtype}: served calls are half-precision "
            "rollouts, which graphcap's captured step rounds differently from generate's (its "
            "attention over a padded cache, a backend's graph attention, compiled blocks), so "
            "tokens can part from generate's after a near tie; they equal generate's in float32",
            UserWarning,
            stacklevel=2,
        )
    target.generate = accelerated.patched
    return accelerated


def restore_generate(model: torch.nn.Module) -> bool:
    """Give ``model`` its own ``generate`` back; whether graphcap was installed on it."""
    installed = getattr(generating_model(model).__dict__.get("generate"), "graphcap", None)
    if installed is None:
        return False
    installed.restore()
    return True
