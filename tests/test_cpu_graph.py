"""The CPU graph behaves like a device graph: each test pins a property a no-op graph misses."""

from __future__ import annotations

import contextlib
import operator
import threading

import numpy as np
import pytest
import torch

from graphcap.cpu import CPUBackend
from graphcap.cpu.graph import CPUGraph, is_capturing
from graphcap.errors import GraphcapError, GraphCaptureError
from graphcap.tiny_models import tiny_model


def capture(fn):
    """Capture ``fn()`` into a new graph; return the graph and what ``fn`` returned."""
    graph = CPUGraph()
    with torch.no_grad(), graph.capture():
        out = fn()
    return graph, out


# ---- memory ---------------------------------------------------------------------------------
def test_capture_leaves_preexisting_memory_unchanged():
    buf = torch.arange(6.0)
    base = torch.zeros(2, 3)
    view = base[:, 1]
    target = torch.full((3,), 7.0)
    src = torch.tensor([1.0, 2.0, 3.0])

    def step():
        buf.add_(1)
        view.fill_(5.0)  # a write through a view of a pre-existing tensor
        target.copy_(src)
        base.t()[0].mul_(3)  # a view of a view

    graph, _ = capture(step)
    assert torch.equal(buf, torch.arange(6.0))
    assert torch.equal(base, torch.zeros(2, 3))
    assert torch.equal(target, torch.full((3,), 7.0))
    graph.replay()
    assert torch.equal(buf, torch.arange(6.0) + 1)
    assert torch.equal(base, torch.tensor([[0.0, 5.0, 0.0], [0.0, 5.0, 0.0]]))
    assert torch.equal(target, src)


def test_out_variant_writes_are_restored_and_replayed():
    a, b, out = torch.ones(3), torch.full((3,), 2.0), torch.zeros(3)
    graph, _ = capture(lambda: torch.add(a, b, out=out))
    assert torch.equal(out, torch.zeros(3))
    graph.replay()
    assert torch.equal(out, torch.full((3,), 3.0))


def test_replay_accumulates_on_the_same_memory():
    buf = torch.zeros(3)
    graph, _ = capture(lambda: buf.add_(1))
    for _ in range(5):
        graph.replay()
    assert torch.equal(buf, torch.full((3,), 5.0))


def test_tensors_allocated_in_capture_are_poisoned_until_first_replay():
    x = torch.arange(4.0)

    def step():
        return (x * 2, (x > 1).to(torch.int64), x > 1, torch.zeros(2))

    graph, (f, i, b, z) = capture(step)
    assert torch.isnan(f).all() and torch.isnan(z).all()
    assert (i != 0).all() and (i != 1).all()  # garbage, neither of the values computed
    graph.replay()
    assert torch.equal(f, x * 2)
    assert torch.equal(i, torch.tensor([0, 0, 1, 1]))
    assert torch.equal(b, torch.tensor([False, False, True, True]))
    assert torch.equal(z, torch.zeros(2))


# ---- host values and inputs -----------------------------------------------------------------
def test_python_int_is_frozen_at_capture():
    x = torch.zeros(2)
    state = {"step": 3}
    graph, y = capture(lambda: x + state["step"])
    state["step"] = 10  # a host counter the Python loop advances; replay never sees it
    graph.replay()
    assert torch.equal(y, torch.full((2,), 3.0))


def test_input_updated_in_place_is_seen_by_replay():
    x = torch.ones(3)
    graph, y = capture(lambda: x * 2)
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    graph.replay()
    assert torch.equal(y, torch.tensor([2.0, 4.0, 6.0]))


def test_rebound_input_is_not_seen_by_replay():
    inputs = {"x": torch.ones(3)}
    graph, y = capture(lambda: inputs["x"] * 2)
    inputs["x"] = torch.full((3,), 9.0)  # a new Python object: the graph still reads the old one
    graph.replay()
    assert torch.equal(y, torch.full((3,), 2.0))


def test_may_alias_ops_copy_or_view_as_at_capture():
    x = torch.arange(6.0).reshape(2, 3)

    def step():
        view = x.reshape(6)  # a true view: keeps aliasing x
        copy = x.t().contiguous()  # a copy: must be recomputed into the recorded output
        cast = x.to(torch.float64)  # a copy too
        same = x.to(torch.float32)  # no-op `to`: x itself
        return view, copy, cast, same

    graph, (view, copy, cast, same) = capture(step)
    x.copy_(torch.arange(6.0).reshape(2, 3) * 10)
    graph.replay()
    assert torch.equal(view, x.reshape(6)) and view.data_ptr() == x.data_ptr()
    assert torch.equal(copy, x.t().contiguous())
    assert torch.equal(cast, x.double())
    assert same is x
    assert graph.num_ops == 2  # the copies run, the views do not


def test_in_place_metadata_ops_run_once_at_capture():
    x = torch.arange(3.0)
    buf = torch.zeros(3)

    def step():
        x.unsqueeze_(0)  # host-side metadata: a device graph never replays it
        buf.add_(x.squeeze(0))

    graph, _ = capture(step)
    assert x.shape == (1, 3)
    graph.replay()
    graph.replay()
    assert x.shape == (1, 3)
    assert torch.equal(buf, 2 * torch.arange(3.0))


def test_storage_changing_ops_are_refused():
    x = torch.zeros(3)
    with pytest.raises(GraphCaptureError, match="resize_"):
        capture(lambda: x.resize_(6))
    assert x.shape == (3,)
    with pytest.raises(GraphCaptureError, match="set_"):
        capture(lambda: x.set_(torch.zeros(2)))
    graph, _ = capture(lambda: x.resize_(3).add_(1))  # a same-size resize is a no-op
    graph.replay()
    assert torch.equal(x, torch.ones(3))


def test_multi_output_op_writes_every_recorded_output():
    x = torch.tensor([[1.0, 5.0, 3.0], [4.0, 2.0, 6.0]])
    graph, (values, indices) = capture(lambda: torch.max(x, dim=1))
    x.copy_(torch.tensor([[9.0, 0.0, 0.0], [0.0, 0.0, 9.0]]))
    graph.replay()
    assert torch.equal(values, torch.tensor([9.0, 9.0]))
    assert torch.equal(indices, torch.tensor([0, 2]))


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_capture_under_any_autograd_mode_replays(mode):
    weight = torch.nn.Parameter(torch.full((2, 2), 2.0))
    x = torch.ones(1, 2)
    buf = torch.zeros(1, 2)
    contexts = {
        "grad": contextlib.nullcontext,
        "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode,
    }
    graph = CPUGraph()
    with contexts[mode](), graph.capture():
        y = x @ weight
        buf.add_(y)
    with torch.no_grad():
        weight.mul_(3)  # an in-place weight update between replays is seen
    graph.replay()
    assert torch.equal(y, torch.full((1, 2), 12.0))
    assert torch.equal(buf, torch.full((1, 2), 12.0))


# ---- RNG --------------------------------------------------------------------------------------
def test_capture_does_not_advance_the_generator():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    capture(lambda: torch.rand(4))
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("explicit_generator", [False, True])
def test_replays_draw_what_eager_steps_draw(explicit_generator):
    probs = torch.softmax(torch.randn(3, 10), dim=-1)
    gen = torch.Generator().manual_seed(7) if explicit_generator else None

    def step():
        return torch.multinomial(probs, 1, generator=gen), torch.rand(2, generator=gen)

    def seed():
        (gen if explicit_generator else torch.default_generator).manual_seed(7)

    seed()
    eager = [tuple(t.clone() for t in step()) for _ in range(4)]
    seed()
    graph, (tokens, noise) = capture(step)
    replayed = []
    for _ in range(4):
        graph.replay()
        replayed.append((tokens.clone(), noise.clone()))
    for (et, en), (rt, rn) in zip(eager, replayed, strict=True):
        assert torch.equal(et, rt) and torch.equal(en, rn)
    assert not torch.equal(replayed[0][1], replayed[1][1])  # the generator advances on replay


# ---- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "names"),
    [
        (lambda x: x.sum().item(), "_local_scalar_dense"),
        (lambda x: bool(x[0] > 0), "_local_scalar_dense"),
        (lambda x: int(x[0]), "_local_scalar_dense"),
        (lambda x: torch.equal(x, x), "aten.equal"),
        (lambda x: torch.nonzero(x), "aten.nonzero"),
        (lambda x: torch.masked_select(x, x > 0), "aten.masked_select"),
        (lambda x: torch.unique(x), "unique"),
        (lambda x: x[x > 0], "aten.index.Tensor"),
        (lambda x: x.clone().index_put_((x > 0,), x), "aten.index_put_"),
        (lambda x: torch.repeat_interleave(x.long().abs()), "aten.repeat_interleave"),
        # one_hot range-checks its input on the host on every device but CUDA.
        (lambda x: torch.nn.functional.one_hot(x.long().abs(), 4), "_local_scalar_dense"),
        # reads that bypass the dispatcher (no aten op): refused at the Python level
        (lambda x: x.tolist(), r"Tensor\.tolist\(\)"),
        (lambda x: x.numpy(), r"Tensor\.numpy\(\)"),
        (lambda x: np.asarray(x), r"Tensor\.__array__"),
        (lambda x: repr(x), r"Tensor\.__repr__"),
        (lambda x: operator.index(x[0].long()), "_local_scalar_dense"),
        (lambda x: float(x[0]), "_local_scalar_dense"),
    ],
)
def test_host_syncs_are_refused_and_the_backend_stays_usable(body, names):
    x = torch.tensor([1.0, -2.0, 3.0])
    buf = torch.zeros(3)
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    graph = CPUGraph()
    with pytest.raises(GraphCaptureError, match=names), graph.capture():
        buf.add_(1)
        torch.rand(1)
        body(x)
    assert not is_capturing()
    assert torch.equal(buf, torch.zeros(3))
    assert torch.equal(torch.get_rng_state(), rng)
    with pytest.raises(GraphcapError, match="capture failed"):
        graph.replay()
    again, y = capture(lambda: buf + x)
    again.replay()
    assert torch.equal(y, buf + x)


def test_data_dependent_ops_with_static_shapes_are_allowed():
    x = torch.tensor([2.0, 0.0, 1.0])
    idx = torch.tensor([2, 0])

    def step():
        picked = x[idx]
        rep = torch.repeat_interleave(idx, idx, output_size=2)
        return picked, rep

    graph, (picked, rep) = capture(step)
    idx.copy_(torch.tensor([1, 1]))
    graph.replay()
    assert torch.equal(picked, torch.tensor([0.0, 0.0]))
    assert torch.equal(rep, torch.tensor([1, 1]))


def test_swallowed_refusal_still_fails_the_capture():
    x = torch.ones(2)
    graph = CPUGraph()
    # Model code that "handles" the error must not get a silently broken graph.
    with (
        pytest.raises(GraphCaptureError, match="_local_scalar_dense"),
        graph.capture(),
        contextlib.suppress(GraphCaptureError),
    ):
        x.sum().item()


def test_tensor_literal_is_refused_but_scalar_assignment_is_not():
    with pytest.raises(GraphCaptureError, match=r"torch\.tensor"):
        capture(lambda: torch.tensor([1.0, 2.0]))
    with pytest.raises(GraphCaptureError, match=r"torch\.as_tensor"):
        capture(lambda: torch.as_tensor([1.0]))
    x = torch.ones(3)
    with pytest.raises(GraphCaptureError, match=r"new_tensor"):
        capture(lambda: x.new_tensor([1.0]))
    idx = torch.tensor([1])

    def assign():
        y = x.clone()
        y[idx] = 0.0  # a device-side fill on an accelerator, fine in a graph
        return y

    graph, y = capture(assign)
    graph.replay()
    assert torch.equal(y, torch.tensor([1.0, 0.0, 1.0]))


def test_compiled_region_is_refused():
    compiled = torch.compile(lambda t: t * 2 + 1, backend="eager")
    x = torch.ones(3)
    compiled(x)  # warmed up before capture, as a rollout engine would
    buf = torch.zeros(3)
    graph = CPUGraph()
    with pytest.raises(GraphCaptureError, match=r"torch\.compile"), graph.capture():
        buf.add_(1)
        compiled(x)
    assert torch.equal(buf, torch.zeros(3))
    assert torch.equal(compiled(x), x * 2 + 1)  # dynamo still works after the refusal
    fresh = torch.compile(lambda t: t - 1, backend="eager")  # first called inside capture
    with pytest.raises(GraphCaptureError, match=r"torch\.compile"):
        capture(lambda: fresh(x))
    assert torch.equal(fresh(x), x - 1)
    disabled = torch.compiler.disable(lambda t: t * 3)
    graph, y = capture(lambda: disabled(x))  # a compiler-disabled region is plain eager code
    graph.replay()
    assert torch.equal(y, x * 3)


# ---- lifecycle --------------------------------------------------------------------------------
def test_replay_without_capture_and_recapture_rules():
    graph = CPUGraph()
    with pytest.raises(GraphcapError, match="holds no capture"):
        graph.replay()
    x = torch.ones(2)
    with graph.capture():
        y = x + 1
    with pytest.raises(GraphCaptureError, match="reset"), graph.capture():
        pass
    graph.reset()
    with pytest.raises(GraphcapError, match="holds no capture"):
        graph.replay()
    with graph.capture():
        z = x * 3
    graph.replay()
    assert torch.equal(z, torch.full((2,), 3.0)) and torch.isnan(y).all()


def test_failed_body_exception_propagates_and_graph_is_unusable():
    buf = torch.zeros(2)
    graph = CPUGraph()
    with pytest.raises(ValueError, match="boom"), graph.capture():
        buf.add_(1)
        raise ValueError("boom")
    assert torch.equal(buf, torch.zeros(2)) and not is_capturing()
    with pytest.raises(GraphcapError, match="boom"):
        graph.replay()


def test_is_capturing_only_inside_and_per_thread():
    seen = {}

    def other_thread():
        seen["other"] = is_capturing()

    assert not is_capturing()
    with CPUGraph().capture():
        seen["inside"] = is_capturing()
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        with pytest.raises(GraphCaptureError, match="nested"), CPUGraph().capture():
            pass
    assert seen == {"inside": True, "other": False}
    assert not is_capturing()


def test_backend_api_round_trip():
    backend = CPUBackend()
    assert backend.capabilities.graph_capture
    x = torch.ones(2)
    graph = backend.create_graph()
    assert not backend.is_current_stream_capturing()
    with backend.capture_to_graph(graph):
        assert backend.is_current_stream_capturing()
        y = x * 4
    assert not backend.is_current_stream_capturing()
    x.fill_(2.0)
    backend.replay_graph(graph)
    assert torch.equal(y, torch.full((2,), 8.0))


# ---- transformers models ----------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_transformers_forward_replays_new_inputs(family):
    model = tiny_model(family)
    torch.manual_seed(0)
    batch, length = 2, 8
    input_ids = torch.randint(0, 128, (batch, length))
    # A 4-D additive mask and explicit positions: transformers' own mask construction reads
    # tensors on the host (packed-sequence detection, the SDPA is_causal shortcut).
    causal = torch.full((length, length), float("-inf")).triu(1)
    mask = causal[None, None].expand(batch, 1, length, length).contiguous()
    positions = torch.arange(length).expand(batch, length).contiguous()

    def forward():
        return model(input_ids, attention_mask=mask, position_ids=positions, use_cache=False).logits

    graph, logits = capture(forward)
    assert torch.isnan(logits).all()
    for _ in range(2):
        new_ids = torch.randint(0, 128, (batch, length))
        input_ids.copy_(new_ids)
        graph.replay()
        with torch.no_grad():
            expected = model(new_ids, attention_mask=mask, position_ids=positions, use_cache=False)
        torch.testing.assert_close(logits, expected.logits, rtol=0, atol=0)


def test_transformers_own_mask_creation_is_a_host_sync():
    model = tiny_model("llama")
    torch.manual_seed(0)
    input_ids = torch.randint(0, 128, (1, 4))
    with pytest.raises(GraphCaptureError, match="_local_scalar_dense"):
        capture(lambda: model(input_ids, use_cache=False))


def test_static_cache_decode_step_replays_token_identical_to_eager():
    from transformers import StaticCache

    model = tiny_model("llama")
    torch.manual_seed(0)
    batch, cache_len, prompt_len, steps = 2, 16, 5, 6
    prompt = torch.randint(0, 128, (batch, prompt_len))
    slots = torch.arange(cache_len).view(1, 1, 1, cache_len)

    def run(use_graph):
        cache = StaticCache(config=model.config, max_cache_len=cache_len)
        prefill_mask = torch.full((prompt_len, cache_len), float("-inf")).triu(1)
        with torch.no_grad():
            logits = model(
                prompt,
                attention_mask=prefill_mask.expand(batch, 1, -1, -1),
                position_ids=torch.arange(prompt_len).expand(batch, -1),
                past_key_values=cache,
            ).logits
        ids = logits[:, -1:].argmax(-1)
        positions = torch.full((batch, 1), prompt_len)

        def step():
            # Mask and positions come from device buffers the step advances itself.
            visible = slots <= positions.view(-1, 1, 1, 1)
            mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
            out = model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
            ids.copy_(out.logits[:, -1:].argmax(-1))
            positions.add_(1)
            return out.logits

        tokens, all_logits = [], []
        if use_graph:
            graph, logits = capture(step)
            for _ in range(steps):
                graph.replay()
                tokens.append(ids.clone())
                all_logits.append(logits.clone())
        else:
            with torch.no_grad():
                for _ in range(steps):
                    all_logits.append(step().clone())
                    tokens.append(ids.clone())
        return torch.cat(tokens, dim=1), torch.stack(all_logits)

    eager_tokens, eager_logits = run(use_graph=False)
    graph_tokens, graph_logits = run(use_graph=True)
    assert torch.equal(graph_tokens, eager_tokens)
    torch.testing.assert_close(graph_logits, eager_logits, rtol=0, atol=0)


def test_replay_under_an_ambient_autocast_replays_the_captured_casts():
    weight = torch.randn(8, 8)
    x = torch.randn(4, 8)
    out = torch.zeros(4, 8)
    graph = CPUGraph()
    with graph.capture():
        out.copy_(x @ weight)  # captured in float32: no cast recorded
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph.replay()  # a device graph ignores the ambient autocast; so must this
    assert torch.equal(out, x @ weight)
