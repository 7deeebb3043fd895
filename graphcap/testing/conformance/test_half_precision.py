"""Attention in fp16 and bf16: fused kernels that take no fp32 are certified here.

The engine checks elsewhere run the conformance models in fp32, which some fused kernels
(Ascend's fused inference attention, for one) refuse. Here every attention the plugin offers,
the backend's graph attention and SDPA (the baseline every backend has, so the check runs
everywhere) attend one decode step in each half precision: eagerly, then captured and replayed
with new queries, masks (in the backend's ``mask_form``) and lengths, each time within
half-precision rounding of a float64 reference. A block-aware implementation
(:func:`graphcap.kv_blocks.reads_kv_blocks`) gets the layer pools and a block table with rows of
different lengths; on a backend that takes KV lengths on the host, each replay follows
:meth:`Backend.update_graph_kv_lengths`, as in the engine.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from graphcap import kv_blocks
from graphcap.backend import Backend
from graphcap.registry import register_attention_implementations
from graphcap.rollout.holder.capture import capture_step
from graphcap.testing.conformance.replay import replay

ROWS, HEADS, KV_HEADS, HEAD_DIM = 3, 4, 2, 64
#: Relative error (Frobenius norm) a half-precision decode step may have against float64:
#: about 8x (fp16) and 5x (bf16) what rounding the exact output to the dtype costs (SDPA on the
#: CPU comes within 1.2x of that), room for kernels that accumulate in half precision.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _implementations(backend: Backend) -> list[str]:
    names = ["sdpa", *register_attention_implementations(backend)]
    if backend.capabilities.graph_attention is not None:
        names.append(backend.capabilities.graph_attention)
    return list(dict.fromkeys(names))


def _function(name: str):
    return sdpa_attention_forward if name == "sdpa" else ALL_ATTENTION_FUNCTIONS[name]


class _Layer(torch.nn.Module):
    """What attention functions read off the module: a causal decoder layer, in eval mode."""

    is_causal = True
    num_key_value_groups = HEADS // KV_HEADS


class _Step:
    """One decode step's inputs on the device; :meth:`draw` refills them in place."""

    def __init__(self, backend: Backend, dtype: torch.dtype, block_size: int, blocks: int):
        device, self.block_size, self.columns = backend.device, block_size, blocks * block_size
        self.gen = torch.Generator().manual_seed(0)
        pool = (1 + ROWS * blocks, KV_HEADS, block_size, HEAD_DIM)
        self.q = torch.zeros(ROWS, HEADS, 1, HEAD_DIM, dtype=dtype, device=device)
        self.k_pool = torch.zeros(pool, dtype=dtype, device=device)
        self.v_pool = torch.zeros(pool, dtype=dtype, device=device)
        order = torch.randperm(ROWS * blocks, generator=self.gen) + 1  # block 0: never used
        table = order.view(ROWS, blocks).to(torch.int32)
        self.view = kv_blocks.BlockView(
            table.to(device), torch.ones(ROWS, dtype=torch.int32, device=device), block_size
        )
        #: the mask in the backend's ``mask_form``, as the engine's decode step renders it
        self.additive = backend.capabilities.mask_form == "additive"
        mask_dtype = dtype if self.additive else torch.bool
        self.mask = torch.zeros(ROWS, 1, 1, self.columns, dtype=mask_dtype, device=device)
        self.open = torch.zeros(ROWS, 1, 1, self.columns, dtype=torch.bool, device=device)

    def draw(self, lengths: list[int]) -> None:
        """New queries, K/V, lengths and a mask (each row's columns below its length, a row's
        left padding closed)."""
        dtype = self.q.dtype
        for tensor in (self.q, self.k_pool, self.v_pool):
            tensor.copy_(torch.randn(tensor.shape, generator=self.gen).to(dtype))
        self.view.lengths.copy_(torch.tensor(lengths, dtype=torch.int32))
        open_ = torch.arange(self.columns)[None] < torch.tensor(lengths)[:, None]
        open_[1, :2] = False  # row 1 is left-padded
        self.open.copy_(open_[:, None, None].to(self.open.device))
        if self.additive:
            closed = torch.finfo(self.mask.dtype).min
            self.mask.copy_(torch.where(self.open, 0.0, closed).to(self.mask.dtype))
        else:
            self.mask.copy_(self.open)

    def contiguous(self) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_blocks.gather(self.k_pool, self.view), kv_blocks.gather(self.v_pool, self.view)

    def reference(self) -> torch.Tensor:
        k, v = (t.double() for t in self.contiguous())
        out = F.scaled_dot_product_attention(
            self.q.double(), k, v, attn_mask=self.open, scale=HEAD_DIM**-0.5, enable_gqa=True
        )
        return out.transpose(1, 2)  # (rows, 1, heads, dim), as attention functions return


def _attend(name: str, step: _Step) -> torch.Tensor:
    function = _function(name)
    if kv_blocks.is_block_aware(function):
        with kv_blocks.reading_blocks(step.view):
            key, value = step.k_pool, step.v_pool
            return function(_Layer(), step.q, key, value, step.mask, scaling=HEAD_DIM**-0.5)[0]
    key, value = step.contiguous()
    return function(_Layer(), step.q, key, value, step.mask, scaling=HEAD_DIM**-0.5)[0]


def _assert_close(out: torch.Tensor, step: _Step, what: str) -> None:
    ref = step.reference()
    error = ((out.double() - ref).norm() / ref.norm()).item()
    assert error < TOLERANCE[step.q.dtype], (
        f"{what}: relative error {error:.2e} against float64 is over "
        f"{TOLERANCE[step.q.dtype]:.0e} ({step.q.dtype})"
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_attention_in_half_precision_eager_and_replayed(
    gc_backend: Backend, dtype: torch.dtype
) -> None:
    for name in _implementations(gc_backend):
        check_attention(gc_backend, name, dtype)


def check_attention(backend: Backend, name: str, dtype: torch.dtype) -> None:
    """Attention ``name`` on one decode step in ``dtype``: eager, then (where the backend
    captures) replayed twice with new inputs, each within rounding of float64."""
    block_size = backend.capabilities.kv_block_size or 16
    step = _Step(backend, dtype, block_size, blocks=3)
    first = [3 * block_size, 2 * block_size - 3, 5]
    step.draw(first)
    _assert_close(_attend(name, step), step, f"{name}, eager")
    if not backend.capabilities.graph_capture:
        return
    out: dict[str, torch.Tensor] = {}
    mutable = [step.q, step.k_pool, step.v_pool, step.mask, step.open, step.view.lengths]
    graph = capture_step(backend, lambda: out.update(y=_attend(name, step)), mutable, None)
    aware = kv_blocks.is_block_aware(_function(name))
    host_lengths = aware and backend.capabilities.graph_kv_lengths_on_host
    # the second replay's row 1 is longer than the first's: stale lengths would cut it short
    for lengths in (first, [block_size + 1, 3 * block_size, 1]):
        step.draw(lengths)
        if host_lengths:
            backend.update_graph_kv_lengths(graph, lengths)
        replay(backend, graph)
        _assert_close(out["y"], step, f"{name}, replayed with lengths {lengths}")
