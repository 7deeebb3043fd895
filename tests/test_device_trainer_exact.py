"""Trainer-exact rollouts on a real accelerator (``GRAPHCAP_BACKEND=cuda``): the rollout's
recorded log-probs equal the trainer's bit for bit, in bf16, on the backend's own kernels.

The CPU reference backend checks the same on every commit (tests/test_trainer_exact.py) and
the CUDA kernels' orders under Triton's interpreter (backends/cuda/tests/test_exact_kernels.py);
these tests confirm it where the kernels compile for the GPU: a small llama (the eager loop and
both graph paths) and the llama-1b and llama-8b presets (eager, static graph), the trainer's
batch right- and left-padded, and the gradients under ``trainer_exact`` within bf16 tolerance
of the default forward's. Skipped, with the reason, unless an accelerator backend that offers
trainer-exact operations is selected.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import graphcap
from graphcap.errors import BackendSelectionError
from graphcap.preset_models import build_model
from graphcap.rollout import (
    RolloutConfig,
    RolloutEngine,
    SamplingParams,
    token_logprobs,
    trainer_exact,
)
from graphcap.tiny_models import PAD, tiny_model

pytestmark = pytest.mark.device

PATHS = {
    "eager": {"enable_graph_capture": False},
    "static_graph": {"enable_graph_capture": True},
    "continuous_graph": {"enable_graph_capture": True, "continuous_batch_size": 3},
}


@pytest.fixture(scope="module")
def backend(requested_backend: str | None) -> graphcap.Backend:
    name = requested_backend
    if not name or name == "cpu":
        pytest.skip("device tests need an accelerator backend: set GRAPHCAP_BACKEND=cuda")
    try:
        selected = graphcap.get_backend(name)
    except BackendSelectionError as exc:
        pytest.skip(f"backend {name!r} not usable here: {exc}")
    if selected.exact_ops() is None:
        pytest.skip(f"backend {name!r} offers no trainer-exact operations")
    return selected


def small_llama(backend: graphcap.Backend) -> torch.nn.Module:
    """A 2-layer llama with head_dim 64 and grouped heads, 200 positions: several key blocks."""
    model = tiny_model(
        "llama",
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=688,
        vocab_size=512,
    )
    return model.to(device=backend.device, dtype=torch.bfloat16)


def left_padded(rows: int, vocab: int, device: torch.device, seed: int = 0):
    """Prompts of 20-83 real tokens, left-padded."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [20 + (37 * i) % 64 for i in range(rows)]
    width = max(lengths)
    ids = torch.full((rows, width), PAD)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(3, vocab, (n,), generator=generator)
        mask[i, width - n :] = 1
    return ids.to(device), mask.to(device)


def trainer_logprobs(model, rows, responses, side: str, temperature: float):
    """The trainer's log-probs of each row's last ``responses[i]`` tokens from one batch of
    ``rows`` padded on ``side``, under ``trainer_exact``."""
    device = next(model.parameters()).device
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, device=device)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        at = slice(0, len(row)) if side == "right" else slice(width - len(row), width)
        ids[i, at] = torch.tensor(row, device=device)
        mask[i, at] = 1
    with torch.no_grad(), trainer_exact(model):
        logits = model(ids, attention_mask=mask).logits
    out = []
    for i, (row, n) in enumerate(zip(rows, responses, strict=True)):
        end = len(row) if side == "right" else width
        out.append(
            token_logprobs(logits[i, end - n - 1 : end - 1], ids[i, end - n : end], temperature)
        )
    return out


def check_rollout(model, backend, path: str, rows: int, new: int) -> None:
    vocab = model.config.vocab_size
    ids, mask = left_padded(rows, vocab, backend.device)
    engine = RolloutEngine(model, RolloutConfig(trainer_exact=True, backend=backend, **PATHS[path]))
    for mode, temperature in (("raw", 1.0), ("temperature", 0.7)):
        params = SamplingParams(
            max_new_tokens=new,
            do_sample=True,
            temperature=0.7,
            seed=3,
            return_logprobs=True,
            logprobs_mode=mode,
        )
        result = engine.generate(ids, mask, params)
        assert result.stats.path == path, result.stats.fallback_reason
        assert result.stats.attention == "graphcap_exact"
        width = ids.shape[1]
        texts = []
        for row, response in zip(
            result.sequences.tolist(), result.response_mask.tolist(), strict=True
        ):
            prompt = [t for t, m in zip(row[:width], mask[len(texts)].tolist(), strict=True) if m]
            texts.append(prompt + [t for t, m in zip(row[width:], response, strict=False) if m])
        lengths = result.response_lengths.tolist()
        got = [lp[m.bool()] for lp, m in zip(result.logprobs, result.response_mask, strict=True)]
        for side in ("right", "left"):
            want = trainer_logprobs(model, texts, lengths, side, temperature)
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                assert torch.equal(a, b), (
                    f"{path} {mode} {side}-padded row {i}: max |Δlogp| {(a - b).abs().max():.3g}, "
                    f"{(a == b).float().mean():.1%} equal"
                )


@pytest.mark.parametrize("path", PATHS)
def test_small_llama_rollout_logprobs_equal_the_trainers(backend, path):
    check_rollout(small_llama(backend), backend, path, rows=6, new=40)


@pytest.mark.parametrize("path", ["eager", "static_graph"])
@pytest.mark.parametrize("preset", ["llama-1b", "llama-8b"])
def test_preset_rollout_logprobs_equal_the_trainers(backend, preset, path):
    model = build_model(preset, dtype=torch.bfloat16, device=backend.device)
    try:
        check_rollout(model, backend, path, rows=8, new=48)
    finally:
        del model
        backend.empty_cache()


def gradients(model, ids, mask, exact: bool) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with trainer_exact(model) if exact else contextlib.nullcontext():
        logits = model(ids, attention_mask=mask, position_ids=positions).logits
    logp = token_logprobs(logits[:, :-1], ids[:, 1:])
    (-(logp * mask[:, 1:]).sum()).backward()
    return torch.cat([p.grad.float().flatten() for p in model.parameters()])


def test_gradients_under_trainer_exact_agree_with_the_default_forward(backend):
    """bf16 gradients of a policy-gradient-shaped loss: under ``trainer_exact`` as close to
    the fp32 default forward's as the bf16 default forward's are (within 25%)."""
    model = small_llama(backend)
    ids, mask = left_padded(4, model.config.vocab_size, backend.device, seed=1)
    reference_model = small_llama(backend).float()
    reference = gradients(reference_model, ids, mask, exact=False)

    def error(g: torch.Tensor) -> float:
        return float((g - reference).norm() / reference.norm())

    exact_error = error(gradients(model, ids, mask, exact=True))
    default_error = error(gradients(model, ids, mask, exact=False))
    print(
        f"bf16 gradient error vs fp32: trainer_exact {exact_error:.4f}, default {default_error:.4f}"
    )
    assert exact_error < 1.25 * default_error + 1e-3
