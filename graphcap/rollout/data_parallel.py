"""Data-parallel rollouts: one engine per rank, the prompts split across ranks, rows gathered.

Every rank holds the whole model (or its tensor-parallel replica) and its own
:class:`~graphcap.rollout.RolloutEngine`; each rank passes the same full batch of prompts, decodes
its contiguous share independently (no agreement between data-parallel ranks is needed: their
forwards share no collective) and receives every row back in the original order. See
docs/distributed.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from transformers import GenerationConfig

from graphcap.rollout.engine import RolloutEngine
from graphcap.rollout.plan import DecodePath
from graphcap.rollout.results import RolloutResult, RolloutStats
from graphcap.rollout.settings.sampling_params import SamplingParams

_ROW_FIELDS = ("sequences", "response_mask", "response_lengths", "logprobs")


def shard_bounds(rows: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, stop)`` of the prompts rank ``rank`` of ``world`` decodes: contiguous shares
    whose sizes differ by at most one (the first ``rows % world`` ranks take one more)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world) with world >= 1, got {rank} of {world}")
    base, extra = divmod(rows, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def rank_seed(seed: int, rank: int) -> int:
    """The seed rank ``rank`` samples with when the call's seed is ``seed``: ``seed + rank``,
    so ranks draw different numbers and a run is reproducible for a fixed world size."""
    return seed + rank


def rank_sampling(
    sampling: SamplingParams | GenerationConfig | None, rank: int
) -> SamplingParams | GenerationConfig | None:
    """The settings rank ``rank`` runs: a call seed becomes :func:`rank_seed`'s, except a
    ``per_request_seed`` (``from_vllm``), which is every prompt's own on every rank."""
    if not isinstance(sampling, SamplingParams) or sampling.seed is None:
        return sampling
    if sampling.per_request_seed:
        return sampling
    return dataclasses.replace(sampling, seed=rank_seed(sampling.seed, rank))


def generate_data_parallel(
    engine: RolloutEngine,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    sampling: SamplingParams | GenerationConfig | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    request_max_new_tokens: Sequence[int] | None = None,
) -> RolloutResult:
    """Generate on this rank's share of the prompts; every rank returns all rows, in order.

    Call it on every rank of ``group`` (default: the whole job) with the same ``input_ids``
    (left-padded, as for ``generate``). Rows come back on the CPU; ``stats`` are this rank's own
    call's (a rank without prompts reports an empty ``"eager"`` call). With
    ``SamplingParams(seed=s)`` rank ``r`` samples with seed ``s + r`` (:func:`rank_seed`):
    sampled tokens depend on the world size, greedy ones do not; a ``per_request_seed``
    (``from_vllm``) is every prompt's own on every rank.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "generate_data_parallel needs an initialised torch.distributed job (run under "
            "torchrun and call torch.distributed.init_process_group first)"
        )
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rows = input_ids.shape[0]
    if request_max_new_tokens is not None and len(request_max_new_tokens) != rows:
        raise ValueError(
            f"request_max_new_tokens has {len(request_max_new_tokens)} entries for {rows} prompts"
        )
    start, stop = shard_bounds(rows, rank, world)
    sampling = rank_sampling(sampling, rank)
    part = None
    stats = RolloutStats(path=DecodePath.EAGER.value)
    if stop > start:
        result = engine.generate(
            input_ids[start:stop],
            None if attention_mask is None else attention_mask[start:stop],
            sampling,
            request_max_new_tokens=(
                None if request_max_new_tokens is None else request_max_new_tokens[start:stop]
            ),
        )
        stats = result.stats
        part = {name: _cpu(getattr(result, name)) for name in _ROW_FIELDS}
        part["finish_reasons"] = result.finish_reasons
    parts: list[dict | None] = [None] * world
    dist.all_gather_object(parts, part, group=group)
    shares = [p for p in parts if p is not None]
    return RolloutResult(
        **{name: _cat([p[name] for p in shares]) for name in _ROW_FIELDS},
        finish_reasons=[reason for p in shares for reason in p["finish_reasons"]],
        stats=stats,
    )


def _cpu(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().cpu()


def _cat(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if not tensors or tensors[0] is None else torch.cat(tensors)
