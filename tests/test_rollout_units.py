"""Unit tests of the rollout building blocks the continuous path reuses: cache, masks,
sampling, signature, the plan's refusal rules and the in-place weight loader."""

from __future__ import annotations

import enum

import pytest
import torch
from rollout_models import prompts, tiny_model
from transformers import DynamicCache
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from graphcap.rollout import load_weights_in_place
from graphcap.rollout.cache.cache import LayerSpec, StaticKVCache, put_columns, scatter_columns
from graphcap.rollout.cache.masks import MaskBuffers, layer_windows, unsupported_layer_types
from graphcap.rollout.plan.scan import ZERO3, scan_model
from graphcap.rollout.sampling import (
    ARGMAX_CHUNK,
    RowSettings,
    SamplerShape,
    argmax_rows,
    logprob_distribution,
    repetition_penalty,
    sanitise,
    stops_blocked,
    warp,
)
from graphcap.rollout.settings.sampling_params import SamplingParams


def _spec(heads: int = 2, dim: int = 4) -> LayerSpec:
    return LayerSpec(heads, dim, dim, torch.float32, torch.float32, torch.device("cpu"))


# ---- cache ------------------------------------------------------------------------------------
def test_cache_writes_each_row_at_its_own_device_position():
    cache = StaticKVCache([_spec(), _spec()], batch_size=3, max_len=6)
    cache.write_pos.copy_(torch.tensor([0, 2, 5]))
    keys = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 1, 4) + 1
    out_k, out_v = cache.update(keys, -keys, layer_idx=1)
    for row, col in enumerate([0, 2, 5]):
        assert torch.equal(out_k[row, :, col], keys[row, :, 0])
        assert torch.equal(out_v[row, :, col], -keys[row, :, 0])
        others = [c for c in range(6) if c != col]
        assert not out_k[row, :, others].any()
    assert not cache.layers[0].keys.any()  # other layers untouched
    assert cache.get_seq_length().item() == 5  # a device tensor, not a host int
    assert cache.get_mask_sizes(1, 0) == (6, 0)
    cache.advance(2)
    assert cache.write_pos.tolist() == [2, 4, 7]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cache_writes_several_columns_per_row_and_through_a_compiled_put(compiled):
    """``compile=True`` captures write through ``torch.compile(put_columns)`` (inductor: one
    kernel for K and V, in place); the buffers written are the eager scatters', bit for bit."""
    spec = LayerSpec(2, 4, 3, torch.float32, torch.float16, torch.device("cpu"))
    caches = [StaticKVCache([spec, spec], batch_size=3, max_len=8) for _ in range(2)]
    keys, values = torch.randn(3, 2, 2, 4), torch.randn(3, 2, 2, 3)  # values stored as fp16
    for cache in caches:
        cache.write_pos.copy_(torch.tensor([0, 3, 6]))
    before = caches[1].layers[0].keys.data_ptr()
    caches[0].update(keys, values, layer_idx=0)
    put = torch.compile(put_columns) if compiled else put_columns
    with caches[1].puts_through(put):
        caches[1].update(keys, values, layer_idx=0)
    assert all(layer.put is scatter_columns for layer in caches[1].layers)  # restored
    written, expected = caches[1].layers[0], caches[0].layers[0]
    assert written.keys.data_ptr() == before and written.values.dtype == torch.float16
    assert torch.equal(written.keys, expected.keys) and torch.equal(written.values, expected.values)
    for row, col in enumerate([0, 3, 6]):
        assert torch.equal(written.keys[row, :, col : col + 2], keys[row])
        assert torch.equal(written.values[row, :, col : col + 2], values[row].half())
    assert written.keys.count_nonzero() == keys.count_nonzero()  # nothing else written


def test_cache_load_prefill_repeats_rows_and_reset_zeroes():
    model = tiny_model("llama")
    ids, mask = prompts(2)
    prefill = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=prefill, use_cache=True)
    specs = StaticKVCache.specs_of(prefill)
    assert specs[0].num_heads == model.config.num_key_value_heads
    cache = StaticKVCache(specs, batch_size=6, max_len=10)
    cache.load_prefill(prefill, source_rows=torch.tensor([0, 0, 0, 1, 1, 1]))
    width = ids.shape[1]
    for row in range(6):
        assert torch.equal(cache.layers[1].keys[row, :, :width], prefill.layers[1].keys[row // 3])
    assert not cache.layers[1].keys[:, :, width:].any()
    assert cache.write_pos.tolist() == [width] * 6
    cache.reset()
    assert not cache.layers[0].keys.any() and cache.write_pos.sum() == 0
    cache.load_prefill(prefill, rows=torch.tensor([4, 1]))
    assert torch.equal(cache.layers[0].values[4, :, :width], prefill.layers[0].values[0])
    assert cache.write_pos.tolist() == [0, width, 0, 0, width, 0]
    nbytes = cache.nbytes()
    assert nbytes == 2 * 2 * (6 * specs[0].num_heads * 10 * specs[0].k_head_dim * 4)
    cache.release()
    assert cache.nbytes() == 0


# ---- masks ------------------------------------------------------------------------------------
def test_masks_additive_bool_and_window():
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    windows = {"full_attention": None, "sliding_attention": 2}
    additive = MaskBuffers(2, 6, torch.float32, torch.device("cpu"), windows)
    additive.reset(prompt_mask)
    additive.attend(torch.tensor([3, 3]))
    rendered = additive.render(torch.tensor([3, 3]))
    assert set(rendered) == set(windows)
    low = torch.finfo(torch.float32).min
    assert rendered["full_attention"][0, 0, 0].tolist() == [low, 0, 0, 0, low, low]
    assert rendered["sliding_attention"][1, 0, 0].tolist() == [low, low, 0, 0, low, low]
    boolean = MaskBuffers(
        2, 6, torch.float32, torch.device("cpu"), {"full_attention": None}, form="bool"
    )
    boolean.reset(prompt_mask)
    out = boolean.render(torch.tensor([2, 2]))
    assert out.dtype == torch.bool and out[0, 0, 0].tolist() == [False, True, True] + [False] * 3
    # reset forgets everything from before, a row reset touches only that row
    boolean.attend(torch.tensor([4, 5]))
    boolean.reset(torch.tensor([[1]]), rows=torch.tensor([1]))
    assert boolean.valid[1].tolist() == [True] + [False] * 5
    assert boolean.valid[0].tolist() == [False, True, True, False, True, False]
    with pytest.raises(ValueError, match="mask form"):
        MaskBuffers(1, 2, torch.float32, torch.device("cpu"), windows, form="float")


def test_layer_windows_from_configs():
    qwen = tiny_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert layer_windows(qwen.config) == {"full_attention": None, "sliding_attention": 4}
    assert layer_windows(tiny_model("llama").config) == {"full_attention": None}
    assert layer_windows(tiny_model("mistral", sliding_window=4).config) == {"full_attention": 4}
    llama = tiny_model("llama", fresh=True)
    llama.config.layer_types = ["full_attention", "chunked_attention"]
    assert unsupported_layer_types(llama.config) == ["chunked_attention"]


# ---- sampling ---------------------------------------------------------------------------------
def _rows(*params: SamplingParams, vocab: int = 19) -> RowSettings:
    rows = RowSettings.allocate(len(params), vocab, torch.device("cpu"))
    rows.write(params, [0] * len(params))
    return rows


def test_repetition_penalty_matches_transformers_and_skips_unwritten_slots():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 20, generator=gen)
    tokens = torch.randint(0, 20, (3, 7), generator=gen)
    written = torch.ones(3, 7, dtype=torch.bool)
    penalty = torch.full((3,), 1.7)
    expected = RepetitionPenaltyLogitsProcessor(1.7)(tokens, scores.clone())
    assert torch.equal(repetition_penalty(scores, tokens, written, penalty), expected)
    written[:, 4:] = False  # unwritten slots hold stale ids: they must not be penalised
    expected = RepetitionPenaltyLogitsProcessor(1.7)(tokens[:, :4], scores.clone())
    assert torch.equal(repetition_penalty(scores, tokens, written, penalty), expected)
    penalty[1] = 1.0  # a neutral row is left exactly as it was
    assert torch.equal(repetition_penalty(scores, tokens, written, penalty)[1], scores[1])
    before = scores.clone()
    repetition_penalty(scores, tokens, written, penalty)
    assert torch.equal(scores, before)  # the caller's logits are not written


def test_logprob_distribution_of_each_mode_is_log_softmax_of_its_distribution():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 40, generator=gen) * 4
    drawn_from = logits / 0.7
    drawn_from[:, ::3] = -float("inf")  # truncated entries, as top-k / top-p leave them
    chosen = torch.tensor([1, 5, 38])
    modes = ["sampling", "temperature", "raw"]
    rows = _rows(
        *[SamplingParams(do_sample=False, temperature=0.7, logprobs_mode=m) for m in modes],
        vocab=40,
    )
    expected = [drawn_from[0], logits[1] / 0.7, logits[2]]
    got = logprob_distribution(drawn_from, logits, rows).gather(1, chosen[:, None]).squeeze(1)
    for row in range(3):
        reference = torch.log_softmax(expected[row], dim=-1)[chosen[row]]
        torch.testing.assert_close(got[row], reference, rtol=0, atol=1e-6, msg=modes[row])


def test_sampler_shape_grows_with_any_row():
    greedy, penalised = SamplingParams(), SamplingParams(repetition_penalty=1.2)
    assert SamplerShape().widen([greedy]) == SamplerShape()
    shape = SamplerShape().widen([greedy, penalised])
    assert shape.penalty and not (shape.samples or shape.logprobs or shape.min_new)
    shape = shape.widen([SamplingParams(min_new_tokens=2)])
    assert shape.penalty and shape.min_new
    assert shape.widen([greedy]) == shape  # never narrows


WARPER_CASES = [
    {"top_k": 1},
    {"top_k": 5},
    {"top_k": 19},
    {"top_p": 0.1},
    {"top_p": 0.5},
    {"top_p": 0.95},
    {"temperature": 0.7, "top_k": 6, "top_p": 0.8},
    {"min_p": 0.2},
    {"temperature": 1.3, "top_k": 12, "top_p": 0.9, "min_p": 0.05},
]


def _transformers_warp(scores: torch.Tensor, case: dict) -> torch.Tensor:
    if case.get("temperature", 1.0) != 1.0:
        scores = TemperatureLogitsWarper(case["temperature"])(None, scores)
    if case.get("top_k"):
        scores = TopKLogitsWarper(case["top_k"])(None, scores)
    if case.get("top_p", 1.0) < 1.0:
        scores = TopPLogitsWarper(case["top_p"])(None, scores)
    if case.get("min_p"):
        scores = MinPLogitsWarper(case["min_p"])(None, scores)
    return scores


@pytest.mark.parametrize("case", WARPER_CASES, ids=str)
def test_per_row_warpers_match_transformers(case):
    """Each row of one batch warped with its own settings equals transformers' warpers for
    that setting, bitwise; a greedy row in the same batch is left untouched."""
    scores = torch.randn(4, 19, generator=torch.Generator().manual_seed(len(str(case))))
    sampled = SamplingParams(do_sample=True, **case)
    other = SamplingParams(do_sample=True, top_k=3, temperature=0.5)
    rows = _rows(sampled, other, SamplingParams(), sampled)
    warped = warp(scores, rows, truncate=True)
    assert torch.equal(warped[0], _transformers_warp(scores[:1], case)[0])
    assert torch.equal(warped[3], _transformers_warp(scores[3:], case)[0])
    assert torch.equal(
        warped[1], _transformers_warp(scores[1:2], {"top_k": 3, "temperature": 0.5})[0]
    )
    assert torch.equal(warped[2], scores[2])


def test_sanitise_flattens_finished_and_broken_rows_only():
    scores = torch.randn(4, 6)
    scores[1, 2] = float("nan")
    scores[2] = -float("inf")
    finished = torch.tensor([False, False, False, True])
    clean = sanitise(scores, finished)
    assert torch.equal(clean[0], scores[0])
    assert not clean[1:].any()
    probs = torch.softmax(clean, -1)
    assert torch.isfinite(probs).all()
    torch.multinomial(probs, 1)  # would raise on NaN / all-zero rows


def test_stop_block_uses_a_device_counter_and_per_row_minimums():
    stop_vocab = torch.tensor([False, True, False, False, True])
    min_new = torch.tensor([2, 2])
    blocked = stops_blocked(stop_vocab, torch.tensor(1), min_new)
    assert blocked[:, [1, 4]].all() and not blocked[:, [0, 2, 3]].any()
    assert not stops_blocked(stop_vocab, torch.tensor(2), min_new).any()
    per_row = stops_blocked(stop_vocab, torch.tensor([[1], [3]]), torch.tensor([2, 2]))
    assert per_row[0, [1, 4]].all() and not per_row[1].any()


# ---- refusal rules ------------------------------------------------------------------------------
def test_non_resident_parameters_are_named():
    model = tiny_model("gpt2", fresh=True)
    assert scan_model(model).non_resident is None and scan_model(model).sharded is None
    param = next(model.parameters())
    param.ds_id = 7  # what DeepSpeed ZeRO-3 attaches
    # gathered around the call (TRL's ds3_gather_for_generation): resident, served from a copy
    assert scan_model(model).non_resident is None and scan_model(model).sharded == ZERO3
    param.ds_status = enum.Enum("ZeroParamStatus", "AVAILABLE NOT_AVAILABLE").NOT_AVAILABLE
    assert "ZeRO-3 partition (NOT_AVAILABLE" in scan_model(model).non_resident
    del param.ds_status
    full, param.data = param.data, torch.empty(0)  # released: gathered inside forward
    assert "ds3_gather_for_generation=True" in scan_model(model).non_resident
    param.data = full

    def fetch(module, args):  # DeepSpeed's hooks gather and release inside forward
        return None

    fetch.__module__ = "deepspeed.runtime.zero.parameter_offload"
    handle = model.transformer.h[1].register_forward_pre_hook(fetch)
    reason = scan_model(model).non_resident
    assert "'transformer.h.1'" in reason and "remove the hooks" in reason
    handle.remove()
    del param.ds_id

    class FSDPLinear(torch.nn.Linear):
        pass

    model.extra = FSDPLinear(2, 2)
    assert "FSDP" in scan_model(model).non_resident


# ---- weights ----------------------------------------------------------------------------------
def test_load_weights_in_place_keeps_addresses_and_checks_input():
    model = tiny_model("gpt2", fresh=True)
    head = model.lm_head.weight
    address = head.data_ptr()
    state = {k: v.detach().clone() + 1 for k, v in model.state_dict().items()}
    loaded = load_weights_in_place(model, state)
    assert "lm_head.weight" in loaded.updated and not loaded.not_updated
    assert head.data_ptr() == address
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])
    with pytest.raises(KeyError, match="no parameter"):
        load_weights_in_place(model, {"nope": head}, strict=False)
    with pytest.raises(KeyError, match="strict=False"):
        load_weights_in_place(model, {"lm_head.weight": head.detach().clone()})
    with pytest.raises(ValueError, match="shape"):
        load_weights_in_place(model, {"lm_head.weight": torch.zeros(2, 2)}, strict=False)


@pytest.mark.parametrize("form", ["list", "generator"])
def test_load_weights_in_place_takes_vllms_name_tensor_pairs(form):
    """vLLM's ``load_weights`` input (verl, OpenRLHF): an iterable of (name, tensor) pairs,
    copied as it is read; errors name the tensors and never print them."""
    model = tiny_model("gpt2", fresh=True)
    addresses = {n: p.data_ptr() for n, p in model.named_parameters()}
    state = {k: v.detach().clone() + 1 for k, v in model.state_dict().items()}
    pairs = list(state.items())
    loaded = load_weights_in_place(model, pairs if form == "list" else (p for p in pairs))
    assert loaded.updated == tuple(sorted(state)) and not loaded.not_updated
    assert all(torch.equal(t, state[n]) for n, t in model.state_dict().items())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == addresses
    partial = [(n, t) for n, t in pairs if n != "lm_head.weight"]  # tied: wte covers it
    assert not load_weights_in_place(model, iter(partial)).not_updated
    head = state["lm_head.weight"]
    bad = {
        "unknown": ([("nope", head)], KeyError, "'nope'"),
        "missing": (pairs[:1], KeyError, "partial update; the 1 given were copied"),
        "shape": ([("lm_head.weight", head[:2])], ValueError, "shape"),
        "not a pair": ([(head, "lm_head.weight")], TypeError, r"tuple of \(Tensor, str\)"),
        "a tensor": ([head], TypeError, "entry 0 is a Tensor"),
        "not a tensor": ([("lm_head.weight", head.tolist())], TypeError, r"tuple of \(str, list\)"),
    }
    for name, (weights, error, match) in bad.items():
        with pytest.raises(error, match=match) as raised:
            load_weights_in_place(model, weights)
        assert len(str(raised.value)) < 400 and "tensor([" not in str(raised.value), name
    with pytest.raises(KeyError, match="'nope'") as raised:  # a mapping: the same, whole
        load_weights_in_place(model, {"nope": head, **state})
    assert "tensor([" not in str(raised.value)


@pytest.mark.parametrize("vocab", [7, ARGMAX_CHUNK + 5, 2 * ARGMAX_CHUNK, 5 * ARGMAX_CHUNK + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_pass_argmax_is_torch_argmax(vocab, dtype):
    """The same index as ``torch.argmax`` where it matters: equal maxima in the first chunk and
    the tail, many equal values, the maximum in the last column; infinities; a NaN; rows of
    -inf only; one row or several."""
    gen = torch.Generator().manual_seed(vocab)
    scores = torch.randn(6, vocab, generator=gen)
    scores[0, [3, vocab - 2]] = 50.0  # first chunk and tail (or the last chunk) tie
    scores[1, ::3] = float("inf")
    scores[2, vocab // 2] = float("nan")
    scores[3] = -float("inf")
    scores[4] = scores[4].round()  # many equal values
    scores[5, -1] = 50.0  # the last column alone
    for batch in (scores, scores[:1], scores[4:]):
        batch = batch.to(dtype)
        assert torch.equal(argmax_rows(batch), torch.argmax(batch, dim=-1))
