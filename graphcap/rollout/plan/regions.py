"""Compiled captures (``RolloutConfig.compile``): the blocks around attention run compiled.

A captured step still launches every small kernel eager PyTorch issues: an RMSNorm is about
eight, an MLP's activation two. Compiling the whole forward fuses them, but costs tens of
seconds per batch size and was slower than the plain graph at larger batches (docs/decisions.md,
decision 11); compiling whole decoder layers recompiles per layer (decision 12).
PyTorch's regional compilation compiles the repeated blocks instead: a block class is traced
once and its code is shared by every layer, so the first call pays seconds. The blocks are
each decoder layer with its attention left out (dynamo compiles the code before and after the
attention as two frames that every layer shares, so the residual add after attention fuses
with the next norm), the attention's own norms, the rotary embedding function the attention
calls, the decoder stack's blocks beside its layers (final norm, rotary embedding), and the
cache's K/V writes (two kernels a layer become one). The backend's graph attention stays as it
is; the projections compute through the backend's one-row product where it offers one
(:func:`one_row_products`: batch-1 steps, where cuBLAS reads the weights well below the
device's bandwidth, decision 20). The step's own work around the model (masks, write
positions, the choice of the next token) compiles too (:func:`compiled_bookkeeping`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, Protocol

import torch

from graphcap.rollout import sampling
from graphcap.rollout.cache.cache import StaticKVCache, put_columns
from graphcap.rollout.cache.swap import attributes_swapped, forwards_swapped
from graphcap.rollout.plan.fusion import ProjectionFusion

#: Inductor options the step's own work compiles with besides the backend's: random draws (the
#: shared generator's ``multinomial``) stay eager's kernels, so a compiled capture draws what
#: the eager loop draws.
BOOKKEEPING_OPTIONS = {"fallback_random": True}

#: The rotary-embedding function transformers' modeling files define and their attention calls
#: (about ten small kernels for q and k per layer when eager).
ROTARY = "apply_rotary_pos_emb"


class Bookkeeping(Protocol):
    """What :func:`compiled_bookkeeping` compiles: a decode step's work before the model
    (``prepare``) and after it (``finish``). A protocol, so this module (which the plan reads)
    needs nothing from graphcap.rollout.step.step, which reads the plan."""

    prepare: Callable[..., Any]
    finish: Callable[..., Any]


def _is_attention(module: torch.nn.Module) -> bool:
    """transformers' attention modules carry their ``layer_idx`` (the cache slot they write);
    some decoder layers do too, so the attention is the innermost module that does."""
    inner = (m for m in module.modules() if m is not module)
    return hasattr(module, "layer_idx") and not any(hasattr(m, "layer_idx") for m in inner)


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if _is_attention(m)]


def _worth_compiling(module: torch.nn.Module) -> bool:
    """State and more than one product: not a lone dropout or activation (nothing to fuse), not
    a lone projection or embedding (a leaf with a matrix: one GEMM or gather either way). A
    rotary embedding holds buffers only and is some ten kernels a step when eager."""
    params = list(module.parameters())
    single = next(module.children(), None) is None and any(p.dim() >= 2 for p in params)
    return bool(params or list(module.buffers())) and not single


def regions_to_compile(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks ``compile=True`` compiles: each decoder layer (a module with an attention
    child; :func:`compiled_regions` runs its attention uncompiled), the children of each
    attention (per-head q/k norms), and the children of the decoder stack beside its layers
    (the final norm, the rotary embedding), where compiling can fuse something."""
    attention = _attention_modules(model)
    ids = {id(a) for a in attention}
    layers = [m for m in model.modules() if any(id(c) in ids for c in m.children())]
    layer_ids = {id(layer) for layer in layers}
    holds_layers = [m for m in model.modules() if any(id(c) in layer_ids for c in m.children())]
    stacks = [m for m in model.modules() if any(c in holds_layers for c in m.children())]
    beside = [
        child
        for parent in stacks
        for child in parent.children()
        if child not in holds_layers and not any(id(m) in ids for m in child.modules())
    ]
    inside = [c for a in attention for c in a.children()]
    return layers + [block for block in beside + inside if _worth_compiling(block)]


def rotary_functions(model: torch.nn.Module) -> list[tuple[ModuleType, Callable[..., Any]]]:
    """Each modeling module of ``model``'s attention classes with the :data:`ROTARY` function
    those attentions call, and the function."""
    modules = {sys.modules[type(a).__module__] for a in _attention_modules(model)}
    found = [(m, getattr(m, ROTARY, None)) for m in modules]
    return [(module, fn) for module, fn in found if callable(fn)]


@contextlib.contextmanager
def one_row_products(
    model: torch.nn.Module,
    product: Callable[..., torch.Tensor],
    fusion: ProjectionFusion | None = None,
) -> Iterator[None]:
    """Within the block, ``model``'s plain ``nn.Linear`` layers and ``fusion``'s joined groups
    compute through ``product`` (a backend's :meth:`~graphcap.backend.Backend.one_row_product`,
    which serves one-row inputs and hands the rest to ``F.linear``). Layers whose forward
    another library replaced are left alone."""

    def through(linear: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            return product(x, linear.weight, linear.bias)

        return forward

    linears = [
        m for m in model.modules() if type(m) is torch.nn.Linear and "forward" not in m.__dict__
    ]
    joined = contextlib.nullcontext() if fusion is None else fusion.products_through(product)
    with forwards_swapped([(linear, through(linear)) for linear in linears]), joined:
        yield


@contextlib.contextmanager
def compiled_regions(
    model: torch.nn.Module,
    cache: StaticKVCache | None = None,
    options: dict[str, Any] | None = None,
) -> Iterator[None]:
    """Within the block, ``model``'s :func:`regions_to_compile` and :func:`rotary_functions` run
    through ``torch.compile`` (with inductor ``options``, the backend's
    :meth:`~graphcap.backend.Backend.compile_options`), and so do the K/V writes of graphcap's
    ``cache`` (one kernel for K and V instead of one each); as they were after it, so eager
    steps, the prefill and training never run compiled code. Dynamo keeps the compiled code per
    block class and function, so re-entering compiles nothing new for shapes it has seen (a
    second batch size makes the code dynamic)."""
    compiled = functools.partial(torch.compile, options=options or None)
    # the attention runs as it is: dynamo breaks each layer around it into two frames
    swaps = [(a, "forward", torch.compiler.disable(a.forward)) for a in _attention_modules(model)]
    swaps += [(b, "forward", compiled(b.forward)) for b in regions_to_compile(model)]
    writes = (
        contextlib.nullcontext() if cache is None else cache.puts_through(compiled(put_columns))
    )
    swaps += [(module, ROTARY, compiled(fn)) for module, fn in rotary_functions(model)]
    with attributes_swapped(swaps), writes:
        yield


@contextlib.contextmanager
def compiled_bookkeeping(
    step: Bookkeeping, options: dict[str, Any] | None = None
) -> Iterator[None]:
    """Within the block, the step's own work around the model runs through ``torch.compile``
    with inductor ``options`` and :data:`BOOKKEEPING_OPTIONS`: ``step.prepare`` (the masks) and
    ``step.finish`` (the write positions, the logits processors, the choice of the next token
    and its records); as they were after it. Eager, they are over a dozen small kernels a step
    that do not launch dependent; compiled, fewer that do, and the step is faster
    (docs/decisions.md, decision 15)."""
    compiled = functools.partial(torch.compile, options={**(options or {}), **BOOKKEEPING_OPTIONS})
    swaps = [(step, name, compiled(getattr(step, name))) for name in ("prepare", "finish")]
    swaps.append((sampling, "cumulative_sum", eager_cumulative_sum()))
    with attributes_swapped(swaps):
        yield


@functools.cache
def eager_cumulative_sum() -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`~graphcap.rollout.sampling.cumulative_sum` under ``torch.compiler.disable``, which
    compiled steps call (an inductor bug, see there). Built at the first compiled capture, not
    at import (the decorator imports dynamo, half a second), and once (a new wrapper would fail
    the compiled code's guards and compile the step again)."""
    return torch.compiler.disable(sampling.cumulative_sum)
