"""transformers sees graphcap's warm-ups and captures on any backend (not only CUDA's), so a
plain HF forward with a 2-D mask takes its graph-safe mask path and captures on the CPU."""

from __future__ import annotations

import threading

import pytest
import torch
from rollout_models import tiny_model
from transformers.utils import import_utils

from graphcap.cpu import CPUBackend
from graphcap.rollout.holder import capture as capture_module
from graphcap.rollout.holder.capture import capture_step
from graphcap.rollout.holder.tracing import graph_step, in_graph_step, install_capture_detection


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_plain_forward_with_2d_mask_captures_and_replays_like_eager(family: str) -> None:
    model = tiny_model(family)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (3, 7), generator=generator)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :2] = 0
    logits = torch.zeros(3, 7, model.config.vocab_size)

    def step() -> None:
        with torch.no_grad():
            logits.copy_(model(input_ids=ids, attention_mask=mask, use_cache=False).logits)

    backend = CPUBackend()
    graph = capture_step(backend, step, [logits], None)
    for pads in ([0, 0, 3], [4, 1, 0]):
        mask.fill_(1)
        for row, pad in enumerate(pads):
            mask[row, :pad] = 0
        backend.replay_graph(graph)
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        real = mask.bool()  # pad query rows attend to nothing; compare the real ones
        torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=0)


def test_without_the_flag_transformers_reads_the_mask_on_the_host(monkeypatch) -> None:
    """The failure the flag fixes: with graph steps unmarked, the capture refuses a host read."""
    from graphcap.errors import GraphCaptureError

    monkeypatch.setattr(capture_module, "graph_step", _unmarked)
    model = tiny_model("llama")
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 5, dtype=torch.long)
    out = torch.zeros(2, 5, model.config.vocab_size)

    def step() -> None:
        with torch.no_grad():
            out.copy_(model(input_ids=ids, attention_mask=mask, use_cache=False).logits)

    with pytest.raises(GraphCaptureError, match="host synchronisation"):
        capture_step(CPUBackend(), step, [out], None)


def test_flag_is_set_only_inside_a_graph_step_and_only_on_its_thread() -> None:
    assert install_capture_detection()
    assert install_capture_detection()  # idempotent: wrapped once
    check = import_utils.is_cuda_stream_capturing
    assert check.__wrapped__.__name__ == "is_cuda_stream_capturing"
    assert not getattr(check.__wrapped__, "__graphcap_wrapped__", False)
    assert not in_graph_step() and not import_utils.is_tracing()
    seen_elsewhere: list[bool] = []
    with graph_step():
        assert in_graph_step() and import_utils.is_tracing()
        thread = threading.Thread(target=lambda: seen_elsewhere.append(import_utils.is_tracing()))
        thread.start()
        thread.join()
    assert seen_elsewhere == [False]
    assert not in_graph_step() and not import_utils.is_tracing()


def _unmarked():
    import contextlib

    return contextlib.nullcontext()


def test_the_capture_starts_from_the_state_the_warm_up_started_from() -> None:
    """The warm-up's writes are undone before the capture: a backend whose capture runs the step
    (the CPU reference does) computes from the state the first replay will see. Here the step
    writes at a device index that the warm-up moves past the buffer's end."""
    buffer, index = torch.zeros(4), torch.tensor([3])

    def step() -> None:
        buffer.index_fill_(0, index, 1.0)
        index.add_(1)

    backend = CPUBackend()
    graph = capture_step(backend, step, [buffer, index], None)
    assert buffer.tolist() == [0, 0, 0, 0] and index.tolist() == [3]
    backend.replay_graph(graph)
    assert buffer.tolist() == [0, 0, 0, 1] and index.tolist() == [4]
