"""The block KV table (issue 34): block tokens == static-cache tokens == generate(), graph ==
eager, growth between replays, pool growth -> recapture, freed blocks reused zeroed, idle slots,
host lengths == device lengths for backends that take them on the host."""

from __future__ import annotations

import pytest
import torch
from rollout_models import PAD, generate_padded, make_engine, prompts, tiny_model
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from graphcap import kv_blocks
from graphcap.cpu import CPUBackend
from graphcap.rollout import RolloutConfig, SamplingParams
from graphcap.rollout.cache import LayerSpec
from graphcap.rollout.cache.blocks import SINK_BLOCK, BlockKVCache

NEW = 20
LIMITS = [3, 7, 10, 2, 9, 5, 10, 4]


@kv_blocks.reads_kv_blocks
def block_attention(module, query, key, value, attention_mask, **kwargs):
    """A block-aware attention for the tests: reads the pools through the view and closes every
    column at or past ``lengths`` (so lengths too short changes tokens)."""
    view = kv_blocks.current()
    assert key.shape[0] != query.shape[0] or key.shape[2] == view.block_size  # pools, not rows
    keys, values = kv_blocks.gather(key, view), kv_blocks.gather(value, view)
    columns = torch.arange(view.max_len, device=query.device)
    closed = columns[None, :] >= view.lengths[:, None].to(torch.long)
    mask = attention_mask.masked_fill(closed[:, None, None, :], float("-inf"))
    return sdpa_attention_forward(module, query, keys, values, mask, **kwargs)


AttentionInterface.register("graphcap_test_blocks", block_attention)


def decode(model, ids, mask, graph, **config):
    engine = make_engine(model, graph, **config)
    return engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW, eos_token_id=[]))


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("batch", [1, 3])
def test_block_tokens_equal_static_cache_and_generate(family, batch):
    model = tiny_model(family)
    ids, mask = prompts(batch)
    expected = generate_padded(
        model, ids, mask, ids.shape[1] + NEW, max_new_tokens=NEW, do_sample=False, eos_token_id=[]
    )
    static = decode(model, ids, mask, True, kv_block_size=None)
    assert static.stats.kv_layout == "static"
    for graph in (False, True):
        blocks = decode(model, ids, mask, graph, kv_block_size=4)
        assert blocks.stats.kv_layout == "blocks"
        assert torch.equal(blocks.sequences, static.sequences)
        assert torch.equal(blocks.sequences, expected)
    assert blocks.stats.path == "static_graph"


def test_auto_follows_the_backend_and_block_aware_attention_reads_pools():
    model = tiny_model("llama")
    ids, mask = prompts(3)
    static = decode(model, ids, mask, True, kv_block_size=None)
    auto = decode(model, ids, mask, True)
    assert auto.stats.kv_layout == "blocks"  # the CPU backend declares a block size
    assert CPUBackend().capabilities.kv_block_size == CPUBackend.kv_block_size
    aware = decode(model, ids, mask, True, kv_block_size=4, graph_attention="graphcap_test_blocks")
    assert aware.stats.attention == "graphcap_test_blocks"
    assert torch.equal(aware.sequences, static.sequences)


def test_each_length_bucket_is_one_graph_its_pool_sized_for_the_bucket():
    """The static path's pool holds every row's whole table from the start: prompts of new
    widths in one length bucket (rows crossing into new blocks) never grow it or recapture."""
    model = tiny_model("llama")
    engine = make_engine(model, True, kv_block_size=4, eos_check_interval=2, length_buckets=(64,))
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=[])
    for width in (3, 6, 11, 17):
        ids, mask = prompts(3, width=width, seed=width)
        result = engine.generate(ids, mask, params)
        static = decode(model, ids, mask, False, kv_block_size=None)
        assert torch.equal(result.sequences, static.sequences)
        assert result.stats.kv_pool_growths == 0 and result.stats.recapture_reason == []
        assert result.stats.kv_blocks_held == 3 * -(-(width + NEW - 1) // 4)  # last not written
    assert engine.captures == 1 and engine.cache.num_blocks == 3 * 64 // 4 + 2


@pytest.mark.parametrize("ladder", [None, "auto"], ids=["slots", "ladder"])
def test_pool_growth_between_replays_recaptures_with_the_reason(ladder):
    """Slots hold requests of any length, so the continuous path's pool follows the tokens
    held: it grows between replays, dropping the graph first, with the reason (at the slot
    count, and on the live-row ladder, whose runner hands blocks out itself)."""
    model = tiny_model("llama")
    ids, mask = prompts(3)
    engine = make_engine(
        model,
        True,
        kv_block_size=2,
        eos_check_interval=2,
        continuous_batch_size=2,
        batch_ladder=ladder,
    )
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=[])
    result = engine.generate(ids, mask, params)
    static = decode(model, ids, mask, False, kv_block_size=None)
    assert torch.equal(result.sequences, static.sequences)
    assert result.stats.kv_pool_growths >= 2
    assert any(r.startswith("kv_pool_blocks") for r in result.stats.recapture_reason)
    assert len(result.stats.batch_steps) == (2 if ladder else 0)
    again = engine.generate(ids, mask, params)  # the pool is large enough now: no capture
    assert again.stats.recapture_reason == [] and not again.stats.captured
    assert torch.equal(again.sequences, static.sequences)


def test_a_growth_after_a_move_down_the_ladder_replays_over_the_new_pools():
    """The pool grows after the busy slots moved to a smaller size: that size's step is taken
    again over the new pools and recaptured (the old view would write the pools replaced)."""
    model = tiny_model("llama")
    ids, mask = prompts(3)
    params = SamplingParams(max_new_tokens=40, eos_token_id=[])
    limits = [40, 2, 3]  # two short requests leave one slot busy for most of the call
    engine = make_engine(
        model, True, kv_block_size=2, eos_check_interval=2, continuous_batch_size=3
    )
    result = engine.generate(ids, mask, params, request_max_new_tokens=limits)
    eager = make_engine(model, False, kv_block_size=None, continuous_batch_size=3)
    reference = eager.generate(ids, mask, params, request_max_new_tokens=limits)
    assert torch.equal(result.sequences, reference.sequences)
    assert result.stats.batch_steps[1] > 30 and result.stats.kv_pool_growths >= 1
    # the smallest size was captured, then again after the growth dropped the graphs
    assert result.stats.capture_reasons.index("batch_ladder size 1 first reached") < 3
    assert len(result.stats.capture_reasons) == 4


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_continuous_blocks_graph_equals_eager_and_static_with_refills(family):
    model = tiny_model(family)
    ids, mask = prompts(len(LIMITS))
    params = SamplingParams(max_new_tokens=10, eos_token_id=[])
    out = {}
    for graph, size in [(False, None), (False, 4), (True, 4)]:
        engine = make_engine(
            model, graph, continuous_batch_size=3, eos_check_interval=2, kv_block_size=size
        )
        out[graph, size] = engine.generate(ids, mask, params, request_max_new_tokens=LIMITS)
    reference = out[False, None].sequences
    for key in [(False, 4), (True, 4)]:
        assert torch.equal(out[key].sequences, reference), key
        assert out[key].stats.kv_layout == "blocks" and out[key].stats.slots_refilled > 0
    assert out[True, 4].stats.path == "continuous_graph"


def test_idle_slots_hold_no_blocks_and_read_one_column():
    model = tiny_model("llama")
    ids, mask = prompts(2)
    # exact lengths: a padded row would hand out blocks further ahead
    engine = make_engine(model, True, continuous_batch_size=4, kv_block_size=4, length_buckets=None)
    params = SamplingParams(max_new_tokens=8, eos_token_id=[])
    result = engine.generate(ids, mask, params)
    static = make_engine(model, False, continuous_batch_size=4, kv_block_size=None)
    assert torch.equal(result.sequences, static.generate(ids, mask, params).sequences)
    # two busy rows of 6 + 8 columns in 4-blocks; the two idle slots hold none
    assert result.stats.kv_blocks_held == 2 * 4
    cache = engine.step.cache  # every slot retired: all blocks free, rows on the sink block
    assert cache.blocks_held == 0 and (cache.table[:, 0] == SINK_BLOCK).all()
    assert not cache.table[:, 1:].any() and (cache.lengths == 1).all()


def _cache(batch=3, max_len=8, block=2):
    spec = LayerSpec(2, 4, 4, torch.float32, torch.float32, torch.device("cpu"))
    return BlockKVCache([spec, spec], batch, max_len, block)


def test_freed_blocks_are_handed_out_again_zeroed():
    cache = _cache()
    assert cache.assign([1, None, 3], ahead=0) == 1 + 2
    assert cache.table[1].tolist() == [SINK_BLOCK, 0, 0, 0]  # idle row: the sink block only
    freed = list(cache.owned[2])
    for layer in cache.layers:
        layer.keys.fill_(float("nan"))
        layer.values.fill_(float("nan"))
    cache.free_rows([2])
    assert cache.table[2].tolist() == [SINK_BLOCK, 0, 0, 0] and cache.lengths[2] == 1
    cache.assign([None, 3, None], ahead=0)
    assert set(cache.owned[1]) == set(freed)
    for layer in cache.layers:
        assert torch.all(layer.keys[freed] == 0) and torch.all(layer.values[freed] == 0)


def test_the_pool_grows_when_the_free_list_runs_dry_after_dropping_the_graph():
    cache = _cache()
    calls = []
    old = cache.layers[0].keys
    cache.assign([7, 7, 7], ahead=0, before_growth=lambda: calls.append(cache.num_blocks))
    assert calls == [5] and cache.growths == 1 and cache.num_blocks >= 2 + 12
    assert cache.layers[0].keys is not old and cache.blocks_held == 12


def test_growth_stops_at_every_rows_whole_table():
    """Doubling would overshoot the static cache's size (seen on the H200: 1.36x its bytes at 16
    slots); the pool never holds more than every row's whole table plus the reserved blocks."""
    cache = _cache(batch=4, max_len=16, block=2)  # 4 rows of 8 entries: 32 blocks at most
    for column in range(16):  # rows grow a column a step: the pool doubles 6 -> 12 -> 24 -> ...
        cache.assign([column] * 4, ahead=0)
    assert cache.blocks_held == 32 and cache.num_blocks == 32 + 2  # not 48
    static = 2 * 2 * 4 * 2 * 16 * 4 * 4  # layers, K and V, rows, heads, columns, dim, bytes
    assert cache.nbytes() < 1.1 * static


def test_the_pool_holds_the_blocks_every_rows_length_spans_idle_rows_one_each():
    """Page attention refuses a pool smaller than the blocks the rows' lengths span (an idle
    row, at length 1 on the shared sink block, one). Two live rows of eight take the free list
    to its end; the pool grows before the six idle rows' blocks would be missing from it."""
    cache = _cache(batch=8, max_len=32, block=2)
    live = [0, 1]
    for column in range(32):
        columns = [column if row in live else None for row in range(8)]
        cache.assign(columns, ahead=0)
        spanned = sum(1 if c is None else c // 2 + 1 for c in columns)
        assert cache.num_blocks >= spanned, (column, cache.num_blocks, spanned)
    assert cache.growths >= 1


def test_bad_block_sizes_are_refused():
    for bad in (0, -4, "blocks", 2.5, True):
        with pytest.raises((ValueError, TypeError), match="kv_block_size"):
            RolloutConfig(kv_block_size=bad)
    with pytest.raises(ValueError, match="whole number"):
        _cache(max_len=7)
    with pytest.raises(ValueError, match="kv_block_size 5000 is over 4096"):
        RolloutConfig(kv_block_size=5000)


class HostLengths(CPUBackend):
    """A CPU backend whose block-aware kernel takes per-row lengths as host values."""

    graph_kv_lengths_on_host = True

    def __init__(self):
        super().__init__()
        self.pending: list[int] | None = None
        self.checked = 0

    def update_graph_kv_lengths(self, graph, lengths):
        self.pending = list(lengths)

    def replay_graph(self, graph):
        assert self.pending is not None, "replayed without update_graph_kv_lengths"
        super().replay_graph(graph)
        assert VIEWS[-1].lengths.tolist() == self.pending
        self.pending = None
        self.checked += 1


VIEWS: list[kv_blocks.BlockView] = []


@kv_blocks.reads_kv_blocks
def recording_attention(module, query, key, value, attention_mask, **kwargs):
    VIEWS.append(kv_blocks.current())
    return block_attention(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("graphcap_test_recording", recording_attention)


@pytest.mark.parametrize("continuous", [None, 3])
def test_host_lengths_equal_device_lengths_at_every_replay(continuous):
    model = tiny_model("llama")
    ids, mask = prompts(len(LIMITS))
    backend = HostLengths()
    assert backend.capabilities.graph_kv_lengths_on_host
    engine = make_engine(
        model,
        True,
        backend=backend,
        kv_block_size=4,
        continuous_batch_size=continuous,
        eos_check_interval=2,
        graph_attention="graphcap_test_recording",
    )
    params = SamplingParams(max_new_tokens=10, eos_token_id=[])
    limits = LIMITS if continuous else None
    result = engine.generate(ids, mask, params, request_max_new_tokens=limits)
    assert result.stats.replays > 0 and backend.checked == result.stats.replays
    ref = make_engine(model, False, continuous_batch_size=continuous, kv_block_size=None)
    assert torch.equal(
        result.sequences, ref.generate(ids, mask, params, request_max_new_tokens=limits).sequences
    )


def test_the_base_backend_refuses_host_lengths_unless_declared():
    with pytest.raises(Exception, match="graph_kv_lengths_on_host"):
        CPUBackend().update_graph_kv_lengths(object(), [1])


def test_eager_layout_modes_keep_the_static_cache():
    model = tiny_model("llama")
    ids, mask = prompts(3)
    engine = make_engine(model, False, continuous_batch_size=2, trim_cache=True, kv_block_size=4)
    result = engine.generate(ids, mask, SamplingParams(max_new_tokens=6, eos_token_id=[]))
    assert result.stats.kv_layout == "static"
    assert (result.sequences[:, ids.shape[1] :] != PAD).any()


@kv_blocks.reads_kv_blocks
def table_ignoring_attention(module, query, key, value, attention_mask, **kwargs):
    """Planted bug: reads the pools as if row b held blocks b * n + 1 ... (ignores the table)."""
    view = kv_blocks.current()
    batch, blocks = view.table.shape
    ordered = torch.arange(1, 1 + batch * blocks, device=view.table.device, dtype=torch.int32)
    wrong = kv_blocks.BlockView(ordered.view(batch, blocks), view.lengths, view.block_size)
    keys, values = kv_blocks.gather(key, wrong), kv_blocks.gather(value, wrong)
    return sdpa_attention_forward(module, query, keys, values, attention_mask, **kwargs)


AttentionInterface.register("graphcap_test_table_ignoring", table_ignoring_attention)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_check_passes_block_attention_and_catches_planted_bugs(dtype):
    from graphcap.testing.conformance.test_half_precision import check_attention

    check_attention(CPUBackend(), "graphcap_test_blocks", dtype)
    check_attention(HostLengths(), "graphcap_test_recording", dtype)
    with pytest.raises(AssertionError, match="eager: relative error"):
        check_attention(CPUBackend(), "graphcap_test_table_ignoring", dtype)
