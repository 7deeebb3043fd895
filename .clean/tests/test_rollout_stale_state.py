"""A replayed graph never runs stale host state (issue 10, issue 16 case 6).

Each test captures on the CPU reference backend, changes something forward reads on the host
(adapter state, hooks, a module attribute, an instance-level forward, a module's class, packed
int8 weights, a parameter's strides), calls the same engine again and compares with a fresh
eager engine. Without the host-state fingerprint in the graph signature, each second call
replays the old kernels: different tokens, no warning.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

import pytest
import torch
from rollout_models import prompts, run, tiny_model
from torch.overrides import TorchFunctionMode

from graphcap.cpu import CPUBackend
from graphcap.rollout import CaptureFallbackWarning, RolloutConfig, RolloutEngine, SamplingParams

NEW = 8
SAMPLING = {"max_new_tokens": NEW, "eos_token_id": []}


def graph_engine(model: torch.nn.Module, **config: object) -> RolloutEngine:
    return RolloutEngine(
        model, RolloutConfig(enable_graph_capture=True, backend=CPUBackend(), **config)
    )


def eager_tokens(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return run(model, ids, mask, False, **SAMPLING).sequences


def recaptures_after(
    model: torch.nn.Module, change: Callable[[], object], reason: str, differs: bool = True
) -> None:
    """Capture, apply ``change``, call again: eager's tokens, a recapture naming ``reason``.

    ``differs``: the change is expected to change the tokens (so a stale replay shows).
    """
    ids, mask = prompts(3)
    engine = graph_engine(model)
    first = engine.generate(ids, mask, SamplingParams(**SAMPLING))
    assert first.stats.path == "static_graph" and first.stats.captured
    change()
    second = engine.generate(ids, mask, SamplingParams(**SAMPLING))
    expected = eager_tokens(model, ids, mask)
    assert torch.equal(second.sequences, expected)
    if differs:
        assert not torch.equal(expected, first.sequences), "the change must change the tokens"
    assert second.stats.path == "static_graph" and second.stats.captured
    assert any(r.startswith("host_state") and reason in r for r in second.stats.recapture_reason)
    engine.shutdown()


def scale_output(factor: float) -> Callable[..., object]:
    def hook(module: torch.nn.Module, args: tuple, output: object) -> object:
        if isinstance(output, tuple):
            return (output[0] * factor, *output[1:])
        return output * factor

    return hook


# ---- PEFT LoRA ---------------------------------------------------------------------------------
@pytest.fixture
def lora_model() -> torch.nn.Module:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_model("llama", fresh=True), config)
    # random LoRA weights large enough that the adapter changes the tokens
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(3.0)
    return model.eval()


def test_lora_disable_adapter_context_recaptures_and_back(lora_model):
    ids, mask = prompts(3)
    engine = graph_engine(lora_model)
    adapted = engine.generate(ids, mask, SamplingParams(**SAMPLING))
    assert adapted.stats.path == "static_graph"
    with lora_model.disable_adapter():
        disabled = engine.generate(ids, mask, SamplingParams(**SAMPLING))
        expected = eager_tokens(lora_model, ids, mask)
    assert torch.equal(disabled.sequences, expected)
    assert not torch.equal(disabled.sequences, adapted.sequences)
    assert disabled.stats.captured and "_disable_adapters" in disabled.stats.recapture_reason[0]
    again = engine.generate(ids, mask, SamplingParams(**SAMPLING))
    assert again.stats.captured and torch.equal(again.sequences, adapted.sequences)
    # an unchanged adapter state keeps the graph (the fingerprint does not churn)
    steady = engine.generate(ids, mask, SamplingParams(**SAMPLING))
    assert not steady.stats.captured and steady.stats.recapture_reason == []


def test_lora_merge_and_unmerge_recapture(lora_model):
    # merged or not, the math is the same: a stale replay after merging applies LoRA twice
    ids, mask = prompts(3)
    engine = graph_engine(lora_model)
    unmerged = engine.generate(ids, mask, SamplingParams(**SAMPLING))
    lora_model.merge_adapter()
    merged = engine.generate(ids, mask, SamplingParams(**SAMPLING))
    assert torch.equal(merged.sequences, eager_tokens(lora_model, ids, mask))
    assert merged.stats.captured and "merged_adapters" in merged.stats.recapture_reason[0]
    lora_model.unmerge_adapter()
    back = engine.generate(ids, mask, SamplingParams(**SAMPLING))
    assert torch.equal(back.sequences, eager_tokens(lora_model, ids, mask))
    assert back.stats.captured and "merged_adapters" in back.stats.recapture_reason[0]
    assert torch.equal(back.sequences, unmerged.sequences)


def test_lora_switching_the_active_adapter_recaptures(lora_model):
    import peft

    second = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    lora_model.add_adapter("other", second)
    with torch.no_grad():
        for name, param in lora_model.named_parameters():
            if "lora_" in name and ".other." in name:
                param.mul_(3.0)
    recaptures_after(lora_model, lambda: lora_model.set_adapter("other"), "_active_adapter")


# ---- hooks -------------------------------------------------------------------------------------
def test_forward_hook_added_after_capture_recaptures():
    model = tiny_model("llama", fresh=True)
    mlp = model.model.layers[0].mlp
    recaptures_after(model, lambda: mlp.register_forward_hook(scale_output(2.5)), "forward hooks")


def test_forward_hook_removed_after_capture_recaptures():
    model = tiny_model("llama", fresh=True)
    handle = model.model.layers[0].mlp.register_forward_hook(scale_output(2.5))
    recaptures_after(model, handle.remove, "forward hooks")


def test_forward_pre_hook_with_kwargs_added_and_removed_after_capture_recaptures():
    model = tiny_model("llama", fresh=True)
    layer = model.model.layers[1]

    def pre_hook(module, args, kwargs):
        return (args[0] * 3.0, *args[1:]), kwargs

    handles = []
    recaptures_after(
        model,
        lambda: handles.append(layer.register_forward_pre_hook(pre_hook, with_kwargs=True)),
        "model.layers.1: forward hooks",
    )
    recaptures_after(model, handles[0].remove, "model.layers.1: forward hooks")


def test_global_module_forward_hook_recaptures():
    model = tiny_model("llama", fresh=True)
    mlp_type = type(model.model.layers[0].mlp)

    def hook(module, args, output):
        return output * 2.5 if isinstance(module, mlp_type) else None

    handles = []
    try:
        recaptures_after(
            model,
            lambda: handles.append(torch.nn.modules.module.register_module_forward_hook(hook)),
            "global module forward hooks",
        )
    finally:
        for handle in handles:
            handle.remove()


# ---- functions and classes ---------------------------------------------------------------------
def test_instance_forward_wrapped_after_capture_recaptures():
    """accelerate's hooks (``add_hook_to_module``) replace a module's forward on the instance;
    the wrapper is a plain attribute, not a torch hook."""
    model = tiny_model("llama", fresh=True)
    mlp = model.model.layers[0].mlp
    inner = mlp.forward

    def wrapped(*args: object, **kwargs: object) -> torch.Tensor:
        return inner(*args, **kwargs) * 2.5

    recaptures_after(model, lambda: setattr(mlp, "forward", wrapped), "model.layers.0.mlp.forward")
    # and back to the class's forward: the instance attribute is gone, which recaptures again
    recaptures_after(model, lambda: delattr(mlp, "forward"), "model.layers.0.mlp.forward")


def test_submodule_swapped_for_another_class_recaptures():
    """Tanh and Sigmoid hold the same attributes: only the module's class tells them apart."""
    model = tiny_model("llama", fresh=True)
    mlp = model.model.layers[0].mlp
    mlp.act_fn = torch.nn.Tanh()
    recaptures_after(
        model,
        lambda: setattr(mlp, "act_fn", torch.nn.Sigmoid()),
        "model.layers.0.mlp.act_fn: Tanh replaced by Sigmoid",
    )


def test_function_attribute_swapped_after_capture_recaptures():
    """A function held as a plain attribute (not a module) that forward calls."""
    model = tiny_model("llama", fresh=True)
    mlp = model.model.layers[0].mlp
    del mlp.act_fn  # the child module, so that a plain attribute can take its name
    mlp.act_fn = torch.tanh  # a builtin, not a module: forward calls it as self.act_fn(x)
    recaptures_after(model, lambda: setattr(mlp, "act_fn", torch.sigmoid), "mlp.act_fn")


# ---- plain attributes, strides, packed weights -------------------------------------------------
def test_rotary_attention_scaling_changed_after_capture_recaptures():
    model = tiny_model("llama", fresh=True)

    def change() -> None:
        model.model.rotary_emb.attention_scaling = 2.0

    recaptures_after(model, change, "model.rotary_emb.attention_scaling")


def test_transposed_parameter_same_storage_new_strides_recaptures():
    model = tiny_model("llama", fresh=True)
    weight = model.model.layers[0].self_attn.o_proj.weight  # square: still a valid Linear
    address = weight.data_ptr()

    def change() -> None:
        with torch.no_grad():
            weight.transpose_(0, 1)
        assert weight.data_ptr() == address and not weight.is_contiguous()

    ids, mask = prompts(3)
    engine = graph_engine(model)
    first = engine.generate(ids, mask, SamplingParams(**SAMPLING))
    change()
    second = engine.generate(ids, mask, SamplingParams(**SAMPLING))
    expected = eager_tokens(model, ids, mask)
    assert not torch.equal(expected, first.sequences)
    assert torch.equal(second.sequences, expected)
    assert second.stats.captured and second.stats.recapture_reason == ["tensors"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_int8_dynamic_quantized_weights_set_after_capture_recapture():
    model = tiny_model("llama", fresh=True)
    targets = {f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("up_proj", "down_proj")}
    model = torch.ao.quantization.quantize_dynamic(model, qconfig_spec=targets, dtype=torch.qint8)
    generator = torch.Generator().manual_seed(7)

    def change() -> None:
        for i in range(2):
            linear = model.model.layers[i].mlp.down_proj
            weight, bias = linear.weight(), linear.bias()
            fresh = torch.randn(weight.shape, generator=generator) * 0.5
            linear.set_weight_bias(torch.quantize_per_tensor(fresh, 0.02, 0, torch.qint8), bias)

    recaptures_after(model, change, "_packed_params")


# ---- host reads the CPU graph must refuse -----------------------------------------------------
def test_hook_branching_on_tolist_fails_capture_and_runs_eagerly():
    model = tiny_model("llama", fresh=True)

    def branching(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden[:, -1, 0].tolist()[0] > 0:  # a host read a device graph cannot hold
            return output * 3.0
        return None

    model.model.layers[0].register_forward_hook(branching)
    ids, mask = prompts(3)
    with pytest.warns(CaptureFallbackWarning):
        graph = run(model, ids, mask, True, **SAMPLING)
    assert graph.stats.path == "eager"
    assert "Tensor.tolist()" in graph.stats.fallback_reason
    assert torch.equal(graph.sequences, eager_tokens(model, ids, mask))


# ---- memory, continuous path, shutdown ---------------------------------------------------------
class _LiveBytes(TorchFunctionMode):
    """Tracks the bytes held by ``watched`` tensors plus large tensors made by factories.

    The CPU has no allocator statistics; this reads the peak from allocation order instead: at
    every large allocation it adds the bytes of the old tensors still alive to the new ones.
    """

    FACTORIES = frozenset({torch.zeros, torch.empty, torch.ones, torch.full, torch.zeros_like})

    def __init__(self, watched: list[torch.Tensor], threshold: int) -> None:
        super().__init__()
        self.old = [(weakref.ref(t), t.nbytes) for t in watched]
        self.new: list[tuple[weakref.ref, int]] = []
        self.threshold = threshold
        self.peak = 0

    def live(self) -> int:
        return sum(n for ref, n in self.old + self.new if ref() is not None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        large = isinstance(result, torch.Tensor) and result.nbytes >= self.threshold
        if func in self.FACTORIES and large:
            self.new.append((weakref.ref(result), result.nbytes))
            self.peak = max(self.peak, self.live())
        return result


def cache_tensors(engine: RolloutEngine) -> list[torch.Tensor]:
    """The K/V tensors of the engine's static cache (transformers' public ``Cache.layers``)."""
    return [t for layer in engine.cache.layers for t in (layer.keys, layer.values)]


def test_recapture_drops_the_old_cache_before_allocating_the_new_one():
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(4)
    # a static cache that dwarfs everything else (a block table allocates as rows grow)
    engine = graph_engine(model, length_buckets=(2048,), kv_block_size=None)
    engine.generate(ids, mask, SamplingParams(max_new_tokens=3, eos_token_id=[]))
    old = cache_tensors(engine)
    held = sum(t.nbytes for t in old)
    tracker = _LiveBytes(old, threshold=min(t.nbytes for t in old) // 2)
    del old
    model.model.rotary_emb.attention_scaling = 1.5  # a host-state change: recapture
    with tracker:
        result = engine.generate(ids, mask, SamplingParams(max_new_tokens=3, eos_token_id=[]))
    assert result.stats.captured and result.stats.recapture_reason
    assert sum(t.nbytes for t in cache_tensors(engine)) == held
    # dropped first: old + new never coexist (allocating first would peak at twice ``held``)
    assert held <= tracker.peak < 1.5 * held


def test_continuous_repetition_penalty_graph_equals_eager():
    model = tiny_model("llama")
    ids, mask = prompts(5)
    params = SamplingParams(max_new_tokens=NEW, repetition_penalty=1.8, eos_token_id=[])
    results = {}
    for graph in (True, False):
        engine = RolloutEngine(
            model,
            RolloutConfig(
                enable_graph_capture=graph, backend=CPUBackend(), continuous_batch_size=2
            ),
        )
        results[graph] = engine.generate(ids, mask, params)
        engine.shutdown()
    assert results[True].stats.path == "continuous_graph"
    assert torch.equal(results[True].sequences, results[False].sequences)
    plain = run(model, ids, mask, False, max_new_tokens=NEW, eos_token_id=[])
    assert not torch.equal(results[False].sequences, plain.sequences)  # the penalty mattered


def test_continuous_path_recaptures_on_host_state_change():
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(3)
    engine = graph_engine(model, continuous_batch_size=2)
    first = engine.generate(ids, mask, SamplingParams(**SAMPLING))
    assert first.stats.path == "continuous_graph"
    handle = model.model.layers[0].mlp.register_forward_hook(scale_output(2.5))
    second = engine.generate(ids, mask, SamplingParams(**SAMPLING))
    expected = eager_tokens(model, ids, mask)
    handle.remove()
    assert second.stats.captured and "forward hooks" in " ".join(second.stats.recapture_reason)
    assert torch.equal(second.sequences, expected)
    assert not torch.equal(second.sequences, first.sequences)


def _cache_seen_by_forward(model: torch.nn.Module) -> tuple[list[weakref.ref], object]:
    """Weak references to every cache object forward receives, and the hook's handle."""
    seen: list[weakref.ref] = []

    def grab(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is not None:
            seen.append(weakref.ref(cache))

    return seen, model.model.register_forward_pre_hook(grab, with_kwargs=True)


@pytest.mark.parametrize("continuous", [None, 2], ids=["static", "continuous"])
def test_shutdown_releases_every_cache_the_model_was_given(continuous):
    import gc

    model = tiny_model("llama", fresh=True)
    seen, handle = _cache_seen_by_forward(model)
    ids, mask = prompts(3)
    engine = graph_engine(model, continuous_batch_size=continuous)
    result = engine.generate(ids, mask, SamplingParams(**SAMPLING))
    handle.remove()
    assert result.stats.path.endswith("graph") and seen
    engine.shutdown()
    gc.collect()
    assert engine.cache is None
    alive = [type(ref()).__name__ for ref in seen if ref() is not None]
    assert not alive, f"caches still alive after shutdown: {alive}"


# ---- concurrent calls (issue 10 case 6) --------------------------------------------------------
def test_three_threads_on_one_engine_get_correct_results_or_a_clear_error():
    model = tiny_model("llama", fresh=True)

    def slow_prefill(module, args):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.002)  # let the other threads in, as a GPU launch queue would

    model.model.embed_tokens.register_forward_pre_hook(slow_prefill)
    inputs = [prompts(2 + i, seed=i) for i in range(3)]
    expected = [eager_tokens(model, ids, mask) for ids, mask in inputs]
    engine = graph_engine(model)
    outcomes: list[object] = [None] * 3

    def call(index: int) -> None:
        ids, mask = inputs[index]
        try:
            for _ in range(3):
                outcomes[index] = engine.generate(ids, mask, SamplingParams(**SAMPLING)).sequences
                if not torch.equal(outcomes[index], expected[index]):
                    return
        except Exception as exc:
            outcomes[index] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for index, outcome in enumerate(outcomes):
        if isinstance(outcome, Exception):
            # a refusal must say what happened, not fail deep inside torch
            assert "concurrent" in str(outcome) or "another thread" in str(outcome), outcome
        else:
            assert torch.equal(outcome, expected[index]), f"thread {index}: wrong tokens"
    assert any(isinstance(o, torch.Tensor) for o in outcomes)
