"""The engine's own decode step (:class:`graphcap.rollout.step.step.DecodeStep`) captured, replayed.

Built as the rollout engine builds it (``StaticKVCache``, ``MaskBuffers.for_model`` in the
backend's ``mask_form``, ``DecodeState.allocate``) over tiny GPT-2 and Llama models with
left-padded prompts, captured with the engine's ``capture_step``. k replays must write the tokens
and log-probs of k eager calls, greedy and sampled from an explicit generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from graphcap.backend import Backend
from graphcap.rollout.cache import StaticKVCache
from graphcap.rollout.cache.masks import MaskBuffers, layer_windows
from graphcap.rollout.holder.capture import capture_step
from graphcap.rollout.sampling import RowPlan, SamplerShape
from graphcap.rollout.settings.sampling_params import SamplingParams
from graphcap.rollout.step import DecodeState, DecodeStep
from graphcap.testing import models
from graphcap.testing.conformance.replay import replay

BATCH, WIDTH, TOTAL, STEPS = 2, 5, 16, 6


@dataclass
class Rig:
    """A decode step and what resets it to the state right after prefill."""

    backend: Backend
    step: DecodeStep
    rows: RowPlan  # each row's sampling settings
    ids: torch.Tensor
    mask: torch.Tensor
    prefill: object
    logits: torch.Tensor
    next_positions: torch.Tensor

    @classmethod
    @torch.no_grad()
    def build(
        cls, backend: Backend, name: str, sample: bool, generator: torch.Generator | None
    ) -> Rig:
        device = backend.device
        model = models.build(name, device)
        ids, mask = models.prompts(BATCH, device, WIDTH)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        prefill = out.past_key_values
        cache = StaticKVCache(StaticKVCache.specs_of(prefill), BATCH, TOTAL)
        masks = MaskBuffers.for_model(
            model.config,
            BATCH,
            TOTAL,
            torch.float32,
            device,
            layer_windows(model.config),
            backend.capabilities.mask_form,
        )
        state = DecodeState.allocate(BATCH, TOTAL, models.VOCAB, (models.EOS,), models.PAD, device)
        params = SamplingParams(
            max_new_tokens=STEPS + 1,
            do_sample=sample,
            temperature=0.9,
            eos_token_id=models.EOS,
            pad_token_id=models.PAD,
        )
        shape = SamplerShape(samples=sample, logprobs=True)
        step = DecodeStep(model, cache, masks, state, shape, generator)
        rows = RowPlan.build([params] * BATCH, 1, BATCH)
        logits, next_positions = out.logits[:, -1], positions[:, -1] + 1
        return cls(backend, step, rows, ids, mask, prefill, logits, next_positions)

    def reset(self) -> None:
        """As the engine starts a call: prefill loaded, prompt mask, first token committed."""
        step = self.step
        step.cache.reset()
        step.cache.load_prefill(self.prefill)
        step.masks.reset(self.mask)
        step.state.reset(self.ids, self.next_positions, self.rows)
        step.commit(self.logits)
        self.backend.synchronize()

    def outputs(self) -> tuple[list[list[int]], torch.Tensor]:
        state = self.step.state
        return state.sequences.cpu().tolist(), state.logprobs.cpu().clone()


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", list(models.MODELS))
@torch.no_grad()
def test_engine_decode_step_replays_give_eager_tokens(
    gc_graph_backend: Backend, name: str, sample: bool
) -> None:
    backend = gc_graph_backend
    if sample and not backend.capabilities.rng_in_graph:
        pytest.skip(f"backend {backend.name!r} declares rng_in_graph=False: sampling is eager")
    generator = torch.Generator(device=backend.device) if sample else None
    rig = Rig.build(backend, name, sample, generator)

    if generator is not None:
        generator.manual_seed(11)
    rig.reset()
    for _ in range(STEPS):
        rig.step()
    backend.synchronize()
    eager_tokens, eager_logprobs = rig.outputs()
    generated = [row[WIDTH : WIDTH + STEPS + 1] for row in eager_tokens]
    assert all(len(set(row)) > 1 for row in generated), (
        f"eager tokens {generated} do not change step to step: the check would be vacuous"
    )

    if generator is not None:
        generator.manual_seed(11)
    rig.reset()
    graph = capture_step(backend, rig.step, rig.step.mutable_tensors(), generator)
    assert int(rig.step.cache.write_pos.cpu()[0]) == WIDTH, (
        "capture advanced the cache write position: the step ran instead of being recorded, "
        "or capture_step did not roll it back"
    )
    replay(backend, graph, times=STEPS)
    tokens, logprobs = rig.outputs()
    assert tokens == eager_tokens, f"{STEPS} replays of the {name} step wrote other tokens"
    torch.testing.assert_close(logprobs, eager_logprobs, rtol=1e-5, atol=1e-5)
