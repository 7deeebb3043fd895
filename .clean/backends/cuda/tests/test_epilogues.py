"""The one-row product's epilogues: the kernel's gated and residual forms equal the eager ops
they replace, and the inductor pass (graphcap_cuda.kernels.epilogues) rewrites a transformers
gated MLP into them, and nothing whose product has another use. Off the GPU the kernel runs under
Triton's interpreter and inductor compiles C++ for the CPU; the pass is the same."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the kernel needs Triton (CUDA builds of torch ship it)")

from graphcap_cuda import backend
from graphcap_cuda.kernels import epilogues, gemv
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from graphcap.rollout.plan import regions
from graphcap.rollout.plan.fusion import ProjectionFusion
from graphcap.rollout.plan.scan import scan_model
from graphcap.tiny_models import tiny_model

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


#: transformers' RMSNorm of each of the kernel's norms (gemv.NORMS).
NORM_MODULES = {"rms": LlamaRMSNorm, "rms_one_plus": GemmaRMSNorm}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(96, 256), (70, 300), (20, gemv.GATED_LONG_K)])
@pytest.mark.parametrize("norm", sorted(gemv.NORMS))
@pytest.mark.parametrize("summed", [False, True], ids=["input", "sum"])
@pytest.mark.parametrize("one_load", [True, False], ids=["row", "blocks"])
def test_norm_and_sum_prologues_equal_transformers_norms(
    n, k, norm, summed, one_load, dtype, monkeypatch
):
    """The input's RMSNorm (Llama's and Gemma's) and the sums before it and before the residual
    equal transformers' modules and eager adds followed by the plain kernel, gated or not; the
    norm found from the row in one load or block by block."""
    monkeypatch.setattr(gemv, "NORM_ONE_LOAD", one_load)
    x, up, gate, _, _ = _data(n, k, dtype, 3 * n + k)
    addend = torch.randn(1, 1, k).to(DEVICE, dtype) if summed else None
    residual, other = (torch.randn(1, 1, n).to(DEVICE, dtype) for _ in range(2))
    module = NORM_MODULES[norm](k, eps=1e-2).to(DEVICE, dtype)  # large enough to matter
    with torch.no_grad():
        module.weight.copy_(torch.randn(k) * 0.5)
        h = module(x + addend if summed else x)
    weights = {"norm": norm, "norm_weight": module.weight, "eps": 1e-2, "addend": addend}
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    plain = gemv.gemv(x, up, **weights)
    torch.testing.assert_close(plain, gemv.gemv(h, up), rtol=tol, atol=tol)
    gated = gemv.gemv(x, up, None, None, gate, **weights)
    torch.testing.assert_close(gated, gemv.gemv(h, up, None, None, gate), rtol=tol, atol=tol)
    extra = {"residual_addend": other} if summed else {}
    added = gemv.gemv(x, up, None, residual, **weights, **extra)
    want = gemv.gemv(h, up, None, residual + other if summed else residual)
    torch.testing.assert_close(added, want, rtol=tol, atol=tol)


def test_bad_epilogue_operands_are_refused():
    x, up, gate, _, _ = _data(8, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="gate"):
        gemv.gemv(x, up, None, None, gate[:4])
    with pytest.raises(ValueError, match="residual"):
        gemv.gemv(x, up, None, torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="activation 'relu' is not one of"):
        gemv.gemv(x, up, None, None, gate, None, "relu")
    with pytest.raises(ValueError, match="norm 'layer' needs a norm_weight and one of"):
        gemv.gemv(x, up, norm="layer", norm_weight=x.reshape(-1))
    with pytest.raises(ValueError, match="norm_weight must hold 16 values"):
        gemv.gemv(x, up, norm="rms", norm_weight=x.reshape(-1)[:8])
    with pytest.raises(ValueError, match="residual_addend needs a residual"):
        gemv.gemv(x, up, residual_addend=torch.zeros(8, device=DEVICE))


def _compiled_layers(family: str, fuse: bool) -> tuple[dict[str, int], torch.Tensor, torch.Tensor]:
    """A transformers model's logits for one token through one-row products in compiled regions
    with a fresh pass, the pass's counts, and the eager logits."""
    model = tiny_model(family).to(DEVICE)
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
    torch.compiler.reset()
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
    """The decoder layer compiles once for every layer: its gate activation, its residual add
    after the down projection, and the add and norm after attention (into the gate/up product,
    and the add into the down product's residual too) are rewritten, and the logits stay the
    eager ones. The forms: gate and up joined
    by fuse_projections (split in two), two products, Phi-3's own gate/up product chunked with
    the activation on the right of the product, and Gemma's tanh-approximated GELU."""
    fused, logits, eager = _compiled_layers(family, fuse)
    assert fused == {"gate": 1, "residual": 1, "norm": 1, "sum": 1}
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
    torch.compiler.reset()
    assert found.fused == dict.fromkeys(("gate", "residual", "norm", "sum"), 0)
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
    torch.compiler.reset()
    assert found.fused == dict.fromkeys(("gate", "residual", "norm", "sum"), 0)
    torch.testing.assert_close(out, block(x, r, wg, wu, wd)[0], rtol=1e-5, atol=1e-5)


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize(
    "norm,folds",
    [
        (lambda x, w: _rms(x, w), 1),
        (lambda x, w: _rms(x, w, eps=1e-2), 1),
        (lambda x, w: w * F.layer_norm(x, x.shape[-1:]), 0),
        (lambda x, w: _rms(x, w) * 2.0, 0),
        (lambda x, w: _rms(x, w) + x, 0),
        (lambda x, w: _rms(x, 1.0) * x.sum(-1, keepdim=True), 0),
    ],
    ids=["rms", "rms-large-eps", "layer-norm", "scaled-rms", "rms-plus-input", "no-weight"],
)
def test_pass_moves_rms_norms_and_nothing_else_into_the_product(norm, folds):
    """A norm of an input read by nothing else moves in (no sum: the input is the block's);
    near misses of RMSNorm stay as they were."""

    def block(x, w, up):
        return gemv.linear(norm(x, w), up)

    x, up, _, w, _ = _data(32, 16, torch.float32, 4)
    w = w[:16]
    found = epilogues.GemvEpilogues()
    compiled = torch.compile(block, options={"post_grad_custom_post_pass": found, **UNCACHED})
    out = compiled(x, w, up)
    torch.compiler.reset()
    assert (found.fused["norm"], found.fused["sum"]) == (folds, 0)
    torch.testing.assert_close(out, block(x, w, up), rtol=1e-5, atol=1e-5)


def test_pass_leaves_norms_and_sums_read_elsewhere():
    """A norm whose output is also returned, or of a sum that is returned (its kernel stays),
    is not moved; a product that reads the sum normed and as its residual takes both."""

    def returned_norm(x, r, w, up, down):
        h = _rms(x + r, w)
        return gemv.linear(h, up), h

    def returned_sum(x, r, w, up, down):
        s = x + r
        return gemv.linear(_rms(s, w), up), s

    def both(x, r, w, up, down):
        s = x + r
        return gemv.linear(_rms(s, w), up) + s

    x, up, _, w, _ = _data(16, 16, torch.float32, 5)
    r = torch.randn_like(x)
    for block, want in ((returned_norm, (0, 0)), (returned_sum, (0, 0)), (both, (1, 1))):
        found = epilogues.GemvEpilogues()
        compiled = torch.compile(block, options={"post_grad_custom_post_pass": found, **UNCACHED})
        got = compiled(x, r, w, up, None)
        torch.compiler.reset()
        assert (found.fused["norm"], found.fused["sum"]) == want, block.__name__
        torch.testing.assert_close(got, block(x, r, w, up, None), rtol=1e-5, atol=1e-5)


def test_norms_stay_out_when_turned_off_and_the_cache_key_says_so(monkeypatch):
    """Benchmarks time the step without the norm moved; inductor's cache must not hand one
    setting's graph to the other."""
    key = epilogues.PASS.uuid()
    monkeypatch.setattr(epilogues, "FOLD_NORMS", False)
    assert epilogues.PASS.uuid() != key
    fused, logits, eager = _compiled_layers("llama", True)
    assert fused == {"gate": 1, "residual": 1, "norm": 0, "sum": 0}
    torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)


def test_backend_options_carry_the_pass(monkeypatch):
    assert backend.CUDABackend().compile_options()["post_grad_custom_post_pass"] is epilogues.PASS
    monkeypatch.setattr(backend, "EPILOGUES", False)
    assert "post_grad_custom_post_pass" not in backend.CUDABackend().compile_options()
