"""A real decode step: tiny GPT-2 and Llama forwards over graphcap's static KV cache.

The step is shaped like the rollout engine's: every value it reads or advances (input token,
position ids, cache write positions, mask) lives in device tensors, so k replays must give the
logits of k eager calls of the same step. Eager prefill fills the cache; the mask has the form
the backend declares (``capabilities.mask_form``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from graphcap.backend import Backend
from graphcap.rollout.cache import StaticKVCache
from graphcap.rollout.prefill import cache_keyword
from graphcap.testing.graphs import capture, replay, warm_up

BATCH, PROMPT, TOTAL, STEPS, VOCAB = 2, 5, 16, 4, 96


def _tiny_gpt2() -> torch.nn.Module:
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, attn_implementation="sdpa"
    )
    return GPT2LMHeadModel(config)


def _tiny_llama() -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"gpt2": _tiny_gpt2, "llama": _tiny_llama}


@dataclass
class DecodeStep:
    """Static buffers of a greedy decode step and the step itself."""

    backend: Backend
    model: torch.nn.Module
    prompt: torch.Tensor
    prefill: object  # the prefill's transformers cache
    first_tokens: torch.Tensor
    cache: StaticKVCache
    tokens: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    mask: torch.Tensor
    logits: torch.Tensor

    @classmethod
    def build(cls, backend: Backend, name: str) -> DecodeStep:
        torch.manual_seed(0)
        model = MODELS[name]().to(backend.device).eval()
        generator = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=generator).to(backend.device)
        out = model(input_ids=prompt, use_cache=True)
        prefill = out.past_key_values
        cache = StaticKVCache(StaticKVCache.specs_of(prefill), BATCH, TOTAL)
        form = backend.capabilities.mask_form
        mask_dtype = torch.bool if form == "bool" else torch.float32
        step = cls(
            backend=backend,
            model=model,
            prompt=prompt,
            prefill=prefill,
            first_tokens=out.logits[:, -1].argmax(-1, keepdim=True),
            cache=cache,
            tokens=torch.zeros((BATCH, 1), dtype=torch.long, device=backend.device),
            positions=torch.zeros((BATCH, 1), dtype=torch.long, device=backend.device),
            valid=torch.zeros((BATCH, TOTAL), dtype=torch.bool, device=backend.device),
            mask=torch.zeros((BATCH, 1, 1, TOTAL), dtype=mask_dtype, device=backend.device),
            logits=torch.zeros((BATCH, VOCAB), device=backend.device),
        )
        step.reset()
        return step

    def reset(self) -> None:
        """Back to the state right after prefill, written in place (the graph's memory)."""
        self.cache.load_prefill(self.prefill)
        self.tokens.copy_(self.first_tokens)
        self.positions.fill_(PROMPT)
        self.valid.zero_()
        self.valid[:, :PROMPT] = True
        self.backend.synchronize()

    def __call__(self) -> None:
        self.valid.scatter_(1, self.cache.write_pos[:, None], True)
        allowed = self.valid.view(BATCH, 1, 1, TOTAL)
        if self.mask.dtype == torch.bool:
            self.mask.copy_(allowed)
        else:
            self.mask.copy_(torch.where(allowed, 0.0, torch.finfo(torch.float32).min))
        out = self.model(
            input_ids=self.tokens,
            attention_mask=self.mask,
            position_ids=self.positions,
            use_cache=True,
            **{cache_keyword(self.model): self.cache},
        )
        logits = out.logits[:, -1]
        self.logits.copy_(logits)
        self.cache.advance(1)
        self.positions.add_(1)
        self.tokens.copy_(logits.argmax(-1, keepdim=True))


@pytest.mark.parametrize("name", list(MODELS))
@torch.no_grad()
def test_captured_decode_step_gives_eager_logits(gc_graph_backend: Backend, name: str) -> None:
    backend = gc_graph_backend
    step = DecodeStep.build(backend, name)

    eager: list[torch.Tensor] = []
    for _ in range(STEPS):
        step()
        backend.synchronize()
        eager.append(step.logits.cpu().clone())
    assert all(torch.isfinite(logits).all() for logits in eager)
    assert not torch.equal(eager[0], eager[1]), "the step did not advance (check is vacuous)"
    # The step itself is right: its first logits are those of a full forward over the prompt
    # and the first generated token (no cache, transformers' own causal mask).
    full = torch.cat([step.prompt, step.first_tokens], dim=1)
    reference = step.model(input_ids=full).logits[:, -1].cpu()
    torch.testing.assert_close(eager[0], reference, rtol=1e-4, atol=1e-4)

    step.reset()
    warm_up(backend, step)
    step.reset()
    graph, _ = capture(backend, step)
    assert torch.equal(step.cache.write_pos.cpu(), torch.full((BATCH,), PROMPT)), (
        "capture advanced the cache write position: the step ran instead of being recorded"
    )
    for index, expected in enumerate(eager):
        replay(backend, graph)
        torch.testing.assert_close(
            step.logits.cpu(),
            expected,
            rtol=1e-5,
            atol=1e-5,
            msg=lambda m, i=index: f"replay {i + 1} of the {name} decode step: {m}",
        )
