"""Decode kernels on one H200 (issue 11): graph step time with the model's own SDPA vs the CUDA
plugin's attentions (grouped-query SDPA, split-KV Triton kernel), against the bandwidth
roofline; bf16 teacher-forced logits of each against SDPA; fp32 tokens graph vs eager on small
models. One process, one JSON.

    python3 benchmarks/decode_kernels_h200.py RESULTS.json [--new-tokens 512] [--budget-s 330]

Needs graphcap and graphcap-cuda importable (pip install --no-build-isolation --no-deps -e .
./backends/cuda, or PYTHONPATH=.:backends/cuda). Models are random-weight presets (bf16), so
nothing is downloaded. Every case is caught on its own (out of memory, capture fallback) and
recorded; a case not started within ``--budget-s`` is recorded as skipped. The JSON is rewritten
after every case, so a killed run still leaves what it measured.

Step time: each call's decode loop (host clock around it, synchronised at its end, EOS checks
included) divided by its steps; the median and interquartile range are over repeated calls
after the capturing one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

HBM_BYTES_PER_S = 4.8e12
MODELS = ("llama-8b", "llama-1b")
BATCHES = (1, 64, 256)
#: (label, RolloutConfig.graph_attention): the model's own SDPA, then the plugin's.
ATTENTIONS = (
    ("sdpa", None),
    ("gqa_sdpa", "graphcap_gqa_sdpa"),
    ("split_kv", "graphcap_split_kv"),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="where to write the results")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCHES)))
    parser.add_argument(
        "--attentions", default=",".join(label for label, _ in ATTENTIONS), help="labels to time"
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per case (at most)")
    parser.add_argument(
        "--case-budget-s", type=float, default=12.0, help="timed calls per case stop after this"
    )
    parser.add_argument("--budget-s", type=float, default=330.0, help="no case starts after this")
    parser.add_argument(
        "--with-compile",
        action="store_true",
        help="also time the last attention with compile=True at batch 1 and 64 (cold compiles)",
    )
    args = parser.parse_args()
    start = time.perf_counter()

    import transformers
    from graphcap_cuda.attention import IMPLEMENTATIONS, register_attention

    import graphcap

    for implementation in IMPLEMENTATIONS:
        register_attention(implementation)
    backend = graphcap.get_backend("cuda")
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "graphcap": graphcap.__version__,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "fp32_tokens": [],
        "logits_bf16": [],
        "cases": [],
        "notes": [],
    }

    def save() -> None:
        report["elapsed_s"] = round(time.perf_counter() - start, 1)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))

    guarded(report, "fp32_tokens", lambda: fp32_token_checks(backend), save)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    for name in args.models.split(","):
        if time.perf_counter() - start > args.budget_s:
            report["notes"].append(f"{name}: skipped, budget spent")
            continue
        model = guarded(report, "notes", lambda n=name: build(n), save)
        if model is None:
            continue
        guarded(report, "logits_bf16", lambda m=model, n=name: logits_diff(m, n), save)
        chosen = args.attentions.split(",")
        attentions = [(label, choice, False) for label, choice in ATTENTIONS if label in chosen]
        if args.with_compile:
            label, choice, _ = attentions[-1]
            attentions.append((f"{label}+compile", choice, True))
        for batch in batches:
            for label, choice, compiled in attentions:
                if compiled and batch > 64:
                    continue
                case = {"model": name, "batch": batch, "attention": label, "compile": compiled}
                if time.perf_counter() - start > args.budget_s:
                    case["skipped"] = "budget spent"
                else:
                    case.update(time_case(model, backend, batch, choice, compiled, args))
                report["cases"].append(case)
                save()
                print_case(case)
        del model
        torch.cuda.empty_cache()
    save()
    print(f"wrote {args.json} in {time.perf_counter() - start:.0f}s")
    return 0


def guarded(report: dict[str, Any], key: str, work, save) -> Any:
    """Run ``work``; its result (dict or list of dicts) goes into ``report[key]``, an exception
    becomes a recorded error instead of ending the run."""
    try:
        result = work()
    except Exception as exc:
        report[key].append(
            {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=4)}
        )
        torch.cuda.empty_cache()
        save()
        return None
    if isinstance(result, list):
        report[key].extend(result)
    elif isinstance(result, dict):
        report[key].append(result)
    save()
    return result


def build(name: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from graphcap.bench.models import preset_config

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            preset_config(name), dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads of the weights: every distinct parameter, except the input
    embedding when it is not also the output projection (a step gathers a few rows of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if embed.data_ptr() != head.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def kv_bytes(model: torch.nn.Module, batch: int, total_len: int) -> int:
    """Bytes of the whole static K/V cache (what masked attention reads every step)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * batch * c.num_key_value_heads * total_len * head_dim * 2


def time_case(model, backend, batch, choice, compiled, args) -> dict[str, Any]:
    from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams

    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (batch, args.prompt_len), device="cuda")
    mask = torch.ones_like(ids)
    params = SamplingParams(max_new_tokens=args.new_tokens, eos_token_id=[], pad_token_id=0)
    config = RolloutConfig(
        enable_graph_capture=True, backend=backend, graph_attention=choice, compile=compiled
    )
    engine = RolloutEngine(model, config)
    out: dict[str, Any] = {}
    try:
        first = engine.generate(ids, mask, params)
        stats = first.stats
        out.update(path=stats.path, attention_used=stats.attention, fallback=stats.fallback_reason)
        out.update(first_call_s=round(stats.total_s, 3), capture_s=round(stats.capture_s, 3))
        steps = []
        spent = 0.0
        while len(steps) < args.repeats and (not steps or spent < args.case_budget_s):
            result = engine.generate(ids, mask, params)
            steps.append(result.stats.decode_s / result.stats.steps)
            spent += result.stats.total_s
        q = statistics.quantiles(steps, n=4) if len(steps) > 1 else [steps[0]] * 3
        median = statistics.median(steps)
        weights = weight_bytes(model)
        kv = kv_bytes(model, batch, args.prompt_len + args.new_tokens)
        out.update(
            step_ms_median=round(median * 1e3, 3),
            step_ms_iqr=round((q[2] - q[0]) * 1e3, 3),
            step_ms_all=[round(s * 1e3, 3) for s in steps],
            roofline_weights_ms=round(weights / HBM_BYTES_PER_S * 1e3, 3),
            weight_bandwidth_share=round(weights / HBM_BYTES_PER_S / median, 3),
            weights_kv_bandwidth_share=round((weights + kv) / HBM_BYTES_PER_S / median, 3),
            tokens_per_s=round(batch / median, 1),
        )
    except torch.cuda.OutOfMemoryError as exc:
        out["error"] = f"out of memory: {str(exc).splitlines()[0]}"
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["trace"] = traceback.format_exc(limit=4)
    finally:
        engine.shutdown()
        torch.cuda.empty_cache()
    return out


def print_case(case: dict[str, Any]) -> None:
    head = f"{case['model']:9s} bs{case['batch']:<4d} {case['attention']:17s}"
    if "step_ms_median" in case:
        print(
            f"{head} step {case['step_ms_median']:8.3f} ms (IQR {case['step_ms_iqr']:.3f})  "
            f"weights {case['weight_bandwidth_share']:5.1%}  weights+KV "
            f"{case['weights_kv_bandwidth_share']:5.1%}  path {case['path']}",
            flush=True,
        )
    else:
        print(f"{head} {case.get('skipped') or case.get('error')}", flush=True)


def logits_diff(model, name: str, batch: int = 8, prompt: int = 128, steps: int = 32) -> list:
    """bf16 teacher-forced logits, model's SDPA vs each plugin attention: the prefill's last
    position, then ``steps`` single-token decodes with the engine's 4-D additive mask."""
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(3, vocab, (batch, prompt), device="cuda", generator=gen)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, : 7 * row] = 0  # left padding
    follow = torch.randint(3, vocab, (batch, steps), device="cuda", generator=gen)
    own = teacher_forced(model, "sdpa", ids, mask, follow)
    rows = []
    for label, choice in ATTENTIONS[1:]:
        other = teacher_forced(model, choice, ids, mask, follow)
        diff = (own - other).abs()
        rows.append(
            {
                "model": name,
                "attention": label,
                "batch": batch,
                "prefill_max_abs_diff": diff[:, 0].max().item(),
                "decode_max_abs_diff": diff[:, 1:].max().item(),
                "logits_max_abs": own.abs().max().item(),
                "argmax_agreement": (own.argmax(-1) == other.argmax(-1)).float().mean().item(),
            }
        )
    return rows


def teacher_forced(model, attention: str, ids, mask, follow) -> torch.Tensor:
    from transformers import DynamicCache

    own = model.config._attn_implementation
    model.set_attn_implementation(attention)
    try:
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            out = model(
                input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache
            )
            logits = [out.logits[:, -1].float()]
            valid, position = mask.bool(), positions[:, -1:] + 1
            low = torch.finfo(model.dtype).min
            for t in range(follow.shape[1]):
                valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=-1)
                additive = torch.where(valid, 0.0, low).to(model.dtype)[:, None, None, :]
                out = model(
                    input_ids=follow[:, t : t + 1],
                    attention_mask=additive,
                    position_ids=position,
                    past_key_values=cache,
                )
                logits.append(out.logits[:, -1].float())
                position = position + 1
    finally:
        model.set_attn_implementation(own)
    return torch.stack(logits, dim=1)


def fp32_token_checks(backend) -> list[dict[str, Any]]:
    """fp32 small models: tokens of captured steps (grouped-query attention, the CUDA default,
    and the model's own SDPA) equal the eager loop's, with padding, GQA and a sliding window."""
    from transformers import AutoModelForCausalLM, MistralConfig

    from graphcap.bench.models import preset_config
    from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams

    window = MistralConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=8192,
        sliding_window=24,
        initializer_range=2.0 / 16,
        pad_token_id=0,
    )
    configs = {"tiny-llama": preset_config("tiny-llama"), "tiny-mistral-window": window}
    results = []
    for name, config in configs.items():
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, attn_implementation="sdpa"
            ).eval()
        ids = torch.randint(3, config.vocab_size, (6, 48), device="cuda")
        mask = torch.ones_like(ids)
        for row in range(6):
            mask[row, : 5 * row] = 0
        params = SamplingParams(max_new_tokens=64, eos_token_id=[], pad_token_id=0)
        eager = RolloutEngine(model, RolloutConfig(backend=backend)).generate(ids, mask, params)
        entry: dict[str, Any] = {"model": name}
        for label, choice in ATTENTIONS:
            config_ = RolloutConfig(
                enable_graph_capture=True, backend=backend, graph_attention=choice
            )
            graph = RolloutEngine(model, config_).generate(ids, mask, params)
            entry[f"{label}_path"] = graph.stats.path
            entry[f"{label}_tokens_equal_eager"] = bool(
                torch.equal(graph.sequences, eager.sequences)
            )
        entry["distinct_tokens"] = len(set(eager.sequences[:, 48:].flatten().tolist()))
        results.append(entry)
        print(f"fp32 {entry}", flush=True)
    return results


if __name__ == "__main__":
    sys.exit(main())
