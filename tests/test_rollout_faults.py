"""No graphcap state is left half-changed by an exception at any point of a call: an
allocation failing (out of memory), a Ctrl-C, a capture step failing. The call raises (or, for
a failed capture, finishes eagerly as documented); the next call of the same shape is correct.

The sweep raises at the Nth allocation of a first call (every one in turn: the prefill, the
buffers, the block pools' growth, the warm-up, the capture, the replays) and at the Nth call of
each capture step of the backend."""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
import threading

import pytest
import torch
from rollout_models import prompts, tiny_model

from graphcap import kv_blocks
from graphcap.cpu.torch_internals import TorchDispatchMode
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.rollout.cache import LayerSpec
from graphcap.rollout.cache import blocks as blocks_module
from graphcap.rollout.cache.blocks import SINK_BLOCK, BlockKVCache

#: aten operators that allocate a new tensor (the factories; every other op's output is an
#: allocation too, but these are where graphcap's own buffers come from)
ALLOCATING = frozenset(
    {
        "empty",
        "empty_strided",
        "zeros",
        "ones",
        "full",
        "arange",
        "scalar_tensor",
        "clone",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
    }
)
#: Backend methods a capture and its replays go through.
CAPTURE_STEPS = ("create_graph", "graph_pool_handle", "capture_to_graph", "replay_graph")


class FailAt(TorchDispatchMode):
    """Raise ``error`` at the ``at``-th allocating operator (counting from 0)."""

    def __init__(self, at: int, error: BaseException):
        super().__init__()
        self.at, self.error, self.seen = at, error, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ALLOCATING:
            self.seen += 1
            if self.seen - 1 == self.at:
                raise self.error
        return func(*args, **(kwargs or {}))


LAYOUTS = {"static": None, "blocks": 4}
SAMPLING = SamplingParams(max_new_tokens=5, do_sample=True, temperature=0.8, seed=3)


def engine(layout: str) -> RolloutEngine:
    return RolloutEngine(
        tiny_model("llama"),
        RolloutConfig(enable_graph_capture=True, kv_block_size=LAYOUTS[layout]),
    )


@functools.cache
def expected(layout: str) -> tuple[torch.Tensor, int]:
    """The call's tokens (graph, equal to eager) and the allocations its first call makes."""
    ids, mask = prompts(2, width=5)
    eager = RolloutEngine(tiny_model("llama"), RolloutConfig(enable_graph_capture=False))
    reference = eager.generate(ids, mask, SAMPLING).sequences
    counting = FailAt(-1, RuntimeError())
    with counting:
        graph = engine(layout).generate(ids, mask, SAMPLING)
    assert graph.stats.path == "static_graph" and torch.equal(graph.sequences, reference)
    return reference, counting.seen


def check_next_calls(e: RolloutEngine, reference: torch.Tensor) -> None:
    ids, mask = prompts(2, width=5)
    for _ in range(2):
        assert torch.equal(e.generate(ids, mask, SAMPLING).sequences, reference)


#: Allocations swept per layout, in chunks of CHUNK (more than a first call makes: checked)
SWEPT, CHUNK = 600, 50
ERRORS = (torch.OutOfMemoryError("injected: out of memory"), KeyboardInterrupt())


def test_the_sweep_covers_every_allocation():
    for layout in LAYOUTS:
        assert 0 < expected(layout)[1] <= SWEPT, (layout, expected(layout)[1])


def fail_once(e: RolloutEngine, layout: str, failing) -> None:
    """Run the call with ``failing`` in effect: it raises, or finishes (a failed capture
    finishes eagerly, with the tokens an eager run gives)."""
    ids, mask = prompts(2, width=5)
    try:
        with failing:
            result = e.generate(ids, mask, SAMPLING)
    except (torch.OutOfMemoryError, KeyboardInterrupt, RuntimeError):
        return
    assert torch.equal(result.sequences, expected(layout)[0])


@pytest.mark.filterwarnings("ignore::graphcap.errors.CaptureFallbackWarning")
@pytest.mark.parametrize("start", range(0, SWEPT, CHUNK))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_failure_at_any_allocation_leaves_the_next_call_correct(layout, start):
    reference, allocations = expected(layout)
    for at in range(start, min(start + CHUNK, allocations)):
        e = engine(layout)
        fail_once(e, layout, FailAt(at, ERRORS[at % 2]))
        try:
            check_next_calls(e, reference)
        except Exception as exc:
            raise AssertionError(f"after a failure at allocation {at}: {exc}") from exc


class FailingStep:
    """Make the backend's ``method`` raise ``error`` at its ``nth`` call (counting from 0)."""

    def __init__(self, backend, method: str, nth: int, error: BaseException):
        self.backend, self.method, self.nth, self.error = backend, method, nth, error

    def __enter__(self):
        own, calls = getattr(self.backend, self.method), [0]

        def failing(*args, **kwargs):
            calls[0] += 1
            if calls[0] - 1 == self.nth:
                raise self.error
            return own(*args, **kwargs)

        setattr(self.backend, self.method, failing)
        return self

    def __exit__(self, *exc):
        delattr(self.backend, self.method)


@pytest.mark.filterwarnings("ignore::graphcap.errors.CaptureFallbackWarning")
@pytest.mark.parametrize("error", ERRORS, ids=["oom", "interrupt"])
@pytest.mark.parametrize("nth", [0, 1, 3])
@pytest.mark.parametrize("method", CAPTURE_STEPS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_failure_at_any_capture_step_leaves_the_next_call_correct(layout, method, nth, error):
    reference, _ = expected(layout)
    e = engine(layout)
    fail_once(e, layout, FailingStep(e.backend, method, nth, error))
    check_next_calls(e, reference)


def test_a_failed_block_pool_growth_is_undone_and_the_next_call_grows_again():
    """The issue's repro: the third pool allocation of a growth fails (layer 0 grown, layer 1
    not); every later call raised a shape mismatch deep in the growth, and later the rollback
    kept views of the grown pools, holding more than ``nbytes`` said. On the continuous path,
    whose pools grow as slots are refilled (the static path's pool is sized for its bucket)."""
    e = RolloutEngine(
        tiny_model("llama"),
        RolloutConfig(
            enable_graph_capture=True, continuous_batch_size=2, kv_block_size=LAYOUTS["blocks"]
        ),
    )
    reference, _ = expected("blocks")
    ids, mask = prompts(2, width=5)
    new_zeros, calls = torch.Tensor.new_zeros, [0]

    def failing(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise torch.OutOfMemoryError("injected")
        return new_zeros(self, *args, **kwargs)

    torch.Tensor.new_zeros = failing
    try:
        with pytest.raises(torch.OutOfMemoryError):
            e.generate(ids, mask, SAMPLING)
    finally:
        torch.Tensor.new_zeros = new_zeros
    # the grown pool was freed, not kept behind a view of its first blocks (6x its size here)
    cache = e.step.cache
    pools = [pool for layer in cache.layers for pool in (layer.keys, layer.values)]
    held = sum(pool.untyped_storage().nbytes() for pool in pools)
    assert held == sum(pool.numel() * pool.element_size() for pool in pools)
    assert held <= cache.nbytes()
    check_next_calls(e, reference)


class InterruptAt:
    """Raise ``KeyboardInterrupt`` at the ``at``-th statement (line event, counting from 0)
    that code of ``module`` runs, its nested functions included: every point a Ctrl-C can
    land between two statements."""

    def __init__(self, module, at: int):
        self.filename, self.at, self.seen = module.__file__, at, 0

    def __enter__(self):
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)

    def _call(self, frame, event, arg):
        return self._line if frame.f_code.co_filename == self.filename else None

    def _line(self, frame, event, arg):
        if event == "line":
            self.seen += 1
            if self.seen - 1 == self.at:
                self.line = frame.f_lineno
                raise KeyboardInterrupt
        return self._line


def small_cache() -> BlockKVCache:
    """Three rows of four 2-column blocks, a pool of five blocks: the steps below grow it."""
    spec = LayerSpec(2, 4, 4, torch.float32, torch.float32, torch.device("cpu"))
    return BlockKVCache([spec, spec], 3, 8, 2)


#: Every host-side step of the allocator, in an order that reaches each branch: blocks handed
#: out, a growth, rows freed, rows swapped (the ladder), blocks reused, the per-call reset.
ALLOCATOR_STEPS = (
    lambda c: c.assign([1, None, 3], ahead=0),
    lambda c: c.assign([7, 7, 7], ahead=0, before_growth=lambda: None),
    lambda c: c.free_rows([1]),
    lambda c: c.move_rows(torch.tensor([1]), torch.tensor([2])),
    lambda c: c.assign([None, 5, None], ahead=2),
    lambda c: c.free_rows(range(3)),
    lambda c: c.assign([3, 3, 3], ahead=0),
    lambda c: c.reset(),
)


def allocator_state(cache: BlockKVCache):
    return (
        cache.owned,
        cache.table.tolist(),
        cache.lengths.tolist(),
        cache.write_pos.tolist(),
    )


def assert_consistent(cache: BlockKVCache) -> None:
    """Every block is free or held by one row, once; the table says what the rows hold; every
    pool has the same blocks and holds no more memory than its shape (``nbytes`` is true)."""
    held = [block for blocks in cache.owned for block in blocks]
    assert sorted(held + list(cache.free)) == list(range(2, cache.num_blocks)), cache.book
    for row, blocks in enumerate(cache.owned):
        entries = cache.table[row].tolist()
        expected = list(blocks) or [SINK_BLOCK]
        assert entries[: len(expected)] == expected and not any(entries[len(expected) :])
    for layer in cache.layers:
        for pool in (layer.keys, layer.values):
            assert pool.shape[0] == cache.num_blocks
            assert pool.untyped_storage().nbytes() == pool.numel() * pool.element_size()


def test_an_interrupt_at_any_statement_of_the_block_allocator_leaves_it_consistent():
    """The issue's repro: ``free_rows`` put a row's blocks on the free list and only then
    cleared the row's ownership, so a Ctrl-C between the two handed one block to two rows
    later; ``assign`` lost blocks taken off the free list. Now each step is all or nothing:
    interrupted at any statement, the allocator is as before the step or as after it (or only
    grown), consistent, and the remaining steps run as they would have."""
    reference = small_cache()
    states = [allocator_state(reference)]
    for step in ALLOCATOR_STEPS:
        step(reference)
        assert_consistent(reference)
        states.append(allocator_state(reference))
    assert reference.growths >= 1
    for index, step in enumerate(ALLOCATOR_STEPS):
        at = 0
        while True:
            cache = small_cache()
            for earlier in ALLOCATOR_STEPS[:index]:
                earlier(cache)
            try:
                with InterruptAt(blocks_module, at) as interrupt:
                    step(cache)
            except KeyboardInterrupt:
                where = f"step {index}, statement {at}"
                assert_consistent(cache)
                assert allocator_state(cache) in states[index : index + 2], where
                step(cache)  # the caller tries again
            else:
                assert interrupt.seen <= at
                break
            assert_consistent(cache)
            for later in ALLOCATOR_STEPS[index + 1 :]:
                later(cache)
            assert allocator_state(cache) == states[-1], where
            at += 1
        assert at > 5  # every statement of the step was a point


@pytest.mark.filterwarnings("ignore::graphcap.errors.CaptureFallbackWarning")
def test_a_call_interrupted_inside_the_block_allocator_leaves_the_next_calls_correct():
    """End to end, on the continuous path (blocks handed out, slots retired and refilled, the
    pools grown): a Ctrl-C at every fifth statement of the allocator in turn, then a call
    without one; each must return the tokens of an engine never interrupted."""
    ids, mask = prompts(3, width=5)
    config = RolloutConfig(
        enable_graph_capture=True, continuous_batch_size=2, kv_block_size=LAYOUTS["blocks"]
    )
    reference = RolloutEngine(tiny_model("llama"), config).generate(ids, mask, SAMPLING)
    e = RolloutEngine(tiny_model("llama"), config)
    for at in range(0, 10**6, 5):
        try:
            with InterruptAt(blocks_module, at) as interrupt:
                e.generate(ids, mask, SAMPLING)
        except KeyboardInterrupt:
            again = e.generate(ids, mask, SAMPLING)
            assert torch.equal(again.sequences, reference.sequences), f"statement {at}"
        else:
            assert interrupt.seen <= at and at > 100
            break


def test_an_interrupt_never_leaves_a_block_view_set():
    """``reading_blocks`` set the view before its ``try``: a Ctrl-C landing there left every
    later forward of the thread reading pools through a stale table. Interrupted at any
    statement, no view is left set; the one exception is the restore itself, the first
    statement of the ``finally``, where CPython checks for a signal only after the restoring
    call has returned. Each attempt runs in a context of its own."""
    view = kv_blocks.BlockView(torch.zeros((1, 1), dtype=torch.int32), torch.ones(1), 2)
    source, first = inspect.getsourcelines(kv_blocks.reading_blocks)
    restore = first + next(i for i, line in enumerate(source) if "finally" in line) + 1

    def attempt(at: int) -> tuple[InterruptAt, bool]:
        try:
            with InterruptAt(kv_blocks, at) as interrupt, kv_blocks.reading_blocks(view):
                assert kv_blocks.current() is view
        except KeyboardInterrupt:
            pass
        return interrupt, kv_blocks.current() is not None

    for at in range(20):
        interrupt, left_set = contextvars.Context().run(attempt, at)
        assert not left_set or getattr(interrupt, "line", None) == restore, f"statement {at}"
        if interrupt.seen <= at:
            break
    assert at > 3


def test_a_generate_nested_in_a_forward_hook_is_refused_and_never_hangs():
    """A forward hook calling ``engine.generate`` on the engine already running waited for
    the engine's lock, held by its own thread, forever. It is refused with a clear error;
    the outer call and later calls run as usual."""
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(2, width=5)
    e = RolloutEngine(model, RolloutConfig(enable_graph_capture=True))
    refused: list[BaseException | None] = []

    def hook(module, args, output):
        if not refused:  # once, from the outer call's first forward
            refused.append(None)
            try:
                e.generate(ids, mask, SAMPLING)
            except RuntimeError as exc:
                refused[0] = exc

    handle = model.register_forward_hook(hook)
    done: list[object] = []
    worker = threading.Thread(target=lambda: done.append(e.generate(ids, mask, SAMPLING)))
    worker.daemon = True
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "a nested generate() deadlocked"
    assert "inside its own generate()" in str(refused[0])
    handle.remove()
    assert torch.equal(done[0].sequences, expected("static")[0])
    assert torch.equal(e.generate(ids, mask, SAMPLING).sequences, expected("static")[0])
