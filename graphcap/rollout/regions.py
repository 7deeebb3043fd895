"""``RolloutConfig(compile=True)``: the blocks around attention run compiled in the captured step.

A captured step still launches every small kernel eager PyTorch issues: an RMSNorm is about
eight, an MLP's activation two, some 1,500 a step on llama-8b (run G's profile). Compiling the
whole forward fuses them, but costs tens of seconds per batch size and was slower than the plain
graph at batch 64 on the H200 (runs D and F). PyTorch's regional compilation compiles the
repeated blocks instead: a block class is traced once and its code is shared by every layer, so
the first call pays seconds. The blocks are the children of each decoder layer that hold no
attention (norms, MLPs): attention, its cache writes and the backend's graph attention stay
eager. Measured in benchmarks/results/h200/2026-12-01/step-variants-*.json.
"""

from __future__ import annotations

import contextlib

import torch

from graphcap.rollout.swap import forwards_swapped


def _is_attention(module: torch.nn.Module) -> bool:
    """transformers' attention modules carry their ``layer_idx`` (the cache slot they write);
    some decoder layers do too, so the attention is the innermost module that does."""
    inner = (m for m in module.modules() if m is not module)
    return hasattr(module, "layer_idx") and not any(hasattr(m, "layer_idx") for m in inner)


def compile_regions(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks ``compile=True`` compiles: the children of each decoder layer (a module with
    an attention child) that hold no attention themselves."""
    layers = [m for m in model.modules() if any(_is_attention(c) for c in m.children())]
    return [
        child
        for layer in layers
        for child in layer.children()
        if not any(_is_attention(m) for m in child.modules())
    ]


def compiled_regions(model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """Within the block, ``model``'s :func:`compile_regions` run through ``torch.compile``; their
    own forwards again after it, so eager steps, the prefill and training never run compiled
    code. Dynamo keeps the compiled code per block class, so re-entering compiles nothing new
    for shapes it has seen (a second batch size makes the code dynamic)."""
    return forwards_swapped([(b, torch.compile(b.forward)) for b in compile_regions(model)])
