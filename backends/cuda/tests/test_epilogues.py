"""The one-row product's epilogues: the kernel's gated and residual forms equal the eager ops
they replace, and the inductor pass (graphcap_cuda.epilogues) rewrites a transformers gated MLP
into them, and nothing whose product has another use. Off the GPU the kernel runs under
Triton's interpreter and inductor compiles C++ for the CPU; the pass is the same."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the kernel needs Triton (CUDA builds of torch ship it)")

from graphcap_cuda import backend, epilogues, gemv
from rollout_models import tiny_model

from graphcap.rollout import regions
from graphcap.rollout.fusion import ProjectionFusion
from graphcap.rollout.scan import scan_model

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
#: A graph inductor finds in its cache is not passed through the pass again: nothing to count.
UNCACHED = {"fx_graph_cache": False}


def _data(n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def make(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    return make(1, 1, k), make(n, k, scale=k**-0.5), make(n, k, scale=k**-0.5), make(n), make(n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(96, 256), (70, 300), (20, gemv.GATED_LONG_K)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", sorted(gemv.ACTIVATIONS))
def test_gated_and_residual_forms_equal_the_eager_ops(n, k, bias, dtype, activation):
    """Each intermediate is rounded where the separate ops round it, so the fused forms equal
    the ops applied to the plain kernel's products (up to the activation's last fp32 bit)."""
    x, up, gate, up_bias, gate_bias = _data(n, k, dtype, n + k)
    up_bias, gate_bias = (up_bias, gate_bias) if bias else (None, None)
    residual = torch.randn(1, 1, n).to(DEVICE, dtype)
    act = epilogues.DEFINITIONS[activation](gemv.gemv(x, gate, gate_bias))
    act = act * gemv.gemv(x, up, up_bias)
    fused = gemv.gemv(x, up, up_bias, None, gate, gate_bias, activation)
    tol = 2e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(fused, act, rtol=tol, atol=tol)
    torch.testing.assert_close(
        gemv.gemv(x, up, up_bias, residual), residual + gemv.gemv(x, up, up_bias), rtol=0, atol=0
    )
    both = gemv.gemv(act, up[:, :n].contiguous(), None, residual)
    torch.testing.assert_close(both, residual + gemv.gemv(act, up[:, :n].contiguous()))


def test_bad_epilogue_operands_are_refused():
    x, up, gate, _, _ = _data(8, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="gate"):
        gemv.gemv(x, up, None, None, gate[:4])
    with pytest.raises(ValueError, match="residual"):
        gemv.gemv(x, up, None, torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="activation 'relu' is not one of"):
        gemv.gemv(x, up, None, None, gate, None, "relu")


def _compiled_layers(family: str, fuse: bool) -> tuple[dict[str, int], torch.Tensor, torch.Tensor]:
    """A transformers model's logits for one token through one-row products in compiled regions
    with a fresh pass, the pass's counts, and the eager logits."""
    model = tiny_model(family, fresh=True).to(DEVICE)
    fusion = ProjectionFusion(model) if fuse else None
    if fusion is not None:
        fusion.join(scan_model(model))
    ids = torch.tensor([[5]], device=DEVICE)
    found = epilogues.GemvEpilogues()
    with torch.no_grad():
        eager = model(ids).logits
        products = regions.one_row_products(model, gemv.linear, fusion)
        joined = fusion.applied() if fusion is not None else contextlib.nullcontext()
        options = {"post_grad_custom_post_pass": found, **UNCACHED}
        with joined, products, regions.compiled_regions(model, None, options):
            logits = model(ids).logits
    torch._dynamo.reset()
    return found.fused, logits, eager


@pytest.mark.parametrize(
    "family,fuse",
    [("llama", True), ("llama", False), ("phi3", False), ("gemma", True)],
    ids=[
        "llama-joined-gate-up",
        "llama-separate-gate-up",
        "phi3-chunked-gate-up",
        "gemma-gelu-tanh-joined",
    ],
)
def test_pass_moves_a_gated_mlps_activation_and_residual_into_the_product(family, fuse):
    """The decoder layer compiles once for every layer: its gate activation and its residual
    add after the down projection are rewritten (the add after attention meets the attention's
    output, not a product), and the logits stay the eager ones. The forms: gate and up joined
    by fuse_projections (split in two), two products, Phi-3's own gate/up product chunked with
    the activation on the right of the product, and Gemma's tanh-approximated GELU."""
    fused, logits, eager = _compiled_layers(family, fuse)
    assert fused == {"gate": 1, "residual": 1}
    torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "activation",
    [F.relu, F.gelu, lambda v: F.silu(v) * 2.0, lambda v: F.silu(v) + v],
    ids=["relu", "gelu-erf", "scaled-silu", "silu-plus-input"],
)
def test_pass_leaves_activations_the_kernel_does_not_compute(activation):
    """What the nodes between the product and the multiply compute decides, not their ops:
    near misses of SiLU and GELU stay as they were."""

    def mlp(x, wg, wu):
        return activation(gemv.linear(x, wg)) * gemv.linear(x, wu)

    x, wg, wu, _, _ = _data(32, 16, torch.float32, 2)
    found = epilogues.GemvEpilogues()
    compiled = torch.compile(mlp, options={"post_grad_custom_post_pass": found, **UNCACHED})
    out = compiled(x, wg, wu)
    torch._dynamo.reset()
    assert found.fused == {"gate": 0, "residual": 0}
    torch.testing.assert_close(out, mlp(x, wg, wu), rtol=1e-5, atol=1e-5)


def test_pass_leaves_products_with_other_uses_and_broadcast_adds():
    """Fusing a product that is also returned would read its weights twice; a broadcasting add
    is not the kernel's elementwise one."""

    def block(x, r, wg, wu, wd):
        g = gemv.linear(x, wg)
        h = F.silu(g) * gemv.linear(x, wu)
        return gemv.linear(h, wd) + r, g

    x, wg, wu, _, _ = _data(32, 16, torch.float32, 1)
    wd, r = torch.randn(16, 32, device=DEVICE), torch.randn(1, 1, 1, device=DEVICE)
    found = epilogues.GemvEpilogues()
    compiled = torch.compile(block, options={"post_grad_custom_post_pass": found, **UNCACHED})
    out, _ = compiled(x, r, wg, wu, wd)
    torch._dynamo.reset()
    assert found.fused == {"gate": 0, "residual": 0}
    torch.testing.assert_close(out, block(x, r, wg, wu, wd)[0], rtol=1e-5, atol=1e-5)


def test_backend_options_carry_the_pass(monkeypatch):
    assert backend.CUDABackend().compile_options()["post_grad_custom_post_pass"] is epilogues.PASS
    monkeypatch.setattr(backend, "EPILOGUES", False)
    assert "post_grad_custom_post_pass" not in backend.CUDABackend().compile_options()
