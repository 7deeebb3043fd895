"""The trainer-exact elementwise kernels: the rotary embedding the same bits as the models' own
``apply_rotary_pos_emb``, the MLP's ``silu(gate) * up`` the same bits as torch's on the GPU
(the interpreter's ``exp`` is NumPy's: within tolerance there), both differentiable, and
``trainer_exact`` routing a model's layers through them only inside the block.

Off the GPU they run under Triton's interpreter (conftest.py), in float32 and float16;
bfloat16 on the GPU (``verify`` in benchmarks/h200.sh runs this file there).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the trainer-exact kernels need Triton")

from graphcap_cuda.kernels import exact, exact_pointwise
from graphcap_cuda.kernels.exact_pointwise import rotary, silu_mul
from transformers.models.llama import modeling_llama

from graphcap.cpu.backend import CPUBackend
from graphcap.exact_ops import ExactOps
from graphcap.rollout import trainer_exact
from graphcap.tiny_models import prompts, tiny_model

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def as_attention_makes_them(batch: int, heads: int, positions: int, dtype: torch.dtype):
    """(B, H, S, D) as the attention's ``view(...).transpose(1, 2)`` of a projection gives it:
    not contiguous, unit stride in the last dimension."""
    return randn(batch, positions, heads, 16, dtype=dtype, scale=3.0).transpose(1, 2)


@pytest.mark.parametrize("cos_rows", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_is_the_models_own_bits(dtype, cos_rows):
    """Grouped heads (4 q, 2 k), a projection's strided layout, cos/sin for the batch or for
    each row: q and k equal llama's ``apply_rotary_pos_emb`` bit for bit."""
    torch.manual_seed(0)
    q, k = as_attention_makes_them(3, 4, 5, dtype), as_attention_makes_them(3, 2, 5, dtype)
    angles = randn(cos_rows, 5, 16, scale=4.0)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = rotary(q, k, cos, sin)
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(100) in float32: inf
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_torchs_bits_on_the_gpu(dtype):
    """``silu(gate) * up`` over a wide range of gates (large positive and negative, zero),
    a size that is not a multiple of the block: torch's bits on the GPU, its value within the
    dtype's rounding under the interpreter; an element's result does not depend on where it
    sits (a slice gives the same bits)."""
    torch.manual_seed(1)
    gate = torch.cat(
        [randn(3000, scale=6.0), torch.tensor([0.0, -100.0, 100.0, -0.0], device=DEVICE)]
    )
    gate, up = gate.to(dtype), randn(3004, dtype=dtype)
    got = silu_mul(gate.reshape(4, 751), up.reshape(4, 751)).reshape(-1)
    want = F.silu(gate) * up
    if INTERPRETED:
        torch.testing.assert_close(got, want, rtol=4 * torch.finfo(dtype).eps, atol=1e-30)
    else:
        assert torch.equal(got, want)
    assert torch.equal(silu_mul(gate[1001:2001], up[1001:2001]), got[1001:2001])


def test_gradients_are_torchs():
    """Backward through each kernel equals torch's autograd of the models' formulas
    (float32), cos and sin included where they require it."""
    torch.manual_seed(2)

    def grads(function, *inputs):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        outs = function(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        noise = torch.Generator(DEVICE).manual_seed(9)
        seeds = [torch.randn(o.shape, generator=noise, device=DEVICE) for o in outs]
        torch.autograd.backward(outs, seeds)
        return [leaf.grad for leaf in leaves]

    q, k = (
        as_attention_makes_them(2, 4, 5, torch.float32),
        as_attention_makes_them(2, 2, 5, torch.float32),
    )
    cos, sin = randn(2, 5, 16), randn(2, 5, 16)
    for got, want in zip(
        grads(rotary, q, k, cos, sin),
        grads(modeling_llama.apply_rotary_pos_emb, q, k, cos, sin),
        strict=True,
    ):
        torch.testing.assert_close(got, want)
    gate, up = randn(6, 40, scale=3.0), randn(6, 40)
    for got, want in zip(
        grads(silu_mul, gate, up), grads(lambda g, u: F.silu(g) * u, gate, up), strict=True
    ):
        torch.testing.assert_close(got, want)


class PointwiseBackend(CPUBackend):
    """The CPU reference's operations with the CUDA plugin's elementwise kernels, counted."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def exact_ops(self) -> ExactOps:
        def counted(name, function):
            def call(*args):
                self.calls.append(name)
                return function(*args)

            return call

        reference = super().exact_ops()
        return ExactOps(
            linear=reference.linear,
            attention=reference.attention,
            silu=reference.silu,
            rotary=counted("rotary", exact_pointwise.rotary),
            silu_mul=counted("silu_mul", exact_pointwise.silu_mul),
        )


@pytest.mark.skipif(
    not INTERPRETED, reason="a CPU model; the GPU's is tests/test_device_trainer_exact.py"
)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_trainer_exact_routes_every_layers_rotary_and_mlp_through_them_inside_the_block(family):
    """Inside ``trainer_exact`` each layer's rotary embedding and MLP activation run the
    backend's kernels (once a layer each); outside, the model's own code runs again."""
    model = tiny_model(family, num_hidden_layers=3)
    backend = PointwiseBackend()
    ids, mask = prompts(2, 7)
    own_rotary = modeling_llama.apply_rotary_pos_emb
    with torch.no_grad(), trainer_exact(model, backend):
        model(ids, attention_mask=mask)
    assert sorted(backend.calls) == ["rotary"] * 3 + ["silu_mul"] * 3
    backend.calls.clear()
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert backend.calls == []
    assert modeling_llama.apply_rotary_pos_emb is own_rotary
    assert "forward" not in vars(model.model.layers[0].mlp)


def test_the_cuda_plugin_offers_them():
    assert exact.OPS.rotary is exact_pointwise.rotary
    assert exact.OPS.silu_mul is exact_pointwise.silu_mul
