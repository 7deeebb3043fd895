"""``accelerate_generate``: graphcap under a model's own ``generate``.

Every served call must return exactly what ``model.generate`` returns (type, shape, values;
for sampled calls under the same seed, and leaving the random generator where generate leaves
it); every call graphcap does not serve goes to ``generate`` with the reason recorded.
"""

from __future__ import annotations

import copy
import io
import logging
import pickle
import warnings
from dataclasses import replace

import pytest
import torch
from rollout_models import EOS, FAMILIES, ScriptedMemory, prompts, tiny_model
from transformers import GenerationConfig, LogitsProcessorList, TopKLogitsWarper

from graphcap.cpu.torch_internals import TorchDispatchMode
from graphcap.errors import GenerateFallbackWarning
from graphcap.rollout import (
    AcceleratedGenerate,
    RolloutConfig,
    accelerate_generate,
    drop_in_default_config,
    restore_generate,
)
from graphcap.rollout.drop_in import PENALISES_PADDING
from graphcap.rollout.plan.fingerprint import INERT_HOOKS, hook_name, host_state
from graphcap.rollout.settings.vocabulary import GENERATE_DEFAULTS

SETTINGS = {
    "greedy": {"max_new_tokens": 9},
    "beam-settings-without-beams": {"max_new_tokens": 9, "early_stopping": True, "num_beams": 1},
    "greedy-eos-list": {"max_new_tokens": 9, "eos_token_id": [EOS, 7, 11]},
    "sampled": {"max_new_tokens": 9, "do_sample": True},
    "sampled-warped": {
        "max_new_tokens": 9,
        "do_sample": True,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.9,
        "min_p": 0.02,
    },
    "samples-per-prompt": {"max_new_tokens": 7, "do_sample": True, "num_return_sequences": 3},
    "min-new-tokens": {"max_new_tokens": 9, "min_new_tokens": 5, "eos_token_id": [EOS, 7]},
    "max-length": {"max_length": 13},
    "min-length": {"max_new_tokens": 8, "min_length": 10, "eos_token_id": [EOS, 7]},
    "generate-default-length": {},
    "dict-output": {"max_new_tokens": 6, "return_dict_in_generate": True},
    "scores-and-logits": {
        "max_new_tokens": 6,
        "return_dict_in_generate": True,
        "output_scores": True,
        "output_logits": True,
    },
    "sampled-scores": {
        "max_new_tokens": 6,
        "do_sample": True,
        "top_k": 12,
        "top_p": 0.8,
        "temperature": 0.7,
        "return_dict_in_generate": True,
        "output_scores": True,
    },
    "scores-without-a-dict": {"max_new_tokens": 6, "output_scores": True},
}


def generate_draws(model):
    """The drop-in's default configuration with generate's own random numbers (the default
    draws per row: same distribution, other numbers)."""
    return replace(drop_in_default_config(), draws="generate")


def both(model, call, seed: int = 0, config: RolloutConfig | None = None):
    """``call()``'s result from generate, then from graphcap under generate (same seed;
    ``config`` as given to ``accelerate_generate``, else the default with generate's own random
    numbers), and the generator's state after each."""
    torch.manual_seed(seed)
    expected = call()
    after_expected = torch.get_rng_state()
    accelerated = accelerate_generate(model, config or generate_draws(model))
    try:
        torch.manual_seed(seed)
        got = call()
        after_got = torch.get_rng_state()
    finally:
        restore_generate(model)
    return expected, got, accelerated, torch.equal(after_expected, after_got)


def assert_same_output(expected, got) -> None:
    """The same type, shapes and tokens; per-step scores and logits equal within fp32
    rounding (the graph's attention sums over a padded cache in another order: differences of
    2e-5 were seen on OPT), -inf where generate's are."""
    assert type(got) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and torch.equal(got, expected), (got, expected)
        return
    assert torch.equal(got.sequences, expected.sequences)
    for name in ("attentions", "hidden_states", "past_key_values"):
        assert getattr(got, name) is None
    for name in ("scores", "logits"):
        mine, theirs = getattr(got, name), getattr(expected, name)
        assert (mine is None) == (theirs is None), name
        if theirs is None:
            continue
        assert len(mine) == len(theirs)
        for step, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert a.shape == b.shape and a.dtype == b.dtype, (name, step)
            assert torch.equal(torch.isinf(a), torch.isinf(b)), (name, step)
            finite = torch.isfinite(b)
            torch.testing.assert_close(a[finite], b[finite], rtol=1e-4, atol=1e-4)


#: Every setting on Llama; on the other families the ones that exercise different code.
CASES = [("llama", name) for name in SETTINGS] + [
    (family, name)
    for family in FAMILIES
    if family != "llama"
    for name in ("greedy-eos-list", "sampled-warped", "samples-per-prompt", "scores-and-logits")
]


@pytest.mark.parametrize(("family", "name"), CASES)
def test_served_calls_return_what_generate_returns(family, name):
    model = tiny_model(family)
    ids, mask = prompts(3)
    kwargs = SETTINGS[name]
    expected, got, accelerated, same_rng = both(
        model, lambda: model.generate(ids, attention_mask=mask, **kwargs)
    )
    assert_same_output(expected, got)
    assert same_rng, "the drop-in left the random generator elsewhere than generate does"
    stats = accelerated.stats
    assert stats.served == 1 and not stats.fallbacks, dict(stats.fallbacks)
    assert stats.last.path == "static_graph" and stats.last.replays >= 1


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_the_repetition_penalty_is_served_on_unpadded_prompts(family, do_sample):
    model = tiny_model(family)
    ids, mask = prompts(3, padded=False)
    kwargs = {"max_new_tokens": 9, "repetition_penalty": 1.3, "do_sample": do_sample}
    expected, got, accelerated, same_rng = both(
        model, lambda: model.generate(ids, attention_mask=mask, **kwargs)
    )
    assert_same_output(expected, got)
    assert same_rng and accelerated.stats.served == 1


@pytest.mark.skipif(not PENALISES_PADDING, reason="this transformers ignores left padding too")
def test_the_penalty_on_padded_prompts_goes_to_generate_where_it_penalises_padding():
    model = tiny_model("llama")
    ids, mask = prompts(3)

    def call():
        return model.generate(ids, attention_mask=mask, max_new_tokens=6, repetition_penalty=1.3)

    with pytest.warns(GenerateFallbackWarning, match="left-padding"):
        expected, got, accelerated, _ = both(model, call)
    assert torch.equal(got, expected) and accelerated.stats.served == 0


def test_rows_that_all_stop_early_give_generates_shorter_output():
    model = tiny_model("llama")
    ids, mask = prompts(3)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=12)
    third = free[:, ids.shape[1] + 2].tolist()  # every row's third token ends it
    eos = sorted({EOS, *third})

    def call():
        return model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos)

    expected, got, accelerated, same_rng = both(model, call)
    assert got.shape[1] < free.shape[1] and same_rng
    assert_same_output(expected, got)
    assert accelerated.stats.served == 1


#: Configs a user may pass: the README's, buckets of both kinds, an interval of their own.
USER_CONFIGS = {
    "drop-in default": None,
    "readme": RolloutConfig(enable_graph_capture=True, draws="generate"),
    "buckets": RolloutConfig(
        enable_graph_capture=True,
        batch_buckets=(4, 8),
        length_buckets=(32, 64),
        draws="generate",
    ),
    "interval 4": RolloutConfig(enable_graph_capture=True, eos_check_interval=4, draws="generate"),
}


@pytest.mark.parametrize("config", list(USER_CONFIGS))
@pytest.mark.parametrize("position", [0, 2], ids=["first-token", "third-token"])
def test_sampled_rows_that_all_end_early_draw_what_generate_draws(position, config):
    """Every row ends at its first (the prefill's) or third token: the call stops where
    generate stops, so it draws as many random numbers and the next call samples alike;
    under any config the drop-in accepts (it sets what the promise needs)."""
    model = tiny_model("llama")
    ids, mask = prompts(3)
    torch.manual_seed(0)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True)
    eos = sorted({EOS, *free[:, ids.shape[1] + position].tolist()})

    def call():
        first = model.generate(
            ids, attention_mask=mask, max_new_tokens=12, do_sample=True, eos_token_id=eos
        )
        then = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True)
        return torch.cat([first, then], 1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the dropped settings: tested below
        expected, got, accelerated, same_rng = both(model, call, config=USER_CONFIGS[config])
    assert got.shape[1] <= ids.shape[1] * 2 + position + 1 + 5
    assert_same_output(expected, got)
    assert same_rng and accelerated.stats.served == 2


def test_a_generation_config_object_and_keywords_resolve_as_generate_resolves_them():
    model = tiny_model("qwen2")
    ids, mask = prompts(4)
    config = GenerationConfig(max_new_tokens=8, do_sample=True, top_k=0, eos_token_id=[EOS])
    config.disable_compile = True  # what TRL's GRPOTrainer passes

    def call():
        return model.generate(
            input_ids=ids, attention_mask=mask, generation_config=config, temperature=0.8
        )

    expected, got, accelerated, _ = both(model, call)
    assert_same_output(expected, got)
    assert accelerated.stats.served == 1


def test_prompts_of_new_widths_reuse_the_graph_of_their_length_bucket():
    """Rows of 16 to 24 columns: on the CPU backend's block table (16-column blocks) the
    later calls need a second block per row, which the pool sized for the bucket holds."""
    model = tiny_model("llama")
    accelerated = accelerate_generate(model)
    sizes = set()  # the batch sizes the live-row ladder ran: one graph each
    try:
        for width in (4, 6, 9, 12):
            ids, mask = prompts(2, width=width, seed=width)
            model.generate(ids, attention_mask=mask, max_new_tokens=12)
            assert accelerated.stats.last.kv_layout == "blocks"
            sizes |= set(accelerated.stats.last.batch_steps) or {2}
        assert accelerated.stats.served == 4 and accelerated.stats.captures == len(sizes)
        assert accelerated.stats.replays == 4 * 11
    finally:
        restore_generate(model)


FALLBACKS = {
    "beam search": ({"num_beams": 2}, "num_beams"),
    "attentions": (
        {"output_attentions": True, "return_dict_in_generate": True},
        "output_attentions",
    ),
    "logits processor": (
        {"logits_processor": LogitsProcessorList([TopKLogitsWarper(5)]), "do_sample": True},
        "logits_processor",
    ),
    "model input": ({"inputs_embeds": "embeds"}, "inputs_embeds"),
    "autocast weight cache": ({"autocast": True}, "autocast"),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_calls_graphcap_does_not_serve_go_to_generate_with_the_reason(name):
    model = tiny_model("llama", fresh=True)  # generate may leave hooks (output_attentions)
    ids, mask = prompts(2)
    extra, reason = FALLBACKS[name]
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    extra = {k: embeds if v == "embeds" else v for k, v in extra.items()}
    autocast = extra.pop("autocast", False)  # as verl's HF rollout calls generate

    def call():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return model.generate(ids, attention_mask=mask, max_new_tokens=6, **extra)

    with pytest.warns(GenerateFallbackWarning, match=reason):
        expected, got, accelerated, _ = both(model, call)
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected)
    else:
        assert torch.equal(got.sequences, expected.sequences)
    stats = accelerated.stats
    assert stats.served == 0 and stats.calls == 1
    (recorded,) = stats.fallbacks
    assert reason in recorded


def test_a_max_length_within_the_prompt_goes_to_generate_and_its_error():
    model = tiny_model("llama")
    ids, mask = prompts(2)
    with pytest.raises(ValueError, match="max_length") as expected:
        model.generate(ids, attention_mask=mask, max_length=4)
    accelerated = accelerate_generate(model)
    try:
        with (
            pytest.warns(GenerateFallbackWarning, match="no tokens to generate"),
            pytest.raises(ValueError, match="max_length") as got,
        ):
            model.generate(ids, attention_mask=mask, max_length=4)
    finally:
        restore_generate(model)
    assert str(got.value) == str(expected.value) and accelerated.stats.served == 0


def test_right_padded_prompts_go_to_generate_with_the_engines_reason():
    model = tiny_model("llama")
    ids, mask = prompts(2)
    ids, mask = ids.flip(1), mask.flip(1)

    def call():
        return model.generate(ids, attention_mask=mask, max_new_tokens=5)

    with pytest.warns(GenerateFallbackWarning, match="refused"):
        expected, got, accelerated, _ = both(model, call)
    assert torch.equal(got, expected) and accelerated.stats.served == 0


def test_a_call_too_large_for_the_device_frees_the_engines_buffers_for_generate():
    """generate gets the memory the engine held, where graphcap cannot serve a call for want
    of it (the engine's next served call allocates again)."""
    model = tiny_model("llama")
    ids, mask = prompts(2)
    backend = ScriptedMemory(free=2**40)
    accelerated = accelerate_generate(model, replace(drop_in_default_config(), backend=backend))
    try:
        served = model.generate(ids, attention_mask=mask, max_new_tokens=6)
        assert accelerated.stats.served == 1 and accelerated.engine.cache is not None
        backend.free = 0
        with pytest.warns(GenerateFallbackWarning, match="would allocate.*freed for generate"):
            handed = model.generate(ids, attention_mask=mask, max_new_tokens=6)
        # released (a region keeps the addresses) or freed: the device has it back either way
        engine = accelerated.engine
        assert (engine.sleeping or engine.cache is None) and accelerated.stats.served == 1
        backend.free = 2**40
        again = model.generate(ids, attention_mask=mask, max_new_tokens=6)
        assert accelerated.stats.served == 2
    finally:
        restore_generate(model)
    assert torch.equal(handed, served) and torch.equal(again, served)


def test_a_call_whose_records_do_not_fit_goes_to_generate():
    """``output_scores`` records ``batch x length x vocabulary`` float32 inside the step: at a
    vocabulary of 32,768 they take 16 MiB of memory the rest of the call fits in. Such a call
    was not counted and ran out of memory; now it is refused and generate serves it (the
    same call with room for its records is served)."""
    model = tiny_model("llama", vocab_size=32768)
    ids, mask = prompts(2)
    backend = ScriptedMemory(free=16 * 2**20)
    accelerated = accelerate_generate(model, replace(drop_in_default_config(), backend=backend))

    def call():
        return model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=6,
            return_dict_in_generate=True,
            output_scores=True,
        )

    try:
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=6)
        assert accelerated.stats.served == 1
        with pytest.warns(GenerateFallbackWarning, match="output_scores.*freed for generate"):
            handed = call()
        assert accelerated.stats.served == 1
        backend.free = 2**40
        served = call()
        assert accelerated.stats.served == 2
    finally:
        restore_generate(model)
    assert torch.equal(handed.sequences, plain) and torch.equal(served.sequences, plain)
    for ours, theirs in zip(served.scores, handed.scores, strict=True):
        torch.testing.assert_close(ours, theirs)


def test_a_fallback_warns_once_per_reason():
    model = tiny_model("llama")
    ids, mask = prompts(2)
    accelerated = accelerate_generate(model)
    try:
        with pytest.warns(GenerateFallbackWarning) as seen:
            for _ in range(3):
                model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2)
        assert len(seen) == 1 and accelerated.stats.fallbacks.total() == 3
    finally:
        restore_generate(model)


def test_training_state_is_kept_and_in_place_updates_are_seen():
    """A trainer's model: train() with gradient checkpointing on, weights updated in place by
    an optimizer between rollouts. Each rollout equals generate's on the current weights (on a
    copy with checkpointing off: transformers 5.17's generate with it on feeds one token at a
    time without a cache), the graph is captured once, the training state stays as it was."""
    model = tiny_model("llama", fresh=True)
    model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids, mask = prompts(3)
    accelerated = accelerate_generate(model)
    sizes = set()  # the batch sizes the live-row ladder ran: one graph each
    try:
        outputs = []
        for _ in range(3):
            got = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
            sizes |= set(accelerated.stats.last.batch_steps) or {3}
            assert model.training and model.is_gradient_checkpointing
            reference = copy.deepcopy(model)
            reference.gradient_checkpointing_disable()
            assert torch.equal(got, reference.generate(ids, attention_mask=mask, max_new_tokens=8))
            outputs.append(got)
            model(input_ids=got, labels=got).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert accelerated.stats.captures == len(sizes) and accelerated.stats.served == 3
        assert not torch.equal(outputs[0], outputs[-1])  # the updates changed the rollouts
    finally:
        restore_generate(model)


def test_a_peft_model_is_served_through_its_base_model():
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", fresh=True)
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # LoRA B starts at zero: make the adapter change the output
    ids, mask = prompts(3)

    def call():
        return lora.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8)

    torch.manual_seed(0)
    expected = call()
    accelerated = accelerate_generate(lora)
    try:
        assert accelerated.model is model  # installed where PeftModel.generate ends up
        assert torch.equal(call(), expected)
        assert accelerated.stats.served == 1
    finally:
        assert restore_generate(lora)
    with torch.no_grad(), lora.disable_adapter():
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=8)
    assert not torch.equal(plain, expected)


def test_an_accelerate_prepared_model_is_served():
    accelerate = pytest.importorskip("accelerate")
    model = tiny_model("llama", fresh=True)
    prepared = accelerate.Accelerator(cpu=True).prepare(model)
    ids, mask = prompts(2)
    expected = prepared.generate(ids, attention_mask=mask, max_new_tokens=6)
    accelerated = accelerate_generate(prepared)
    try:
        assert torch.equal(prepared.generate(ids, attention_mask=mask, max_new_tokens=6), expected)
        assert accelerated.stats.served == 1
    finally:
        restore_generate(prepared)


def test_install_and_restore():
    model = tiny_model("llama", fresh=True)
    accelerated = accelerate_generate(model)
    assert isinstance(accelerated, AcceleratedGenerate) and "generate" in model.__dict__
    with pytest.raises(RuntimeError, match="restore_generate"):
        accelerate_generate(model)
    assert restore_generate(model) and "generate" not in model.__dict__
    assert not restore_generate(model)
    with pytest.raises(TypeError, match="no generate"):
        accelerate_generate(torch.nn.Linear(2, 2))


def test_generate_defaults_table_matches_transformers():
    """graphcap keeps its own copy of the values generate gives unset fields (transformers'
    table is private); this names it to fail loudly when transformers changes it."""
    assert GenerationConfig._get_default_generation_params() == GENERATE_DEFAULTS


def test_the_checkpointing_hook_left_out_of_the_host_state_still_exists_and_does_nothing():
    """``INERT_HOOKS`` names transformers' input-grad hook: re-enabling checkpointing (as TRL
    does around every generate) adds one each time, and it must neither change the host state
    nor issue any operation inside a captured step."""
    model = tiny_model("llama", fresh=True)
    model.gradient_checkpointing_enable()
    model.gradient_checkpointing_disable()  # what a trainer's generate sees, step after step
    before = host_state(model)
    model.gradient_checkpointing_enable()
    hooks = list(model.get_input_embeddings()._forward_hooks.values())
    assert hooks and all(hook_name(h) in INERT_HOOKS for h in hooks), hooks
    model.gradient_checkpointing_disable()  # transformers 5.17 leaves the hooks in place
    assert host_state(model) == before
    seen = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    out = torch.zeros(2, 3)
    with torch.no_grad(), Recorder():
        for hook in hooks:
            hook(model.get_input_embeddings(), (), out)
    assert seen == []


def test_the_drop_in_sets_what_its_promise_needs_and_says_what_it_dropped():
    model = tiny_model("llama", fresh=True)
    plain = drop_in_default_config()
    assert plain.eos_check_interval == 1 and plain.length_buckets
    assert plain.enable_graph_capture is None  # the engine's default: where the backend can
    chosen = RolloutConfig(
        enable_graph_capture=True, batch_buckets=(4,), eos_check_interval=4, draws="generate"
    )
    with pytest.warns(UserWarning, match=r"batch_buckets=\(4,\).*eos_check_interval=4"):
        accelerated = accelerate_generate(model, chosen)
    config = accelerated.engine.config
    assert config.eos_check_interval == 1 and config.batch_buckets is None
    restore_generate(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the README's config drops nothing the user chose
        accelerated = accelerate_generate(
            model, RolloutConfig(enable_graph_capture=True, draws="generate")
        )
    assert accelerated.engine.config.eos_check_interval == 1
    restore_generate(model)
    with pytest.raises(ValueError, match="continuous_batch_size"):
        accelerate_generate(model, RolloutConfig(continuous_batch_size=2, draws="generate"))
    assert "generate" not in model.__dict__
    per_row = replace(chosen, draws="per_row")  # one draw per call: nothing to set
    assert accelerate_generate(model, per_row).engine.config == per_row
    restore_generate(model)


def generate_of(model, ids, mask):
    """What transformers' own generate gives ``model`` (greedy, 8 tokens)."""
    return type(model).generate(model, ids, attention_mask=mask, max_new_tokens=8)


def test_a_deep_copy_generates_with_its_own_weights_and_its_restore_leaves_the_original():
    """PPO's old policy or an EMA copy, taken after installation: the copy runs its class's
    plain generate on its own weights; the original keeps its engine."""
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(2)
    accelerated = accelerate_generate(model)
    try:
        old = copy.deepcopy(model)
        with torch.no_grad():
            for p in old.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        got = old.generate(ids, attention_mask=mask, max_new_tokens=8)
        assert torch.equal(got, generate_of(old, ids, mask))
        assert not torch.equal(got, model.generate(ids, attention_mask=mask, max_new_tokens=8))
        assert accelerated.stats.served == 1  # the original's call only
        assert not restore_generate(old)
        model.generate(ids, attention_mask=mask, max_new_tokens=8)
        assert accelerated.stats.served == 2 and model.generate.graphcap is accelerated
        again = accelerate_generate(old)  # a copy takes an engine of its own
        assert again.engine is not accelerated.engine
        assert torch.equal(old.generate(ids, attention_mask=mask, max_new_tokens=8), got)
        assert restore_generate(old) and again.stats.served == 1
        assert model.generate.graphcap is accelerated
    finally:
        restore_generate(model)


def test_an_accelerated_model_pickles_saves_and_loads_with_plain_generate(tmp_path):
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(2)
    expected = generate_of(model, ids, mask)
    accelerated = accelerate_generate(model)
    try:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = [torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(model))]
        model.save_pretrained(tmp_path)
        loaded.append(type(model).from_pretrained(tmp_path))
        for copy_ in loaded:
            assert getattr(copy_.generate, "graphcap", None) is None
            assert torch.equal(copy_.generate(ids, attention_mask=mask, max_new_tokens=8), expected)
        assert model.generate.graphcap is accelerated and accelerated.stats.served == 0
    finally:
        restore_generate(model)


def test_a_half_precision_model_is_told_its_rollouts_part_from_float32_ones():
    model = tiny_model("llama", fresh=True).to(torch.bfloat16)
    with pytest.warns(UserWarning, match=r"torch.bfloat16: served calls are half-precision"):
        accelerate_generate(model)
    restore_generate(model)


def test_the_first_served_call_says_so_once_through_logging(caplog):
    """Under a trainer nothing else tells that graphcap serves: one INFO line at the first
    served call, on the "graphcap.rollout" logger (its level turns it off)."""
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(2)
    accelerate_generate(model)
    try:
        with caplog.at_level(logging.INFO, logger="graphcap.rollout"):
            for _ in range(2):
                model.generate(ids, attention_mask=mask, max_new_tokens=4)
        served = [r for r in caplog.records if "served by graphcap's engine" in r.getMessage()]
        assert len(served) == 1 and "backend cpu" in served[0].getMessage()
    finally:
        restore_generate(model)
