"""Plant known bugs one at a time and check that the tests meant to catch each one fail.

    python tests/mutants.py            # every plant (a few minutes on 2 cores)
    python tests/mutants.py NAME ...   # only these

Each plant replaces one exact snippet of the source (the run fails loudly if the snippet is gone,
so the list cannot rot silently), runs the tests named for it, and restores the file. A plant
whose tests still pass is a hole in the suite. Not part of CI (each plant is a pytest run);
docs/testing.md lists the plants and when to run this.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The tests import the tree's graphcap, graphcap_cuda and graphcap_npu, not the installed copies
#: (the plugins are installed without -e), so plants in any of them are seen.
SOURCES = os.environ | {
    "PYTHONPATH": os.pathsep.join(
        str(ROOT / part) for part in ("", "backends/cuda", "backends/npu")
    )
}


@dataclass(frozen=True)
class Plant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


NORM_FORMS = (
    "backends/cuda/tests/test_epilogues.py::test_norm_and_sum_prologues_equal_transformers_norms"
)

KV_BLOCKS = "tests/test_kv_blocks.py"
RECORDS_PER_CALL = (
    "tests/test_rollout_scores.py"
    "::test_a_call_without_records_after_one_with_them_runs_as_if_none_ever_did"
)
ALLOCATOR_SWEEP = (
    "tests/test_rollout_faults.py"
    "::test_an_interrupt_at_any_statement_of_the_block_allocator_leaves_it_consistent"
)
DROP_IN_COPIES = (
    "tests/test_drop_in.py::"
    "test_a_deep_copy_generates_with_its_own_weights_and_its_restore_leaves_the_original"
)
DROP_IN_PICKLES = (
    "tests/test_drop_in.py::test_an_accelerated_model_pickles_saves_and_loads_with_plain_generate"
)
TRAINING_LOOP = "tests/test_training_loop.py"
WAKE_SHORT = (
    "tests/test_rollout_sleep.py::test_a_wake_without_the_memory_to_map_refuses_and_stays_asleep"
)
NPU_ENGINE = "backends/npu/tests/test_npu_engine.py"
NPU_RULES = "backends/npu/tests/test_npu_hardware_rules.py"

SETTINGS = "tests/test_drop_in_settings.py"
SHARDED = "tests/test_sharded_trainers.py"
CACHE = "tests/test_compile_cache.py"
NUMERICS = "tests/test_rollout_numerics.py"
LADDER = "tests/test_rollout_ladder.py"
SAMPLER_KERNEL = "backends/cuda/tests/test_sampler_kernel.py"
PER_CALL_SHAPES = (
    "tests/test_rollout_sampling.py::"
    "test_greedy_first_then_sampling_captures_each_shape_once_then_never"
)
CONTINUOUS_LADDER = "tests/test_rollout_continuous_ladder.py"

HOOKED_COMPILE = (
    "tests/test_compile_default.py::test_a_hooked_model_is_captured_uncompiled_with_the_reason"
)

ROUND_BY_HAND = "tests/test_bench.py::test_round_inputs_lengths_and_limit_by_hand"

EXACT = "tests/test_trainer_exact.py"
EXACT_PATHS = EXACT + "::test_rollout_logprobs_equal_the_trainers_bit_for_bit"
EXACT_ROW = EXACT + "::test_a_rows_logprobs_do_not_depend_on_its_batch_padding_samples_or_path"
EXACT_DROP_IN = (
    EXACT + "::test_the_drop_in_serves_trainer_exact_calls_and_hands_generate_the_same_forward"
)
EXACT_CHECKPOINT = (
    EXACT + "::test_gradient_checkpointed_layers_recompute_the_exact_forward_in_backward"
)
TRL_EXACT = (
    "tests/test_trl_grpo_exact.py::test_trls_recomputed_logprobs_equal_the_rollouts_bit_for_bit"
)
EXACT_KERNELS = "backends/cuda/tests/test_exact_kernels.py"
EXACT_KERNEL_SPLITS = (
    EXACT_KERNELS + "::test_a_product_sums_its_splits_in_one_order_whoever_computes_them"
)
EXACT_KERNEL_ROWS = (
    EXACT_KERNELS + "::test_a_rows_product_is_the_same_bits_whatever_the_number_of_rows"
)
EXACT_KERNEL_PADDING = (
    EXACT_KERNELS + "::test_attention_matches_softmax_attention_and_ignores_padding_and_companions"
)
EXACT_KERNEL_REDUCTIONS = EXACT_KERNELS + "::test_rms_norm_and_log_softmax_are_row_kernels"
EXACT_KERNEL_DECODE = (
    EXACT_KERNELS
    + "::test_a_decode_query_reading_a_cache_equals_the_same_position_in_the_full_forward"
)
EXACT_KERNEL_GRADIENTS = EXACT_KERNELS + "::test_gradients_agree_with_torchs"
EXACT_KERNEL_SHARED_MASK = (
    EXACT_KERNELS + "::test_a_forwards_layers_share_one_analysis_of_their_mask"
)
EXACT_PER_FORWARD = (
    EXACT + "::test_per_forward_keeps_a_value_for_its_objects_until_the_forward_ends"
)
EXACT_KERNEL_ENGINE = (
    EXACT_KERNELS + "::test_the_engines_logprobs_equal_the_trainers_on_these_kernels"
)
DROP_IN_EAGER = "tests/test_drop_in_faults.py"
WEIGHT_PAIRS = (
    "tests/test_rollout_units.py::test_load_weights_in_place_takes_vllms_name_tensor_pairs"
)

PLANTS = (
    Plant(
        "a sleep that keeps moved weights' storage says nothing",
        "graphcap/rollout/engine.py",
        "if not still_held or self._warned_held:",
        "if True:",
        (
            "tests/test_training_loop.py::"
            "test_a_sleep_that_keeps_moved_weights_storage_says_so_once_and_how_to_avoid_it",
        ),
    ),
    Plant(
        "a first call's ladder captures counted in decode_s too",
        "graphcap/rollout/paths/static.py",
        "decode_s = time.perf_counter() - t_decode - (record.capture_s - captured_s)",
        "decode_s = time.perf_counter() - t_decode",
        (
            "tests/test_rollout_ladder.py::"
            "test_captures_taken_mid_decode_count_once_in_the_calls_seconds",
        ),
    ),
    Plant(
        "the compile cache shares one file between sampler shapes",
        "graphcap/rollout/holder/holder.py",
        '"sampler": self.sampler.describe(),',
        '"sampler": None,',
        ("tests/test_compile_cache.py::test_each_sampler_shape_compiles_into_its_own_file",),
    ),
    Plant(
        "trainer-exact attention sums its keys in an order that follows the row's length",
        "graphcap/exact_ops.py",
        "return x.cumsum(dim).select(dim, -1)",
        "return x.sum(dim)",
        (EXACT_PATHS,),
    ),
    Plant(
        "trainer-exact products take as many rows as they are given (the kernel follows M)",
        "graphcap/exact_ops.py",
        "pad = -count % ROW_TILE",
        "pad = 0",
        (EXACT_ROW,),
    ),
    Plant(
        "trainer-exact SiLU is torch's, whose vectorised loop rounds its tail differently",
        "graphcap/exact_ops.py",
        "return x / (1 + torch.exp(-x))",
        "return F.silu(x)",
        (EXACT_PATHS,),
    ),
    Plant(
        "the trainer's forward counts left padding as positions",
        "graphcap/rollout/exact.py",
        'given.get("position_ids") is None',
        'given.get("position_ids") is None and False',
        (EXACT_PATHS,),
    ),
    Plant(
        "the drop-in hands exact calls to generate with the model's own forward",
        "graphcap/rollout/drop_in.py",
        "if self.engine.config.trainer_exact:  # generate's forwards",
        "if False:  # generate's forwards",
        (EXACT_DROP_IN,),
    ),
    Plant(
        "a checkpointed layer recomputes the model's own forward in backward",
        "graphcap/rollout/exact.py",
        'checkpoint = vars(module).get("_gradient_checkpointing_func")',
        "checkpoint = None",
        (EXACT_CHECKPOINT,),
    ),
    Plant(
        "TRL's exact log-probs forget the trainer's temperature",
        "graphcap/rollout/trl_exact.py",
        "dist = logprob_distribution(logits, temperature)",
        "dist = logprob_distribution(logits)",
        (TRL_EXACT,),
    ),
    Plant(
        "TRL's log-prob forward runs the model's own forward, not the exact one",
        "graphcap/rollout/trl_exact.py",
        "with trainer_exact(model):  # re-enters",
        "with contextlib.nullcontext():  # re-enters",
        (TRL_EXACT,),
    ),
    Plant(
        "the CUDA exact product takes a tile from the number of rows (one row sums K in 32s)",
        "backends/cuda/graphcap_cuda/kernels/exact.py",
        "block_m, block_n, block_k, warps, stages = LARGE_LINEAR_BLOCKS if large else"
        " LINEAR_BLOCKS",
        "block_m, block_n, block_k, warps, stages = (LARGE_LINEAR_BLOCKS if large else"
        " LINEAR_BLOCKS) if count > 1 else (64,) * 2 + (32, 4, 3)",
        (EXACT_KERNEL_ROWS,),
    ),
    Plant(
        "the step builds no drawn-from distribution for sampling-mode log-probs",
        "graphcap/rollout/sampling.py",
        'or any(p.return_logprobs and p.logprobs_mode == "sampling" for p in rows),',
        'or any(p.return_logprobs and p.logprobs_mode == "drawn" for p in rows),',
        ("tests/test_rollout_sampling.py::test_logprob_modes_match_teacher_forced_recomputation",),
    ),
    Plant(
        "the CUDA exact product summing its splits in turn ends each split a block early",
        "backends/cuda/graphcap_cuda/kernels/exact.py",
        "if (block % per_split == per_split - 1) | (block == last):",
        "if (block % per_split == per_split - 2) | (block == last):",
        (EXACT_KERNEL_SPLITS,),
    ),
    Plant(
        "the CUDA exact product's last split to arrive adds the splits in reverse",
        "backends/cuda/graphcap_cuda/kernels/exact.py",
        "total += tl.load(part_ptr + s * plane + cell, mask=inside, other=0.0)",
        "total += tl.load(part_ptr + (SPLITS - 1 - s) * plane + cell, mask=inside, other=0.0)",
        (EXACT_KERNEL_SPLITS,),
    ),
    Plant(
        "the CUDA exact attention's key blocks start at column 0, not at the row's position 0",
        "backends/cuda/graphcap_cuda/kernels/exact.py",
        "origin = (top - position).clamp(min=0)",
        "origin = torch.zeros_like(top)",
        (EXACT_KERNEL_PADDING,),
    ),
    Plant(
        "the CUDA exact decode attention gives every head of a group the group's first query",
        "backends/cuda/graphcap_cuda/kernels/exact.py",
        "h = (kv * groups + lane)[:, None]",
        "h = (kv * groups + 0 * lane)[:, None]",
        (EXACT_KERNEL_DECODE,),
    ),
    Plant(
        "the CUDA exact attention's backward lets a query of no keys send gradients",
        "backends/cuda/graphcap_cuda/kernels/exact.py",
        "grad = grad.masked_fill(~has_keys[..., None], 0.0)",
        "grad = grad.clone()",
        (EXACT_KERNEL_GRADIENTS,),
    ),
    Plant(
        "per_forward keeps a value for any objects with the same details",
        "graphcap/exact_ops.py",
        "key = (*(id(o) for o in objects), details)",
        "key = details",
        (EXACT_PER_FORWARD,),
    ),
    Plant(
        "per_forward's memo outlives the forward",
        "graphcap/exact_ops.py",
        "        _FORWARD_MEMO.reset(token)",
        "        pass",
        (EXACT_PER_FORWARD,),
    ),
    Plant(
        "the CUDA exact attention derives its mask's analysis once a layer",
        "backends/cuda/graphcap_cuda/kernels/exact.py",
        "allowed, origin, reach = per_forward(",
        "allowed, origin, reach = (lambda objects, details, compute: compute())(",
        (EXACT_KERNEL_SHARED_MASK,),
    ),
    Plant(
        "the CUDA exact log_softmax reads a lone row in other chunks",
        "backends/cuda/graphcap_cuda/kernels/exact.py",
        "block = SOFTMAX_BLOCK  # by column only",
        "block = SOFTMAX_BLOCK if count > 1 else 1024  # by column only",
        (EXACT_KERNEL_REDUCTIONS,),
    ),
    Plant(
        "the rollout records torch's log_softmax, not the backend's exact one",
        "graphcap/rollout/sampling.py",
        "return row_log_softmax(source)",
        "return torch.log_softmax(source, dim=-1)",
        (EXACT_KERNEL_ENGINE,),
    ),
    Plant(
        "the drop-in serves calls the engine runs eagerly",
        "graphcap/rollout/drop_in.py",
        "require_graph=True,",
        "require_graph=False,",
        (DROP_IN_EAGER,),
    ),
    Plant(
        "the drop-in's question forgets a failed capture",
        "graphcap/rollout/engine.py",
        "disabled = self._holder.disabled_reason",
        "disabled = None",
        (DROP_IN_EAGER + "::test_after_a_failed_capture_calls_go_to_generate",),
    ),
    Plant(
        "load_weights_in_place takes a mapping only",
        "graphcap/rollout/weights.py",
        "enumerate(weights.items() if isinstance(weights, Mapping) else weights)",
        "enumerate(weights.items())",
        (WEIGHT_PAIRS,),
    ),
    Plant(
        "a bad weights entry is printed whole",
        "graphcap/rollout/weights.py",
        "        else type(item).__name__\n",
        "        else repr(item)\n",
        (WEIGHT_PAIRS,),
    ),
    Plant(
        "from_vllm's log-probs default to the post-sampling ones",
        "graphcap/rollout/settings/sampling_params.py",
        'mode = kwargs.pop("logprobs_mode", VLLM_DEFAULT_LOGPROBS_MODE)',
        'mode = kwargs.pop("logprobs_mode", "sampling")',
        (
            "tests/test_rollout_vllm.py::"
            "test_from_vllm_log_probs_are_vllms_raw_ones_by_default_and_map_its_modes",
        ),
    ),
    Plant(
        "the default engine runs eagerly",
        "graphcap/rollout/settings/rollout_config.py",
        "return self.eager_layout is None and backend.capabilities.graph_capture",
        "return False",
        (
            "tests/test_rollout_config.py::"
            "test_the_default_engine_captures_where_the_backend_can_and_eager_calls_say_why",
        ),
    ),
    Plant(
        "an engine with graphs off gives no reason",
        "graphcap/rollout/plan/plan.py",
        "        return GRAPHS_OFF\n",
        "        return None\n",
        (
            "tests/test_rollout_config.py::"
            "test_the_default_engine_captures_where_the_backend_can_and_eager_calls_say_why",
        ),
    ),
    Plant(
        "a repeat call's memory check forgets the cache the engine holds",
        "graphcap/rollout/paths/record.py",
        "shape, held = call.input_ids.shape, holder.held_bytes()",
        "shape, held = call.input_ids.shape, 0",
        (
            "tests/test_rollout_inputs.py::test_the_cache_an_engine_holds_counts_as_available_to_its_next_call",
        ),
    ),
    Plant(
        "the drop-in keeps its buffers when a call is too large and generate takes it",
        "graphcap/rollout/drop_in.py",
        "generate gets the memory the engine held\n                self.engine.sleep()\n",
        "generate gets the memory the engine held\n                pass\n",
        (
            "tests/test_drop_in.py::test_a_call_too_large_for_the_device_frees_the_engines_buffers_for_generate",
        ),
    ),
    Plant(
        "mask not cleared on reuse",
        "graphcap/rollout/cache/masks.py",
        "            self.valid.zero_()\n",
        "            pass\n",
        ("tests/test_rollout_graph.py",),
    ),
    Plant(
        "prefill K/V copied to the first sample row only",
        "graphcap/rollout/paths/static.py",
        "step.cache.load_prefill(prefill.cache, source_rows=sources)",
        "step.cache.load_prefill(prefill.cache, source_rows=sources[:1].expand_as(sources))",
        (
            "tests/test_rollout_equivalence.py::test_num_return_sequences_shares_prefill_and_matches_generate",
        ),
    ),
    Plant(
        "position ids frozen by the graph",
        "graphcap/rollout/step/step.py",
        "        self.state.positions.add_(1)\n",
        "        self.state.positions.copy_(self.state.positions + 0)\n",
        ("tests/test_rollout_equivalence.py::test_greedy_graph_equals_eager_equals_generate",),
    ),
    Plant(
        "write column read as a host int",
        "graphcap/rollout/step/step.py",
        "        column = self.cache.write_pos[:, None]\n",
        "        column = torch.full_like(self.cache.write_pos, int(self.cache.write_pos[0]))"
        "[:, None]\n",
        ("tests/test_rollout_equivalence.py::test_greedy_graph_equals_eager_equals_generate",),
    ),
    Plant(
        "warm-up leaves its trace (no rollback before capture)",
        "graphcap/rollout/holder/capture.py",
        "        warmup_s = time.perf_counter() - start\n        rollback()\n",
        "        warmup_s = time.perf_counter() - start\n",
        (
            "tests/test_capture_detection.py::"
            "test_the_capture_starts_from_the_state_the_warm_up_started_from",
        ),
    ),
    Plant(
        "compile-cache file never loaded",
        "graphcap/rollout/holder/compile_cache.py",
        "        loaded = _load(path)\n",
        "        loaded = None\n",
        (
            "tests/test_compile_cache.py::test_a_compile_writes_the_file_and_the_next_session_loads_it",
        ),
    ),
    Plant(
        "captured steps never compile by default",
        "graphcap/rollout/settings/rollout_config.py",
        "            return self.process_group is None"
        " and backend.capabilities.compile_by_default\n",
        "            return False\n",
        ("tests/test_compile_default.py",),
    ),
    Plant(
        "projections never joined by default",
        "graphcap/rollout/settings/rollout_config.py",
        "            return self.wants_graphs(backend)"
        " and backend.capabilities.fuse_projections_by_default\n",
        "            return False\n",
        (
            "tests/test_rollout_fusion.py::test_the_default_joins_where_the_backend_declares_it_pays",
        ),
    ),
    Plant(
        "capability declared under its API 1 name ignored",
        "graphcap/backend.py",
        "        setattr(cls, new, vars(cls)[old])\n",
        "        pass\n",
        ("tests/test_registry.py::test_plugin_declaring_api_1_capability_names_still_works",),
    ),
    Plant(
        "a doc links a page that is not there",
        "README.md",
        "- [docs/decisions.md](docs/decisions.md):",
        "- [docs/decisions.md](docs/decision-log.md):",
        ("tests/test_repository.py::test_relative_links_in_the_docs_resolve",),
    ),
    Plant(
        "projections joined over another library's flat buffer",
        "graphcap/rollout/plan/fusion.py",
        "if not group.owns_storage() and group.lying_joined() is None",
        "if False",
        (
            "tests/test_rollout_fusion.py::"
            "test_parameters_viewing_another_librarys_buffer_are_joined_only_where_they_lie",
        ),
    ),
    Plant(
        "a group taken as joined where its parts do not follow each other",
        "graphcap/rollout/plan/fusion.py",
        "and part.storage_offset() == offset\n",
        "and part.storage_offset() >= 0\n",
        (
            "tests/test_rollout_fusion.py::"
            "test_parameters_viewing_another_librarys_buffer_are_joined_only_where_they_lie",
        ),
    ),
    Plant(
        "projections joined by default in eager engines",
        "graphcap/rollout/settings/rollout_config.py",
        "            return self.wants_graphs(backend)"
        " and backend.capabilities.fuse_projections_by_default\n",
        "            return backend.capabilities.fuse_projections_by_default\n",
        (
            "tests/test_rollout_fusion.py::test_the_default_joins_where_the_backend_declares_it_pays",
        ),
    ),
    Plant(
        "the plugin's kernels compile with Triton's own ptxas",
        "backends/cuda/graphcap_cuda/kernels/launch.py",
        "    _set_triton_ptxas_path()\n",
        "    pass\n",
        ("backends/cuda/tests/test_cuda_backend.py::test_kernels_compile_with_inductors_ptxas",),
    ),
    Plant(
        "compiled code kept across a host-state change",
        "graphcap/rollout/holder/holder.py",
        "                    torch.compiler.reset()\n",
        "                    pass\n",
        ("tests/test_compile_default.py",),
    ),
    Plant(
        "drop-in output not cut to generate's width",
        "graphcap/rollout/drop_in.py",
        "        sequences = result.sequences[:, : width + int(result.response_lengths.max())]\n",
        "        sequences = result.sequences\n",
        ("tests/test_drop_in.py::test_rows_that_all_stop_early_give_generates_shorter_output",),
    ),
    Plant(
        "drop-in checks for finished rows at the config's interval",
        "graphcap/rollout/drop_in.py",
        "    return dataclasses.replace(config, eos_check_interval=1, batch_buckets=None)\n",
        "    return dataclasses.replace(config, batch_buckets=None)\n",
        ("tests/test_drop_in.py::test_sampled_rows_that_all_end_early_draw_what_generate_draws",),
    ),
    Plant(
        "drop-in pads the batch to the config's bucket",
        "graphcap/rollout/drop_in.py",
        "    return dataclasses.replace(config, eos_check_interval=1, batch_buckets=None)\n",
        "    return dataclasses.replace(config, eos_check_interval=1)\n",
        (
            "tests/test_drop_in.py::test_sampled_rows_that_all_end_early_draw_what_generate_draws"
            "[first-token-buckets]",
        ),
    ),
    Plant(
        "a deep copy of an accelerated model shares the original's generate",
        "graphcap/rollout/drop_in.py",
        "    def __reduce__(self)",
        "    def __deepcopy__(self, memo):\n        return self\n\n    def __reduce__(self)",
        (DROP_IN_COPIES,),
    ),
    Plant(
        "an accelerated model pickles its engine",
        "graphcap/rollout/drop_in.py",
        "    def __reduce__(self)",
        "    def _no_reduce(self)",
        (DROP_IN_PICKLES,),
    ),
    Plant(
        "finished flag not read before the first step",
        "graphcap/rollout/paths/static.py",
        "    if interval == 1 and max_steps and ladder.agreement.all_finished(state.all_finished):",
        "    if False:",
        ("tests/test_drop_in.py::test_sampled_rows_that_all_end_early_draw_what_generate_draws",),
    ),
    Plant(
        "checkpointing hook kept in the host state",
        "graphcap/rollout/plan/fingerprint.py",
        "    live = {h: hook for h, hook in hooks.items() if hook_name(hook) not in INERT_HOOKS}\n",
        "    live = dict(hooks)\n",
        (
            "tests/test_drop_in.py::test_the_checkpointing_hook_left_out_of_the_host_state_still_exists_and_does_nothing",
        ),
    ),
    Plant(
        "scores recorded before the repetition penalty",
        "graphcap/rollout/step/step.py",
        "            processed = torch.where(s.rows.sample[:, None], warped, scores)\n",
        "            processed = torch.where(s.rows.sample[:, None], warped, logits.float())\n",
        ("tests/test_rollout_scores.py::test_scores_match_generate_per_step",),
    ),
    Plant(
        "retired slot's mask row kept",
        "graphcap/rollout/step/slots.py",
        "    step.masks.valid[rows] = False\n",
        "",
        ("tests/test_rollout_continuous.py",),
    ),
    Plant(
        "budget-finished slots wait for the refill check",
        "graphcap/rollout/paths/continuous.py",
        "            if check or self.due(steps):\n",
        "            if check:\n",
        (
            "tests/test_rollout_continuous.py::test_budget_finishes_refill_at_their_step_whatever_the_check_interval",
        ),
    ),
    Plant(
        "queue taken in request order",
        "graphcap/rollout/paths/continuous.py",
        "key=lambda r: -self.limits[r]",
        "key=lambda r: 0",
        (
            "tests/test_rollout_continuous.py::test_budget_finishes_refill_at_their_step_whatever_the_check_interval",
        ),
    ),
    Plant(
        "budget refills read the device flags",
        "graphcap/rollout/paths/continuous.py",
        "self.service(steps, read=check)",
        "self.service(steps, read=True)",
        (
            "tests/test_rollout_continuous.py::test_budget_finishes_refill_at_their_step_whatever_the_check_interval",
        ),
    ),
    Plant(
        "slot retired one step before its budget is used",
        "graphcap/rollout/paths/continuous.py",
        "now + queue.limits[request] - 1",
        "now + queue.limits[request] - 2",
        (
            "tests/test_rollout_continuous.py::test_eos_and_stop_token_rows_retire_at_the_check_graph_equals_eager_equals_alone",
        ),
    ),
    Plant(
        "one attention span for every per-position graph",
        "graphcap/rollout/paths/runners.py",
        "step = self.eager.with_span((0, self.width + position + 1))",
        "step = self.eager.with_span((0, self.width + 1))",
        ("tests/test_rollout_per_position.py",),
    ),
    Plant(
        "strides left out of the signature",
        "graphcap/rollout/plan/scan.py",
        "tuple(t.shape), tuple(t.stride()), t.dtype",
        "tuple(t.shape), (), t.dtype",
        ("tests/test_rollout_stale_state.py",),
    ),
    Plant(
        "model's own attention not restored after capture",
        "graphcap/rollout/holder/holder.py",
        "        model.set_attn_implementation(own)\n",
        "        pass\n",
        ("tests/test_rollout_plan.py",),
    ),
    Plant(
        "rng_in_graph=False ignored",
        "graphcap/rollout/plan/plan.py",
        "    if settings.any_sampled and not caps.rng_in_graph:",
        "    if False:",
        ("tests/test_rollout_plan.py",),
    ),
    Plant(
        "repetition penalty counts left-pad slots",
        "graphcap/rollout/sampling.py",
        "    index = torch.where(written, tokens, vocab)\n",
        "    index = tokens\n",
        ("tests/test_rollout_penalty.py",),
    ),
    Plant(
        "penalty left out of the step",
        "graphcap/rollout/sampling.py",
        "            penalty=self.penalty or any(p.repetition_penalty != 1.0 for p in rows),\n",
        "            penalty=False,\n",
        ("tests/test_rollout_penalty.py",),
    ),
    Plant(
        "min_new_tokens stop block left out of the step",
        "graphcap/rollout/sampling.py",
        "            min_new=self.min_new or any(p.min_new_tokens > 0 for p in rows),\n",
        "            min_new=False,\n",
        ("tests/test_rollout_equivalence.py",),
    ),
    Plant(
        "refilled slot keeps the previous request's settings",
        "graphcap/rollout/paths/continuous.py",
        "        step.configure_rows(\n",
        "        (lambda *args: None)(\n",
        ("tests/test_rollout_penalty.py",),
    ),
    Plant(
        "concurrent calls not serialised",
        "graphcap/rollout/engine.py",
        "        self._lock = threading.Lock()\n",
        "        self._lock = __import__('contextlib').nullcontext()\n",
        (
            "tests/test_rollout_stale_state.py::test_three_threads_on_one_engine_get_correct_results_or_a_clear_error",
        ),
    ),
    Plant(
        "joined projection's later layer returns its slice for any input",
        "graphcap/rollout/plan/fusion.py",
        "                if x is not self._input:\n",
        "                if x is None:\n",
        ("tests/test_rollout_fusion.py",),
    ),
    Plant(
        "replaced parameter storage never joined again",
        "graphcap/rollout/plan/fusion.py",
        "        moved = [group for group in self.groups if not group.joined()]\n",
        "        moved = [group for group in self.groups if group.weight.numel() == 0]\n",
        ("tests/test_rollout_fusion.py",),
    ),
    Plant(
        "non-resident parameters joined",
        "graphcap/rollout/plan/fusion.py",
        "        if scan.non_resident is not None or scan.sharded is not None:\n"
        "            return False\n",
        "",
        ("tests/test_rollout_fusion.py",),
    ),
    Plant(
        "compiled blocks stay compiled after capture",
        "graphcap/rollout/cache/swap.py",
        "                delattr(obj, name)\n",
        "                pass\n",
        ("tests/test_rollout_plan.py",),
    ),
    Plant(
        "compiled captures keep the eager K/V write",
        "graphcap/rollout/plan/regions.py",
        " else cache.puts_through(compiled(put_columns))\n",
        " else contextlib.nullcontext()\n",
        ("tests/test_rollout_plan.py",),
    ),
    Plant(
        "the decoder stack's final norm and rotary embedding not compiled",
        "graphcap/rollout/plan/regions.py",
        "        for parent in stacks\n",
        "        for parent in []\n",
        ("tests/test_rollout_plan.py",),
    ),
    Plant(
        "the attention compiled with its decoder layer",
        "graphcap/rollout/plan/regions.py",
        '(a, "forward", torch.compiler.disable(a.forward))',
        '(a, "forward", a.forward)',
        ("tests/test_rollout_plan.py",),
    ),
    Plant(
        "joined groups left out of the one-row product",
        "graphcap/rollout/plan/regions.py",
        " else fusion.products_through(product)\n",
        " else contextlib.nullcontext()\n",
        ("tests/test_rollout_one_row.py",),
    ),
    Plant(
        "the one-row product used in uncompiled captures",
        "graphcap/rollout/holder/holder.py",
        "        product = self.backend.one_row_product() if compiled else None\n",
        "        product = self.backend.one_row_product()\n",
        ("tests/test_rollout_one_row.py",),
    ),
    Plant(
        "compiled regions ignore the backend's inductor options",
        "graphcap/rollout/plan/regions.py",
        "functools.partial(torch.compile, options=options or None)",
        "functools.partial(torch.compile, options=None)",
        ("tests/test_rollout_plan.py",),
    ),
    Plant(
        "inductor's kernels launched without dependent launch",
        "backends/cuda/graphcap_cuda/backend.py",
        '({"triton.enable_pdl": True} if launch.ENABLED else {})',
        "{}",
        ("backends/cuda/tests/test_cuda_backend.py",),
    ),
    Plant(
        "a capture leaves its BLAS library set after it",
        "backends/cuda/graphcap_cuda/backend.py",
        "    finally:\n        torch.backends.cuda.preferred_blas_library(before)\n",
        "    finally:\n        pass\n",
        ("backends/cuda/tests/test_cuda_backend.py",),
    ),
    Plant(
        "plain captures run under the backend's compiled-capture settings",
        "graphcap/rollout/holder/holder.py",
        "            if compiled:\n                state = ",
        "            stack.enter_context(self.backend.compiled_capture_context())\n"
        "            if compiled:\n                state = ",
        ("tests/test_rollout_plan.py",),
    ),
    Plant(
        "split-KV blocks sized in columns whatever the head size",
        "backends/cuda/graphcap_cuda/kernels/split_kv.py",
        "max(16, BLOCK_BYTES // block_bytes)",
        "64",
        ("backends/cuda/tests/test_split_kv.py",),
    ),
    Plant(
        "split-KV launches several waves of programs at a few rows",
        "backends/cuda/graphcap_cuda/kernels/split_kv.py",
        "    wanted = PROGRAMS_PER_SM * sms // (rows * kv_heads)\n",
        "    wanted = triton.cdiv(2 * sms, rows * kv_heads)\n",
        ("backends/cuda/tests/test_split_kv.py::test_launch_is_one_wave_of_programs",),
    ),
    Plant(
        "functions held as module attributes left out of the host state",
        "graphcap/rollout/plan/fingerprint.py",
        "    if kind in _CALLABLES or issubclass(kind, type):\n",
        "    if False:\n",
        (
            "tests/test_rollout_stale_state.py::test_instance_forward_wrapped_after_capture_recaptures",
            "tests/test_rollout_stale_state.py::test_function_attribute_swapped_after_capture_recaptures",
        ),
    ),
    Plant(
        "each module's class left out of the host state",
        "graphcap/rollout/plan/fingerprint.py",
        "        (path, type(module), _hooks(module, keep), _attributes(module, keep))\n",
        "        (path, torch.nn.Module, _hooks(module, keep), _attributes(module, keep))\n",
        ("tests/test_rollout_stale_state.py::test_submodule_swapped_for_another_class_recaptures",),
    ),
    Plant(
        "swapped attributes keep their swapped value after the block",
        "graphcap/rollout/cache/swap.py",
        "            else:\n                setattr(obj, name, value)\n",
        "            else:\n                pass\n",
        ("tests/test_rollout_units.py", "tests/test_rollout_one_row.py"),
    ),
    Plant(
        "compiled captures leave the step's own work eager",
        "graphcap/rollout/holder/holder.py",
        "                stack.enter_context(compiled_bookkeeping(step, options))\n",
        "",
        ("tests/test_rollout_plan.py",),
    ),
    Plant(
        "the compiled step's random draws left to inductor's generator",
        "graphcap/rollout/plan/regions.py",
        'BOOKKEEPING_OPTIONS = {"fallback_random": True}',
        'BOOKKEEPING_OPTIONS = {"fallback_random": False}',
        ("tests/test_rollout_plan.py",),
    ),
    Plant(
        "the two-pass argmax drops the columns after the last whole chunk",
        "graphcap/rollout/sampling.py",
        "    if split < vocab:\n",
        "    if False:\n",
        ("tests/test_rollout_units.py",),
    ),
    Plant(
        "the two-pass argmax forgets where each chunk starts",
        "graphcap/rollout/sampling.py",
        "head.indices + starts",
        "head.indices + 0 * starts",
        ("tests/test_rollout_units.py",),
    ),
    Plant(
        "several new K/V columns written to the first one",
        "graphcap/rollout/cache/cache.py",
        "columns = columns + torch.arange(",
        "columns = columns + 0 * torch.arange(",
        ("tests/test_rollout_units.py",),
    ),
    Plant(
        "the gated product reads W's rows as the gate's",
        "backends/cuda/graphcap_cuda/kernels/gemv.py",
        "rows, gate_ptr + n[:, None] * stride_gn)",
        "rows, rows)",
        (
            "backends/cuda/tests/test_epilogues.py::test_gated_and_residual_forms_equal_the_eager_ops",
        ),
    ),
    Plant(
        "the residual added to the unrounded product",
        "backends/cuda/graphcap_cuda/kernels/gemv.py",
        "out = out.to(dtype).to(tl.float32) + residual",
        "out = out + residual",
        (
            "backends/cuda/tests/test_epilogues.py::test_gated_and_residual_forms_equal_the_eager_ops",
        ),
    ),
    Plant(
        "the epilogue pass fuses a product that has another use",
        "backends/cuda/graphcap_cuda/kernels/epilogues.py",
        "    return all(user in inside for node in nodes for user in node.users)",
        "    return True",
        ("backends/cuda/tests/test_epilogues.py",),
    ),
    Plant(
        "the epilogue pass fuses a broadcasting add",
        "backends/cuda/graphcap_cuda/kernels/epilogues.py",
        "        if not _same_static_shape(mine, theirs) or mine.dtype != theirs.dtype:",
        "        if mine.dtype != theirs.dtype:",
        ("backends/cuda/tests/test_epilogues.py",),
    ),
    Plant(
        "the gated product computes SiLU whatever its activation",
        "backends/cuda/graphcap_cuda/kernels/gemv.py",
        "        if ACTIVATION == 0:  # silu",
        "        if True:  # silu",
        (
            "backends/cuda/tests/test_epilogues.py::test_gated_and_residual_forms_equal_the_eager_ops",
        ),
    ),
    Plant(
        "the epilogue pass takes any elementwise function for an activation",
        "backends/cuda/graphcap_cuda/kernels/epilogues.py",
        "if got.shape == want.shape and torch.allclose(got, want, rtol=tol, atol=tol):",
        "if True:",
        ("backends/cuda/tests/test_epilogues.py",),
    ),
    Plant(
        "the product's norm leaves eps out",
        "backends/cuda/graphcap_cuda/kernels/gemv.py",
        "tl.rsqrt(total / k_cols + eps)",
        "tl.rsqrt(total / k_cols)",
        (NORM_FORMS,),
    ),
    Plant(
        "the product computes Gemma's norm as Llama's",
        "backends/cuda/graphcap_cuda/kernels/gemv.py",
        "    if NORM == 1:  # w * (x * rstd).to(dtype)",
        "    if True:  # w * (x * rstd).to(dtype)",
        (NORM_FORMS,),
    ),
    Plant(
        "the product drops the sum before its residual",
        "backends/cuda/graphcap_cuda/kernels/gemv.py",
        "            residual = (residual + other).to(dtype).to(tl.float32)",
        "            residual = residual",
        (NORM_FORMS,),
    ),
    Plant(
        "the epilogue pass moves a sum that something else reads",
        "backends/cuda/graphcap_cuda/kernels/epilogues.py",
        "        args = _arguments(user) if _is(user, GEMV) else {}",
        '        args = _arguments(user) if _is(user, GEMV) else {"residual": source}',
        ("backends/cuda/tests/test_epilogues.py",),
    ),
    Plant(
        "the epilogue pass takes a norm whatever its eps",
        "backends/cuda/graphcap_cuda/kernels/epilogues.py",
        "            want = [define(p, w, eps).float() for p in probes]",
        "            want = [define(p, w, 1e-6).float() for p in probes]",
        ("backends/cuda/tests/test_epilogues.py",),
    ),
    Plant(
        "the norm's sum of squares changes type in its loop (the interpreter runs it)",
        "backends/cuda/graphcap_cuda/kernels/gemv.py",
        "    squares = tl.zeros([BLOCK_K], tl.float32)",
        "    squares = 0.0",
        ("backends/cuda/tests/test_kernels_compile.py",),
    ),
    Plant(
        "the norm's one load reads the first block of the row only",
        "backends/cuda/graphcap_cuda/kernels/gemv.py",
        "tl.arange(0, ROW), k_cols, False, HAS_ADDEND)",
        "tl.arange(0, BLOCK_K), k_cols, False, HAS_ADDEND)",
        (NORM_FORMS,),
    ),
    Plant(
        "the norm is never read in one load",
        "backends/cuda/graphcap_cuda/kernels/gemv.py",
        "    return row if NORM_ONE_LOAD and row <= MAX_NORM_ROW else 0",
        "    return 0",
        ("backends/cuda/tests/test_kernels_compile.py",),
    ),
    Plant(
        "stop sequences match prompt tokens",
        "graphcap/rollout/step/step.py",
        "        ours = self.response.gather(1, index) & inside\n",
        "        ours = inside\n",
        ("tests/test_rollout_vllm.py",),
    ),
    Plant(
        "a stop sequence ends a row before min_new_tokens",
        "graphcap/rollout/step/step.py",
        "        hit = hits.any(-1) & allowed\n",
        "        hit = hits.any(-1)\n",
        ("tests/test_rollout_vllm.py",),
    ),
    Plant(
        "a module's forward hook does not turn compiling off",
        "graphcap/rollout/plan/fingerprint.py",
        'return next((path or "<root>" for path, _, hooks, _ in self.modules if hooks), None)',
        "return None",
        (HOOKED_COMPILE,),
    ),
    Plant(
        "a global module hook does not turn compiling off",
        "graphcap/rollout/plan/fingerprint.py",
        "        if any(self.global_hooks):\n",
        "        if False:\n",
        (HOOKED_COMPILE,),
    ),
    Plant(
        "a vLLM seed offset by the prompt's batch position",
        "graphcap/rollout/settings/call.py",
        "        if call.seed is None or call.per_request_seed:\n",
        "        if call.seed is None:\n",
        ("tests/test_rollout_vllm.py::test_a_vllm_seed_is_its_requests_own_at_any_batch_position",),
    ),
    Plant(
        "vLLM names refused at values that ask for nothing",
        "graphcap/rollout/settings/vocabulary.py",
        "value == off for off in VLLM_UNSUPPORTED[name])\n",
        "value == off for off in ())\n",
        (
            "tests/test_rollout_vllm.py::"
            "test_vllm_names_at_values_that_ask_for_nothing_are_accepted",
        ),
    ),
    Plant(
        "the block table is not grown between steps",
        "graphcap/rollout/paths/runners.py",
        "            grow_blocks(self.holder, self.full, live, self.ahead, self.record)\n",
        "            pass\n",
        (KV_BLOCKS + "::test_pool_growth_between_replays_recaptures_with_the_reason",),
    ),
    Plant(
        "the ladder's step keeps reading the pools a growth replaced",
        "graphcap/rollout/paths/runners.py",
        "            self.step = self.full.leading(self.size)  # views of the new pools\n",
        "            pass\n",
        (KV_BLOCKS + "::test_a_growth_after_a_move_down_the_ladder_replays_over_the_new_pools",),
    ),
    Plant(
        "a graph the pools' growth dropped is replayed",
        "graphcap/rollout/paths/runners.py",
        "        self.graph = None\n        if self.size < self.batch:",
        "        if self.size < self.batch:",
        (KV_BLOCKS + "::test_pool_growth_between_replays_recaptures_with_the_reason",),
    ),
    Plant(
        "the static path's block pool sized to the first call",
        "graphcap/rollout/step/step.py",
        "    pool_for_bucket: ClassVar[bool] = True\n",
        "    pool_for_bucket: ClassVar[bool] = False\n",
        (
            KV_BLOCKS + "::test_each_length_bucket_is_one_graph_its_pool_sized_for_the_bucket",
            "tests/test_drop_in.py::test_prompts_of_new_widths_reuse_the_graph_of_their_length_bucket",
        ),
    ),
    Plant(
        "freed blocks are handed out again unzeroed",
        "graphcap/rollout/cache/blocks.py",
        "                layer.keys[picked] = 0\n                layer.values[picked] = 0\n",
        "                pass\n",
        (KV_BLOCKS + "::test_freed_blocks_are_handed_out_again_zeroed",),
    ),
    Plant(
        "the step does not update the block table's lengths",
        "graphcap/rollout/step/step.py",
        "        self.cache.set_lengths(self.furthest())\n",
        "        pass\n",
        (KV_BLOCKS + "::test_auto_follows_the_backend_and_block_aware_attention_reads_pools",),
    ),
    Plant(
        "block pools grow only for the rows' own blocks, not the idle rows' share of the sum",
        "graphcap/rollout/cache/blocks.py",
        "        spare = max(columns.count(None) - _RESERVED, 0)",
        "        spare = 0",
        (
            KV_BLOCKS
            + "::test_the_pool_holds_the_blocks_every_rows_length_spans_idle_rows_one_each",
        ),
    ),
    Plant(
        "block pools keep doubling past every row's whole table",
        "graphcap/rollout/cache/blocks.py",
        "self.batch_size * self.table.shape[1] + _RESERVED)\n",
        "10**9)\n",
        (KV_BLOCKS + "::test_growth_stops_at_every_rows_whole_table",),
    ),
    Plant(
        "NPU page attention not recorded for update (its lengths frozen at the placeholders)",
        "backends/npu/graphcap_npu/attention.py",
        "    with graph_updates.updatable():  # the one call each replay's update re-issues\n",
        "    with torch.no_grad():\n",
        (
            NPU_ENGINE
            + "::test_paged_static_graph_reads_the_table_with_lengths_set_before_each_replay",
        ),
    ),
    Plant(
        "NPU captures whole steps with auto_dispatch_capture (replays wait for no update)",
        "backends/npu/graphcap_npu/backend.py",
        "    graph_kv_lengths_on_host: ClassVar[bool] = True\n",
        "    graph_kv_lengths_on_host: ClassVar[bool] = True\n"
        '    graph_options: ClassVar[dict[str, Any]] = {"auto_dispatch_capture": True}\n',
        (NPU_ENGINE + "::test_static_graph_through_the_plugin_attention_equals_eager_sdpa",),
    ),
    Plant(
        "NPU replays a graph waiting for an update without one",
        "backends/npu/graphcap_npu/backend.py",
        "        graph_updates.check_replay(graph)\n",
        "",
        (
            "backends/npu/tests/test_npu_backend.py"
            + "::test_kv_lengths_reach_the_recorded_kernel_through_graph_update",
        ),
    ),
    Plant(
        "NPU lengths never reach the captured graph",
        "backends/npu/graphcap_npu/backend.py",
        '        graph.update(cpu_update_input=[{"actual_seq_lengths_kv": list(lengths)}])\n',
        "        pass\n",
        (NPU_ENGINE + "::test_half_precision_conformance_check_passes_every_npu_attention",),
    ),
    Plant(
        "NPU eager steps pass page attention the placeholder lengths",
        "backends/npu/graphcap_npu/attention.py",
        "        lengths = view.lengths.tolist()  # a host read: eager steps only\n",
        "        lengths = [view.max_len] * batch\n",
        (
            NPU_ENGINE
            + "::test_paged_static_graph_reads_the_table_with_lengths_set_before_each_replay",
        ),
    ),
    Plant(
        "NPU page attention reads a gather instead of the pools",
        "backends/npu/graphcap_npu/attention.py",
        "    if view is not None and _pages(view, query, attention_mask, dropout, kwargs):\n",
        "    if False:\n",
        (
            NPU_ENGINE
            + "::test_paged_static_graph_reads_the_table_with_lengths_set_before_each_replay",
        ),
    ),
    Plant(
        "NPU explicit generator never registered with the graph",
        "backends/npu/graphcap_npu/generators.py",
        "    graph.register_generator_state(generator)\n",
        "    pass\n",
        (NPU_RULES + "::test_sampling_from_an_explicit_generator_is_captured",),
    ),
    Plant(
        "NPU registers generators where torch_npu made it a deprecated no-op",
        "backends/npu/graphcap_npu/generators.py",
        "    if per_capture_state():\n        return\n    graph.register_generator_state",
        "    graph.register_generator_state",
        (NPU_RULES + "::test_sampling_from_an_explicit_generator_is_captured",),
    ),
    Plant(
        "NPU failed capture leaves the generators in capture mode (torch_npu 2.11)",
        "backends/npu/graphcap_npu/backend.py",
        "                generators.recover(self.device_module, graph, self.device)\n",
        "                pass\n",
        (NPU_RULES + "::test_after_a_failed_sampled_capture_every_generator_draws",),
    ),
    Plant(
        "NPU backend hands out a memory region, so sleeps claim to keep the graphs",
        "backends/npu/graphcap_npu/backend.py",
        '"Sleep and memory regions")."""\n        return None\n',
        '"Sleep and memory regions")."""\n'
        "        from graphcap.cpu.region import ReferenceRegion\n\n"
        "        return ReferenceRegion()\n",
        (NPU_ENGINE + "::test_a_sleep_frees_and_the_next_round_captures_again",),
    ),
    Plant(
        "NPU capture placeholders need every row's whole table",
        "backends/npu/graphcap_npu/attention.py",
        "        lengths = [PLACEHOLDER_LENGTH] * batch\n",
        "        lengths = [view.max_len] * batch\n",
        (
            NPU_RULES
            + "::test_paged_graph_with_rows_of_several_blocks_is_captured_and_equals_eager",
        ),
    ),
    Plant(
        "NPU pools beyond int32 range reach the kernel",
        "backends/npu/graphcap_npu/attention.py",
        "    check_pool_size(key)\n",
        "",
        (NPU_RULES + "::test_pools_beyond_int32_range_are_refused_with_the_way_out",),
    ),
    Plant(
        "NPU graph updates not ordered after the replays before them",
        "backends/npu/graphcap_npu/backend.py",
        "        self.synchronize()\n        graph.update(",
        "        graph.update(",
        (NPU_RULES + "::test_continuous_retire_and_refill_inside_one_check_interval",),
    ),
    Plant(
        "NPU torch_npu below the version floor taken as available",
        "backends/npu/graphcap_npu/backend.py",
        "    if too_old is not None:\n        return Availability(False, too_old)\n",
        "",
        (NPU_RULES + "::test_torch_npu_older_than_the_floor_makes_the_backend_unavailable",),
    ),
    Plant(
        "NPU TASK_QUEUE_ENABLE=2 not detected",
        "backends/npu/graphcap_npu/backend.py",
        'if os.environ.get(TASK_QUEUE_VAR, "").strip() == "2":',
        "if False:",
        (NPU_RULES + "::test_task_queue_2_is_named_and_the_call_runs_eagerly",),
    ),
    Plant(
        "a round's limit counts rows at the step they ended",
        "graphcap/bench/models.py",
        "if n > s]",
        "if n >= s]",
        (ROUND_BY_HAND,),
    ),
    Plant(
        "a round's useful tokens stop before the EOS",
        "graphcap/bench/run.py",
        "ended.int().argmax(1) + 1",
        "ended.int().argmax(1)",
        (ROUND_BY_HAND,),
    ),
    Plant(
        "round modes draw from different generator states",
        "graphcap/bench/modes.py",
        "            torch.manual_seed(work.seed)\n"
        "            work.backend.manual_seed(work.seed)\n",
        "            pass\n",
        ("tests/test_bench.py::test_round_reports_useful_tokens_dead_share_and_limit",),
    ),
    Plant(
        "a continuous call's ladder captures counted in capture and decode",
        "graphcap/rollout/paths/continuous.py",
        "decode_s = time.perf_counter() - t_decode - (record.capture_s - captured_s)",
        "decode_s = time.perf_counter() - t_decode",
        (
            "tests/test_rollout_ladder.py::"
            "test_captures_taken_mid_decode_count_once_in_the_calls_seconds[continuous]",
        ),
    ),
    Plant(
        "the drop-in serves generation settings left on model.config",
        "graphcap/rollout/settings/generate_call.py",
        "    if generation_config is None and legacy:",
        "    if False:",
        (SETTINGS + "::test_every_generation_field_is_served_as_generate_or_handed_to_it",),
    ),
    Plant(
        "empty lists and token id 0 read as unset GenerationConfig values",
        "graphcap/rollout/settings/vocabulary.py",
        "        default is None and value is False",
        "        default is None and not value",
        (SETTINGS + "::test_every_generation_field_is_served_as_generate_or_handed_to_it",),
    ),
    Plant(
        "use_model_defaults swallowed as a neutral generate() argument",
        "graphcap/rollout/drop_in.py",
        '    "tokenizer",\n',
        '    "tokenizer",\n    "use_model_defaults",\n',
        (SETTINGS + "::test_use_model_defaults_goes_to_generate",),
    ),
    Plant(
        "the drop-in serves a model training with dropout",
        "graphcap/rollout/drop_in.py",
        "        if dropout:\n",
        "        if False:\n",
        ("tests/test_drop_in_faults.py::test_a_model_training_with_dropout_goes_to_generate",),
    ),
    Plant(
        "a nested generate() waits on the drop-in's lock (deadlock)",
        "graphcap/rollout/drop_in.py",
        "        if self._serving == threading.get_ident():",
        "        if False:",
        (
            "tests/test_drop_in_faults.py"
            "::test_a_generate_nested_in_a_forward_hook_falls_back_and_never_hangs",
        ),
    ),
    Plant(
        "a failed block-pool growth leaves layers of two sizes",
        "graphcap/rollout/cache/blocks.py",
        "if getattr(layer, name).shape[0] != old:",
        "if False:",
        (
            "tests/test_rollout_faults.py"
            "::test_a_failed_block_pool_growth_is_undone_and_the_next_call_grows_again",
        ),
    ),
    Plant(
        "a failed block-pool growth keeps views of the grown pools",
        "graphcap/rollout/cache/blocks.py",
        "setattr(layer, name, getattr(layer, name)[:old].clone())",
        "setattr(layer, name, getattr(layer, name)[:old])",
        (
            "tests/test_rollout_faults.py"
            "::test_a_failed_block_pool_growth_is_undone_and_the_next_call_grows_again",
        ),
    ),
    Plant(
        "an interrupted block-allocator step keeps its device writes",
        "graphcap/rollout/cache/blocks.py",
        "                tensor[rows] = saved\n",
        "                pass\n",
        (ALLOCATOR_SWEEP,),
    ),
    Plant(
        "the allocator frees a row's blocks before the row lets them go",
        "graphcap/rollout/cache/blocks.py",
        "        self._commit(replace(self.book, free=tuple(free), owned=tuple(owned)), "
        "*self._idle(rows))",
        "        self.book = replace(self.book, free=tuple(free))\n"
        "        self._commit(replace(self.book, owned=tuple(owned)), *self._idle(rows))",
        (ALLOCATOR_SWEEP,),
    ),
    Plant(
        "the allocator takes blocks off the free list before handing them out",
        "graphcap/rollout/cache/blocks.py",
        "        device = self.table.device\n        picked =",
        "        self.book = replace(book, free=book.free[:-count])\n"
        "        device = self.table.device\n        picked =",
        (ALLOCATOR_SWEEP,),
    ),
    Plant(
        "a block view is set before its try (an interrupt leaves it set)",
        "graphcap/kv_blocks.py",
        "    outer = _CURRENT.get()\n    try:\n        _CURRENT.set(view)\n",
        "    outer = _CURRENT.get()\n    _CURRENT.set(view)\n    try:\n",
        ("tests/test_rollout_faults.py::test_an_interrupt_never_leaves_a_block_view_set",),
    ),
    Plant(
        "a call's records widen the sampler for every later call",
        "graphcap/rollout/sampling.py",
        "        record_scores = any(p.output_scores for p in rows)",
        "        record_scores = self.record_scores or any(p.output_scores for p in rows)",
        (RECORDS_PER_CALL,),
    ),
    Plant(
        "both records allocated when one was asked for",
        "graphcap/rollout/step/step.py",
        "        if logits:\n",
        "        if logits or scores:\n",
        (RECORDS_PER_CALL,),
    ),
    Plant(
        "the memory check forgets the records a call asks for",
        "graphcap/rollout/plan/inputs.py",
        "shards, block_size, len(records)",
        "shards, block_size, 0",
        (
            "tests/test_rollout_inputs.py"
            "::test_the_records_a_call_asks_for_count_in_the_request_limit",
            "tests/test_drop_in.py::test_a_call_whose_records_do_not_fit_goes_to_generate",
        ),
    ),
    Plant(
        "a nested RolloutEngine.generate waits on the engine's lock (deadlock)",
        "graphcap/rollout/engine.py",
        "        if self._caller == threading.get_ident():",
        "        if False:",
        (
            "tests/test_rollout_faults.py"
            "::test_a_generate_nested_in_a_forward_hook_is_refused_and_never_hangs",
        ),
    ),
    Plant(
        "a compile-cache header that is JSON but not an object is used",
        "graphcap/rollout/holder/compile_cache.py",
        "    if not isinstance(meta, dict):",
        "    if False:",
        (CACHE + "::test_a_damaged_or_foreign_file_warns_compiles_and_is_replaced",),
    ),
    Plant(
        "each compile-cache file holds everything the process compiled",
        "graphcap/rollout/holder/compile_cache.py",
        "        with _artefacts_of_this_session():",
        "        with contextlib.nullcontext():",
        (CACHE + "::test_each_file_holds_only_its_own_compilations_and_is_shared_by_the_umask",),
    ),
    Plant(
        "compile-cache files written for their owner only (0600)",
        "graphcap/rollout/holder/compile_cache.py",
        "os.open(temporary, flags, 0o666)",
        "os.open(temporary, flags, 0o600)",
        (CACHE + "::test_each_file_holds_only_its_own_compilations_and_is_shared_by_the_umask",),
    ),
    Plant(
        "ragged prompts as numpy arrays are not read as rows of ids",
        "graphcap/rollout/plan/inputs.py",
        '        if callable(getattr(row, "tolist", None)):',
        "        if isinstance(row, torch.Tensor):",
        (
            "tests/test_rollout_vllm.py"
            "::test_ragged_prompts_equal_the_left_padded_tensor_and_return_responses",
        ),
    ),
    Plant(
        "compile_cache refuses a pathlib.Path",
        "graphcap/rollout/settings/rollout_config.py",
        "        if isinstance(self.compile_cache, os.PathLike):",
        "        if False:",
        ("tests/test_compile_default.py::test_a_path_names_the_compile_cache_directory",),
    ),
    Plant(
        "draws from NaN logits are not counted",
        "graphcap/rollout/step/step.py",
        "            s.nan_draws.add_((nan_rows & s.rows.sample & ~s.finished).sum())",
        "            pass",
        (NUMERICS + "::test_sampling_from_a_diverged_model_warns_and_counts_the_draws",),
    ),
    Plant(
        "a vanishing temperature draws uniformly among the overflowed tokens",
        "graphcap/rollout/sampling.py",
        "        warped = sanitise(warp(scores, rows, shape.truncates), finished, scores, best)",
        "        warped = sanitise(warp(scores, rows, shape.truncates), finished)",
        (NUMERICS + "::test_a_vanishing_temperature_samples_the_argmax",),
    ),
    Plant(
        "the request limit ignores the block table's rounding",
        "graphcap/rollout/plan/inputs.py",
        "columns = batch * total if block_size is None else full_pool_columns(batch, total, "
        "block_size)",
        "columns = batch * total",
        (
            "tests/test_rollout_inputs.py::test_the_request_limit_counts_the_block_tables_whole_blocks",
        ),
    ),
    Plant(
        "a moved row leaves its sampling settings behind",
        "graphcap/rollout/step/step.py",
        "        return present + self.rows.row_tensors()",
        "        return present",
        (LADDER,),
    ),
    Plant(
        "rows on the ladder are not put back in their places",
        "graphcap/rollout/paths/ladder.py",
        "        if self.slots == sorted(self.slots):",
        "        if True:",
        (LADDER,),
    ),
    Plant(
        "the static cache moves no K/V with its rows",
        "graphcap/rollout/cache/cache.py",
        "            layer.keys[dst] = layer.keys[src]\n",
        "",
        (LADDER,),
    ),
    Plant(
        "the block table moves no table rows",
        "graphcap/rollout/cache/blocks.py",
        "        for tensor in (self.table, self.lengths, self.write_pos):",
        "        for tensor in (self.lengths, self.write_pos):",
        (LADDER,),
    ),
    Plant(
        "a slot moved down the ladder leaves its token limit behind",
        "graphcap/rollout/step/slots.py",
        "        return [*super().row_tensors(), *self._slot_tensors()]",
        "        return [*super().row_tensors(), *self._slot_tensors()[1:]]",
        (CONTINUOUS_LADDER,),
    ),
    Plant(
        "the slot table does not follow the slots the ladder moved",
        "graphcap/rollout/paths/continuous.py",
        "            table.swap(dst, src)\n",
        "            pass\n",
        (CONTINUOUS_LADDER,),
    ),
    Plant(
        "the slots the ladder vacated are not cleared",
        "graphcap/rollout/paths/continuous.py",
        "            clear_slots(self.step, [src for _, src in moved])\n",
        "            pass\n",
        (CONTINUOUS_LADDER + "::test_each_size_is_captured_once_and_kept_across_calls",),
    ),
    Plant(
        "unseeded rows of a call share one stream",
        "graphcap/rollout/sampling.py",
        "replace(p, seed=(key + i) % 2**64)",
        "replace(p, seed=key % 2**64)",
        ("tests/test_sampler_draws.py",),
    ),
    Plant(
        "a sampled step without truncation still sorts",
        "graphcap/rollout/sampling.py",
        "    return truncated(scores, rows) if truncate else scores",
        "    return truncated(scores, rows)",
        ("tests/test_sampler_draws.py",),
    ),
    Plant(
        "FSDP2's forward hooks left live during the call",
        "graphcap/rollout/holder/fsdp.py",
        "            state._training_state = TrainingState.PRE_BACKWARD\n",
        "",
        (SHARDED,),
    ),
    Plant(
        "FSDP2 not resharded after the call",
        "graphcap/rollout/holder/fsdp.py",
        "        for module in modules:\n            module.reshard()\n",
        "",
        (SHARDED,),
    ),
    Plant(
        "FSDP2 served from adopted storage under weights='model'",
        "graphcap/rollout/holder/weights.py",
        "        if sharded == FSDP2:\n            return True\n",
        "",
        (SHARDED,),
    ),
    Plant(
        "gathered ZeRO-3 parameters adopted, not copied",
        "graphcap/rollout/holder/weights.py",
        '(self.mode == "auto" and sharded is not None)',
        "False",
        (SHARDED,),
    ),
    Plant(
        "ZeRO-3 partitions taken for gathered parameters",
        "graphcap/rollout/plan/scan.py",
        '(param.numel() == 0 or status != "AVAILABLE")',
        '(status != "AVAILABLE")',
        ("tests/test_rollout_units.py::test_non_resident_parameters_are_named",),
    ),
    Plant(
        "the fused sampler's search stops with two values left",
        "backends/cuda/graphcap_cuda/kernels/sampler.py",
        "    while (lo < hi) & (n_lo - n_hi > 1):",
        "    while (lo < hi) & (n_lo - n_hi > 2):",
        (SAMPLER_KERNEL,),
    ),
    Plant(
        "the fused sampler's noise skips the token hash",
        "backends/cuda/graphcap_cuda/kernels/sampler.py",
        "bits = _hash32(step_key ^ _hash32(cols.to(tl.uint32) + _GOLDEN))",
        "bits = _hash32(step_key ^ (cols.to(tl.uint32) + _GOLDEN))",
        (SAMPLER_KERNEL,),
    ),
    Plant(
        "the fused sampler's top-p forgets top-k's cut",
        "backends/cuda/graphcap_cuda/kernels/sampler.py",
        "            kept = inside & (keys >= floor_key)\n",
        "            kept = inside\n",
        (SAMPLER_KERNEL,),
    ),
    Plant(
        "the fused sampler's greedy combine takes the last chunk holding the maximum",
        "backends/cuda/graphcap_cuda/kernels/sampler.py",
        "first_max = tl.min(tl.where(ok & (best_c == best), first_c, _INT_MAX))",
        "first_max = tl.max(tl.where(ok & (best_c == best), first_c, -1))",
        (SAMPLER_KERNEL,),
    ),
    Plant(
        "the fused sampler's draw combine drops the last chunk",
        "backends/cuda/graphcap_cuda/kernels/sampler.py",
        "            ok = c < chunks\n",
        "            ok = c < chunks - 1\n",
        (SAMPLER_KERNEL,),
    ),
    Plant(
        "the fused sampler's chunks gather into overlapping slots",
        "backends/cuda/graphcap_cuda/kernels/sampler.py",
        "tl.where((c[:, None] < part) & picked[None, :], per_chunk, 0)",
        "tl.where((c[:, None] < part - 1) & picked[None, :], per_chunk, 0)",
        (SAMPLER_KERNEL,),
    ),
    Plant(
        "the fused sampler keeps pass 1's draw for a row whose scores overflowed",
        "backends/cuda/graphcap_cuda/kernels/sampler.py",
        "drawn_already = _plain(live, seeded, k, floor, min_p) & normal",
        "drawn_already = _plain(live, seeded, k, floor, min_p)",
        (SAMPLER_KERNEL,),
    ),
    Plant(
        "a call truncates because an earlier call did",
        "graphcap/rollout/sampling.py",
        "truncates=any(truncates(p) for p in sampled) and (records or not fused),",
        "truncates=self.truncates or any(truncates(p) for p in sampled),",
        (PER_CALL_SHAPES,),
    ),
    Plant(
        "a call replays another sampler shape's graph",
        "graphcap/rollout/holder/holder.py",
        "self._held.graphs.get((self.sampler, key))",
        "next((g for (_, k), g in self._held.graphs.items() if k == key), None)",
        (PER_CALL_SHAPES,),
    ),
    Plant(
        "the K/V pools are not zeroed when a sleeping engine wakes",
        "graphcap/rollout/holder/holder.py",
        "        self._held.step.cache.clear()\n",
        "",
        (TRAINING_LOOP,),
    ),
    Plant(
        "the cache's write positions live with the K/V pools (lost at a sleep)",
        "graphcap/rollout/cache/cache.py",
        "        self.write_pos = torch.zeros(batch_size, dtype=torch.long, device=device)\n"
        "        self.max_len, self.memory = max_len, memory\n",
        "        with memory():\n"
        "            self.write_pos = torch.zeros(batch_size, dtype=torch.long, device=device)\n"
        "        self.max_len, self.memory = max_len, memory\n",
        (TRAINING_LOOP + "::test_a_sleep_keeps_every_buffer_but_the_kv_pools",),
    ),
    Plant(
        "a moved parameter's new values are not copied into what the graphs read",
        "graphcap/rollout/holder/weights.py",
        "                    held.copy_(tensor)\n",
        "",
        (TRAINING_LOOP,),
    ),
    Plant(
        "the model's parameters keep pointing at the engine's tensors after a call",
        "graphcap/rollout/holder/weights.py",
        "        tensor.data = own\n",
        "        pass\n",
        (TRAINING_LOOP,),
    ),
    Plant(
        "CPU graphs replay on tensor objects, not on the memory their capture saw",
        "graphcap/cpu/graph.py",
        "rec.steps.append((run, frozen_args, frozen_kwargs, single, several))",
        "rec.steps.append((run, args, kwargs, single, several))",
        (TRAINING_LOOP,),
    ),
    Plant(
        "the drop-in holds its memory between calls",
        "graphcap/rollout/drop_in.py",
        "                if self.sleep_between_calls:",
        "                if False:",
        (TRAINING_LOOP,),
    ),
    Plant(
        "a replay of released memory is not refused",
        "graphcap/cpu/graph.py",
        "        if RELEASED_STORAGES and _released(self._storages):",
        "        if False:",
        (TRAINING_LOOP + "::test_a_replay_never_reads_released_memory",),
    ),
    Plant(
        "a sample's layout reads another prompt's padding",
        "graphcap/rollout/paths/layouts.py",
        "for real in mask.sum(-1).tolist() for _ in range(repeats)]",
        "for real in mask.sum(-1).tolist()] * repeats",
        ("tests/test_rollout_continuous.py::test_eager_layouts_read_each_samples_prompt_padding",),
    ),
    Plant(
        "the trimmed front drops a column a busy slot reads",
        "graphcap/rollout/paths/layouts.py",
        "        lead = min(table.start[i] + self.pads[table.request[i]] for i in busy)\n",
        "        lead = min(table.start[i] + self.pads[table.request[i]] for i in busy) + 1\n",
        ("tests/test_rollout_continuous.py::test_eager_layout_modes_match_plain_eager",),
    ),
    Plant(
        "a wake maps the region beside the trainer's cached blocks",
        "graphcap/rollout/holder/holder.py",
        "self.backend.empty_cache()  # the trainer's cached blocks",
        "pass  # the trainer's cached blocks",
        (WAKE_SHORT,),
    ),
    Plant(
        "a wake maps without the memory it needs",
        "graphcap/rollout/holder/holder.py",
        "if free is not None and free < need:",
        "if free is not None and 2 * free < need:",
        (WAKE_SHORT,),
    ),
    Plant(
        "the default generator's graph state made inside an engine's region",
        "backends/cuda/graphcap_cuda/memory.py",
        "        generator_state_outside_regions(torch.cuda.current_device())\n",
        "",
        (
            "backends/cuda/tests/test_cuda_backend.py::"
            "test_a_capture_in_a_region_registers_the_default_generator_outside_it_first",
        ),
    ),
    Plant(
        "importing the rollout loads dynamo",
        "graphcap/rollout/sampling.py",
        "def cumulative_sum(probs: torch.Tensor) -> torch.Tensor:\n",
        "@torch.compiler.disable\ndef cumulative_sum(probs: torch.Tensor) -> torch.Tensor:\n",
        ("tests/test_import_cost.py",),
    ),
    Plant(
        "importing the rollout loads FSDP",
        "graphcap/rollout/plan/scan.py",
        "import torch\n",
        "import torch\nimport torch.distributed.fsdp\n",
        ("tests/test_import_cost.py",),
    ),
)


def caught(plant: Plant) -> bool:
    """Whether the plant's tests fail with the plant in place."""
    path = ROOT / plant.path
    source = path.read_text()
    if source.count(plant.old) != 1:
        raise SystemExit(f"{plant.name}: the snippet to replace is not in {plant.path} once")
    path.write_text(source.replace(plant.old, plant.new))
    try:
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *plant.tests],
            cwd=ROOT,
            env=SOURCES,
            capture_output=True,
            text=True,
        )
    finally:
        path.write_text(source)
    return run.returncode != 0


def main(names: list[str]) -> int:
    plants = [p for p in PLANTS if not names or p.name in names]
    holes = []
    for plant in plants:
        ok = caught(plant)
        print(f"{'caught' if ok else 'MISSED':7} {plant.name}", flush=True)
        if not ok:
            holes.append(plant.name)
    print(f"{len(plants) - len(holes)} of {len(plants)} plants caught")
    return 1 if holes else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
