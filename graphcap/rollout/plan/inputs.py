"""Checks of one generate() call's inputs, made before any device work.

Every refusal here names the argument and says what to do; what passes is normalised (ids as
long on the backend's device, the mask as 0/1 long; the sampling settings were normalised
before, by :func:`~graphcap.rollout.settings.call.normalise_request`).
docs/configuration.md lists what is refused and why.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from graphcap.errors import RequestTooLargeError, warn_once
from graphcap.rollout.cache.blocks import full_pool_columns
from graphcap.rollout.plan.plan import DecodePath, kv_layout
from graphcap.rollout.plan.scan import ModelScan
from graphcap.rollout.settings.call import CallSettings
from graphcap.rollout.settings.rollout_config import RolloutConfig
from graphcap.rollout.settings.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from graphcap.backend import Backend


@dataclass(frozen=True)
class Call:
    """One generate() call after its checks: what a path's ``run`` takes."""

    input_ids: torch.Tensor  # (R, W) long, on the backend's device
    attention_mask: torch.Tensor  # (R, W) 0/1 long
    settings: CallSettings  # what the call's rows share
    scan: ModelScan  # the call's one pass over the model
    per_prompt: list[SamplingParams]  # one per prompt row
    generator: torch.Generator | None
    request_max_new_tokens: Sequence[int] | None  # continuous path only

    @property
    def draws(self) -> bool:
        """Whether any row samples from the shared generator (sampled, no seed of its own)."""
        return any(p.do_sample and p.seed is None for p in self.per_prompt)


def vocab_size(model: PreTrainedModel) -> int:
    """Token ids the model can read and emit: the smaller of its input and output embedding
    sizes (module attributes, since a quantized module's ``weight`` may be a method), else
    the config's ``vocab_size``."""
    sizes = []
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        size = getattr(module, "num_embeddings", None) or getattr(module, "out_features", None)
        if isinstance(size, int):
            sizes.append(size)
    if sizes:
        return min(sizes)
    return int(model.config.get_text_config().vocab_size)


def infer_attention_mask(input_ids: torch.Tensor, settings: CallSettings | None) -> torch.Tensor:
    """generate()'s mask for ``attention_mask=None``: pad ids are padding when the pad id occurs
    in the prompts and is not an EOS id; otherwise every token is attended."""
    pad = None if settings is None else settings.pad_token_id
    if pad is None or pad in settings.eos_ids or not bool((input_ids == pad).any()):
        return torch.ones_like(input_ids, dtype=torch.long)
    return (input_ids != pad).long()


def check_model_device(scan: ModelScan, device: torch.device) -> None:
    """Every parameter and buffer must live on the backend's device (none on ``meta``)."""
    misplaced = scan.misplaced(device)
    if not misplaced:
        return
    meta = [name for name, where in misplaced if where.type == "meta"]
    if meta:
        raise ValueError(
            f"{len(meta)} model tensors are on the meta device and hold no values (e.g. "
            f"{meta[:3]}); load the weights (e.g. model.to_empty(device=...) then "
            "load_state_dict) before generating"
        )
    name, where = misplaced[0]
    raise ValueError(
        f"model tensors are on {where} (e.g. {name!r}, {len(misplaced)} in all) but the backend "
        f"runs on {device}; move the model there first (all of it)"
    )


def check_prompts(
    model: PreTrainedModel,
    scan: ModelScan,
    device: torch.device,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    settings: CallSettings | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts as (long ids, 0/1 long mask) on ``device``; ``scan``: the call's
    pass over the model (its tensors must all be on ``device``).

    ``attention_mask=None`` is inferred from ``settings.pad_token_id`` as generate infers it.
    A list of token-id lists (vLLM's and verl's ragged prompts) is left-padded with the pad id.
    """
    if isinstance(input_ids, (list, tuple)):
        if attention_mask is not None:
            raise ValueError(
                "input_ids holds ragged prompts (a list of token-id lists) and attention_mask "
                "is given; the engine builds the mask itself: pass attention_mask=None"
            )
        input_ids, attention_mask = left_pad(
            input_ids, None if settings is None else settings.pad_token_id
        )
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a 2-D tensor (batch, prompt_width)")
    if input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids is empty: shape {tuple(input_ids.shape)}")
    for name, tensor in (("input_ids", input_ids), ("attention_mask", attention_mask)):
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
            raise ValueError(f"{name} is on the meta device and holds no values")
    check_model_device(scan, device)
    vocab = vocab_size(model)
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(
            f"input_ids holds token id {low if low < 0 else high}, outside the model's "
            f"vocabulary [0, {vocab}); check the tokenizer matches the model"
        )
    inferred = attention_mask is None
    if inferred:
        attention_mask = infer_attention_mask(input_ids, settings)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"attention_mask must be a tensor or None, got {type(attention_mask).__name__}"
        )
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids "
            f"shape {tuple(input_ids.shape)}"
        )
    if ((attention_mask != 0) & (attention_mask != 1)).any():
        raise ValueError(
            "attention_mask must contain only 0 (padding) and 1 (token); it marks padding, "
            "it does not weight tokens"
        )
    mask = attention_mask.to(torch.long)
    if (mask.sum(-1) == 0).any():
        raise ValueError("a prompt row has no tokens (attention_mask all zero)")
    if (mask[:, 1:] < mask[:, :-1]).any():
        source = (
            f" (attention_mask=None: inferred from pad_token_id={settings.pad_token_id}, as "
            "generate does; pass an explicit mask if that id is also a real token)"
            if inferred and settings is not None
            else ""
        )
        raise ValueError(
            "attention_mask is right-padded (a 0 after a 1); the rollout engine needs left "
            f"padding: set tokenizer.padding_side = 'left'{source}"
        )
    return input_ids.to(device=device, dtype=torch.long), mask.to(device)


def left_pad(rows: Sequence[Sequence[int]], pad: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged prompts as one left-padded (ids, 0/1 mask) pair."""
    ids = []
    for i, row in enumerate(rows):
        if callable(getattr(row, "tolist", None)):  # a tensor or numpy array of ids
            row = row.tolist()
        if (
            isinstance(row, (str, int))
            or not isinstance(row, Sequence)
            or len(row) == 0
            or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in row)
        ):
            raise ValueError(
                f"input_ids: ragged prompt {i} must be a non-empty list of int token ids, got "
                f"{row!r}; pass "
                "a list of token-id lists, or a left-padded 2-D tensor with its attention_mask"
            )
        ids.append([int(t) for t in row])
    if not ids:
        raise ValueError("input_ids is an empty list of prompts; give at least one")
    if pad is None:
        raise ValueError("ragged input_ids need a pad id: set SamplingParams(pad_token_id=...)")
    width = max(len(row) for row in ids)
    padded = torch.tensor([[pad] * (width - len(row)) + row for row in ids], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in ids])
    return padded, mask


def check_generator(generator: torch.Generator | None, device: torch.device) -> None:
    """The generator must be one, and draw on the device the sampler runs on."""
    if generator is None:
        return
    if not isinstance(getattr(generator, "device", None), torch.device):
        raise TypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}"
        )
    if generator.device.type != device.type:
        raise ValueError(
            f"generator is on {generator.device} but the backend samples on "
            f"{device}; pass torch.Generator(device={str(device)!r})"
        )
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}"
        )


def check_vocab_ids(model: PreTrainedModel, settings: CallSettings) -> None:
    """EOS and pad ids must index the vocabulary (they index device tables in the step)."""
    vocab = vocab_size(model)
    checks = (
        ("eos_token_id", settings.eos_ids),
        ("pad_token_id", (settings.pad_token_id,)),
        ("stop_token_ids", settings.stop_ids),  # the EOS ids (checked above), then the stop ids
        ("stop_sequences", [i for seq in settings.stop_sequences for i in seq]),
    )
    if settings.top_logprobs > vocab:
        raise ValueError(
            f"top_logprobs {settings.top_logprobs} asks for more alternatives than the "
            f"vocabulary [0, {vocab}) has"
        )
    for name, ids in checks:
        for token in ids:
            if not 0 <= int(token) < vocab:
                raise ValueError(f"{name} {token} is outside the vocabulary [0, {vocab})")


def learned_position_table(model: torch.nn.Module, positions: int) -> bool:
    """Whether the model looks positions up in a table (GPT-2 ``wpe``, OPT): an embedding
    besides the token embedding with at least ``positions`` rows. Rotary and ALiBi models
    have none, and run past ``max_position_embeddings`` (with degraded quality)."""
    tokens = model.get_input_embeddings()
    return any(
        isinstance(m, torch.nn.Embedding) and m is not tokens and m.num_embeddings >= positions
        for m in model.modules()
    )


def check_positions(model: PreTrainedModel, width: int, max_new_tokens: int) -> None:
    """Refuse a call whose positions run past a learned position table (an index error deep
    in the model otherwise); past a rotary model's ``max_position_embeddings``, warn once,
    as generate does."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if not isinstance(limit, int):
        return
    needed = width + max_new_tokens - 1  # the last chosen token is never fed back
    if learned_position_table(model, limit):
        if needed > limit:
            fits = limit - width + 1
            hint = (
                f"lower max_new_tokens to {fits}"
                if fits >= 1
                else "the prompt alone is too long: truncate it"
            )
            raise ValueError(
                f"prompt width {width} + max_new_tokens {max_new_tokens} needs {needed} "
                f"positions but {type(model).__name__} has a learned table of {limit} "
                f"(config.max_position_embeddings); {hint}"
            )
    elif width + max_new_tokens > limit:
        warn_once(
            f"prompt width + max_new_tokens exceeds {type(model).__name__}'s "
            f"max_position_embeddings ({limit}); as with generate, outputs past it may degrade"
        )


def kv_bytes_per_token(model: PreTrainedModel, itemsize: int, shards: int = 1) -> int:
    """Bytes of keys and values one token keeps in every layer's cache, its K/V heads divided
    over ``shards`` tensor-parallel ranks."""
    config = model.config.get_text_config()
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(config, "num_key_value_heads", 0) or heads)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    head_dim = int(getattr(config, "head_dim", 0) or (hidden // heads if heads else 0))
    return layers * max(kv_heads // shards, 1) * head_dim * 2 * itemsize


def request_bytes(
    model: PreTrainedModel,
    dtype: torch.dtype,
    batch: int,
    total: int,
    prompt_rows: int,
    width: int,
    shards: int = 1,
    block_size: int | None = None,
    records: int = 0,
) -> int:
    """What a call whose rows run to ``total`` allocates at least: the KV cache (``batch x
    total`` columns; on a block table of ``block_size``, its pools rounded to whole blocks) and
    the prefill's (``prompt_rows x width``), the decode buffers, the per-step scores and the
    ``records`` (``output_scores`` / ``output_logits``: ``batch x total x vocab`` float32 each)
    the call keeps. K/V heads are divided over ``shards`` tensor-parallel ranks."""
    itemsize = dtype.itemsize
    kv_per_token = kv_bytes_per_token(model, itemsize, shards)
    columns = batch * total if block_size is None else full_pool_columns(batch, total, block_size)
    cache = (columns + prompt_rows * width) * kv_per_token
    # sequences (long), response and valid (bool), logprobs (float32), one mask row
    buffers = batch * total * (8 + 1 + 1 + 4 + itemsize)
    scores = (3 + records * total) * batch * vocab_size(model) * 4
    return cache + buffers + scores


def check_request(
    model: PreTrainedModel,
    scan: ModelScan,
    backend: Backend,
    config: RolloutConfig,
    settings: CallSettings,
    prompts: tuple[int, int],
    batch: int,
    total: int,
    held: int = 0,
) -> None:
    """Refuse, before any allocation, a call that cannot run: positions past a learned table,
    or more memory than ``config.max_request_bytes`` or than the backend says is available.

    ``prompts``: (rows, width) of ``input_ids``; ``batch`` / ``total``: the decode batch (rows
    x samples, bucketed) and total length the call allocates for; ``held``: bytes the engine
    already holds from an earlier call, which this call reuses or releases before allocating,
    so they count as available.
    """
    rows, width = prompts
    check_positions(model, width, settings.max_new_tokens)
    slots = config.continuous_batch_size  # the continuous path allocates every slot
    decode_batch = slots if slots is not None else batch
    shards = dist.get_world_size(config.process_group) if config.process_group else 1
    # per-position graphs keep the static cache (the smaller estimate) when the call pins its
    # length; which the plan decides, so the estimate stays a lower bound
    path = DecodePath.PER_POSITION_GRAPH if config.per_position_graphs else DecodePath.STATIC_GRAPH
    block_size = kv_layout(config, backend, path)
    asked = {"output_scores": settings.output_scores, "output_logits": settings.output_logits}
    records = [name for name, on in asked.items() if on]
    need = request_bytes(
        model, scan.dtype, decode_batch, total, rows, width, shards, block_size, len(records)
    )
    source = " = RolloutConfig.continuous_batch_size" if slots is not None else ""
    limits = [(config.max_request_bytes, "RolloutConfig.max_request_bytes")]
    available = backend.memory_available()
    held_note = f" (with {held / 2**30:.2f} GiB the engine holds)" if held else ""
    if available is not None:
        limits.append((available + held, f"available on {backend.device}{held_note}"))
    notes = "" if block_size is None else f", K/V in whole blocks of {block_size} columns"
    remedies = "" if block_size is None else " or RolloutConfig.kv_block_size"
    if records:
        notes += f", {' and '.join(records)} recording batch x total length x vocabulary"
        remedies += f", or leave {' / '.join(records)} off"
    for limit, what in limits:
        if limit is not None and need > limit:
            raise RequestTooLargeError(
                f"this request would allocate at least {need / 2**30:.2f} GiB (batch "
                f"{decode_batch}{source} x total length {total}: prompt width {width} + "
                f"max_new_tokens {settings.max_new_tokens}{notes}) but {limit / 2**30:.2f} GiB "
                f"is {what}; lower max_new_tokens or the batch{remedies}"
            )
