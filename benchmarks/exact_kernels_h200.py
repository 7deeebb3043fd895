"""Where trainer-exact time goes: each exact kernel against the operation it replaces, on one GPU.

    python3 benchmarks/exact_kernels_h200.py OUT.json [--models llama-1b,llama-8b] [--smoke]
        [--parts profile,products,attention,rows,tiles]

Parts, in this order (bf16, the shapes of graphcap's llama-1b and llama-8b presets):

- ``profile``: torch.profiler kernel tables, llama-1b (the first model): one decode step of a
  trainer-exact rollout (64 rows, the static graph; the difference of a 64-token and a 2-token
  call over the same graph, per step) and of the default engine's (compiled), and one trainer
  forward + backward (32 x 512) under ``trainer_exact`` and under the model's default forward:
  the top kernels by device time and the time by family (the exact kernels, BLAS, attention).
- ``products``: ``graphcap_cuda.kernels.exact.linear`` against ``F.linear`` (cuBLAS) for every
  weight a trainer-exact forward multiplies (q, k and v, o, gate and up, down: projections are
  not joined under trainer-exact; the LM head) and the default step's joined q/k/v and gate/up,
  at decode's rows (64 and 256, forward, one CUDA graph over weight copies as a captured step
  runs them) and at the trainer's (32 x 512 = 16,384 rows, eager as a trainer runs: forward,
  and forward + backward). ``per_step`` sums one decode forward's products: the exact kernel
  on the unjoined weights against cuBLAS on the default step's joined ones.
- ``attention``: ``exact.attention`` (with its per-layer mask analysis, and its kernel alone)
  against the split-KV decode kernel and SDPA for a decode step (64 rows, one query each, a
  640-column cache with about 512 keys written after up to 31 columns of left padding), and
  against transformers' SDPA attention for the trainer's causal forward (32 x 512, a quarter of
  the rows left-padded), forward and forward + backward.
- ``rows``: ``exact.rms_norm`` against the models' RMSNorm formula and ``exact.log_softmax``
  against ``torch.log_softmax`` (float32 over the vocabulary), at decode's rows (graph) and the
  trainer's (eager, forward and forward + backward).
- ``tiles``: the exact product's kernel at other tile shapes (``BLOCK_K`` kept, but for one
  control with ``BLOCK_K`` 128, whose bits should differ) on the first model's q, down and
  LM-head weights at 64 and 16,384 rows: each one's time and whether its output is the same
  bits as the committed shape's (evidence for choosing tiles; nothing here changes the
  kernel).

Decode-shaped times: a CUDA graph of the call over enough input copies to outgrow the L2 cache,
replayed (``kernels_h200.time_calls``); trainer-shaped times: eager calls between CUDA events,
after a warm-up call. Medians in microseconds; ``ratio`` is exact over default. The report is
written as each part ends; a part that fails is recorded under ``errors`` and the others run.
``--smoke``: tiny shapes on the CPU, the kernels under Triton's interpreter and the profile on
the CPU reference backend (operator CPU times; timings meaningless, it checks the script).
Written to take about two minutes on an H100 (not yet run there).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

if "--smoke" in sys.argv:  # before Triton reads it, at the kernels' definition
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F
from kernels_h200 import copies_for, summary_us, time_calls

DTYPE = torch.bfloat16  # float32 under --smoke: the interpreter cannot multiply bf16
PARTS = ("profile", "products", "attention", "rows", "tiles")  # the most wanted first
#: (rows a decode step multiplies, the trainer's batch, its sequence length); --smoke shrinks them
DECODE_ROWS = (64, 256)
TRAIN_BATCH, TRAIN_LEN = 32, 512
CACHE_COLUMNS, CACHE_WRITTEN = 640, 512
EAGER_REPEATS = 5
#: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tried by ``tiles``: BLOCK_K as committed,
#: but for the last, a control whose other sum over K must give other bits
TILES = (
    (64, 64, 64, 4, 4),
    (64, 32, 64, 4, 3),
    (64, 128, 64, 4, 3),
    (64, 128, 64, 4, 4),
    (64, 256, 64, 4, 3),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (64, 64, 64, 8, 3),
    (16, 64, 64, 4, 3),
    (64, 64, 128, 4, 3),
)
PROFILE_NEW = 64  # tokens of the profiled rollout (a 2-token call is subtracted)
TOP_KERNELS = 25


def shapes(names: list[str]) -> dict[str, dict[str, int]]:
    from graphcap.preset_models import preset_config

    out = {}
    for name in names:
        c = preset_config(name)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        out[name] = {
            "heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads,
            "head_dim": head_dim,
            "hidden": c.hidden_size,
            "intermediate": c.intermediate_size,
            "vocab": c.vocab_size,
            "layers": c.num_hidden_layers,
            "eps": c.rms_norm_eps,
        }
    return out


def weights_of(shape: dict[str, int]) -> dict[str, tuple[int, int, int, int]]:
    """(N, K, uses in a trainer-exact forward, uses in a default one) of each product: the
    exact forward's projections unjoined, the default decode step's q/k/v and gate/up joined
    (``fuse_projections``)."""
    hidden, inter, dim, layers = (
        shape["hidden"],
        shape["intermediate"],
        shape["head_dim"],
        shape["layers"],
    )
    return {
        "q": (shape["heads"] * dim, hidden, layers, 0),
        "k_v": (shape["kv_heads"] * dim, hidden, 2 * layers, 0),
        "qkv_joined": ((shape["heads"] + 2 * shape["kv_heads"]) * dim, hidden, 0, layers),
        "o": (hidden, shape["heads"] * dim, layers, layers),
        "gate_up": (inter, hidden, 2 * layers, 0),
        "gate_up_joined": (2 * inter, hidden, 0, layers),
        "down": (hidden, inter, layers, layers),
        "lm_head": (shape["vocab"], hidden, 1, 1),
    }


# ---------------------------------------------------------------- timing
class Timer:
    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke

    def graph(self, fn: Callable[[Any], Any], copies: list[Any]) -> dict[str, float]:
        """Per-call time of ``fn(copy)`` over the copies in one CUDA graph (decode's way)."""
        return time_calls([lambda c=c: fn(c) for c in copies], self.smoke)

    def eager(self, call: Callable[[], Any], repeats: int = EAGER_REPEATS) -> dict[str, float]:
        """Per-call time of ``call`` run eagerly (a trainer's way), after one warm-up call."""
        if self.smoke:
            repeats = 1
        call()
        times = []
        for _ in range(repeats):
            if self.smoke:
                start = time.perf_counter()
                call()
                times.append((time.perf_counter() - start) * 1e6)
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return summary_us(times)


def pair(default: dict[str, float], exact: dict[str, float]) -> dict[str, Any]:
    return {"default": default, "exact": exact, "ratio": exact["median_us"] / default["median_us"]}


def forward_backward(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
    """A call running ``fn(*inputs)`` and its backward (inputs that require grad get theirs)."""
    grad: list[torch.Tensor] = []

    def call() -> None:
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        if not grad:
            grad.append(torch.randn_like(out))
        out.backward(grad[0])

    return call


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- products
def products(ctx: Context) -> list[dict[str, Any]]:
    rows = []
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    for name, shape in ctx.shapes.items():
        per_step = {m: {"default_us": 0.0, "exact_us": 0.0} for m in ctx.decode_rows}
        for product, (n, k, uses, default_uses) in weights_of(shape).items():
            row = product_case(ctx, gen, n, k, trainer=uses > 0)  # the trainer runs unjoined
            uses_of = {"uses_exact_forward": uses, "uses_default_forward": default_uses}
            rows.append({"shape": name, "product": product, **uses_of, **row})
            release()
            for m in ctx.decode_rows:
                timed = row[f"decode_{m}"]
                per_step[m]["default_us"] += default_uses * timed["default"]["median_us"]
                per_step[m]["exact_us"] += uses * timed["exact"]["median_us"]
            ratios = ", ".join(f"{key} {value['ratio']:.2f}x" for key, value in ratios_of(row))
            ctx.say(f"product {name} {product} ({n}x{k}): {ratios}")
        for m, sums in per_step.items():
            sums["ratio"] = sums["exact_us"] / sums["default_us"]
            rows.append({"shape": name, "per_step": f"decode_{m}", **sums})
            ctx.say(f"products of one {name} forward at {m} rows: {sums}")
    return rows


def ratios_of(row: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(k, v) for k, v in row.items() if isinstance(v, dict) and "ratio" in v]


def product_case(
    ctx: Context, gen: torch.Generator, n: int, k: int, trainer: bool
) -> dict[str, Any]:
    """``F.linear`` and ``exact.linear`` of an (N, K) weight at decode's rows and (``trainer``)
    the trainer's."""
    linear = ctx.exact.linear
    ws = [randn(gen, ctx, n, k, scale=k**-0.5) for _ in range(copies_for(n * k * 2, ctx.smoke))]
    row: dict[str, Any] = {"n": n, "k": k}
    for m in ctx.decode_rows:
        x = randn(gen, ctx, m, k)
        with torch.no_grad():
            row[f"decode_{m}"] = pair(
                ctx.timer.graph(functools.partial(F.linear, x), ws),
                ctx.timer.graph(functools.partial(linear, x), ws),
            )
    if not trainer:
        return row
    w = ws[0].requires_grad_()
    x = randn(gen, ctx, ctx.train_rows, k).requires_grad_()
    with torch.no_grad():
        row["trainer_forward"] = pair(
            ctx.timer.eager(functools.partial(F.linear, x, w)),
            ctx.timer.eager(functools.partial(linear, x, w)),
        )
    row["trainer_forward_backward"] = pair(
        ctx.timer.eager(forward_backward(F.linear, x, w)),
        ctx.timer.eager(forward_backward(linear, x, w)),
    )
    return row


def randn(gen: torch.Generator, ctx: Context, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=ctx.device, generator=gen) * scale).to(DTYPE)


# ---------------------------------------------------------------- tiles
def launch_tile(tile: tuple[int, ...], x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The exact product's kernel at ``tile`` (``_launch_linear`` with another shape)."""
    import triton
    from graphcap_cuda.kernels import exact

    block_m, block_n, block_k, warps, stages = tile
    count, depth = x.shape
    cols = weight.shape[0]
    out = torch.empty((count, cols), dtype=x.dtype, device=x.device)
    parts, span = exact.splits(cols, depth)  # each program sums the weight's splits in turn
    exact._linear[(triton.cdiv(count, block_m) * triton.cdiv(cols, block_n), 1)](
        x, weight, out, out, out, count, cols, depth, span, 0, x.stride(0), weight.stride(0),
        out.stride(0), SPLITS=parts, SPREAD=False,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        PRECISION=exact._precision(x.dtype), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def tiles(ctx: Context) -> list[dict[str, Any]]:
    """Other tile shapes of the exact product: time, and bits against the committed shape."""
    name, shape = next(iter(ctx.shapes.items()))
    gen = torch.Generator(device=ctx.device).manual_seed(3)
    committed = tuple(ctx.exact.LINEAR_BLOCKS)
    candidates = (committed,) + (() if ctx.smoke else TILES)
    rows = []
    for product in ("q", "down", "lm_head"):
        n, k = weights_of(shape)[product][:2]
        ws = [randn(gen, ctx, n, k, scale=k**-0.5) for _ in range(copies_for(n * k * 2, ctx.smoke))]
        for m in (ctx.decode_rows[0], ctx.train_rows):
            x = randn(gen, ctx, m, k)
            with torch.no_grad():
                base = launch_tile(committed, x, ws[0])
                for tile in candidates:
                    row = {"shape": name, "product": product, "n": n, "k": k, "rows": m}
                    row |= tile_case(ctx, tile, x, ws, base, eager=m == ctx.train_rows)
                    rows.append(row)
                    ctx.say(f"tile {product} rows {m} {tile}: {row}")
        release()
    return rows


def tile_case(ctx, tile, x, ws, base, eager: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"tile": list(tile)}
    try:
        out = launch_tile(tile, x, ws[0])
        row["same_bits"] = bool(torch.equal(out, base))
        row["max_abs_diff"] = (out.float() - base.float()).abs().max().item()
        call = functools.partial(launch_tile, tile, x)
        row["time"] = (
            ctx.timer.eager(functools.partial(call, ws[0])) if eager else ctx.timer.graph(call, ws)
        )
    except Exception as exc:  # a shape that does not compile or fit: recorded
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return row


# ---------------------------------------------------------------- attention
def attention(ctx: Context) -> list[dict[str, Any]]:
    rows = []
    gen = torch.Generator(device=ctx.device).manual_seed(1)
    for name, shape in ctx.shapes.items():
        rows.append({"shape": name, **decode_attention(ctx, gen, shape)})
        release()
        rows.append({"shape": name, **trainer_attention(ctx, gen, shape)})
        release()
    return rows


def decode_attention(ctx: Context, gen: torch.Generator, shape: dict[str, int]) -> dict[str, Any]:
    """One query a row over a left-padded cache, as a captured decode step reads it."""
    from graphcap_cuda.kernels import split_kv

    exact = ctx.exact
    heads, kv_heads, dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    scale = dim**-0.5
    batch, columns, written = ctx.decode_rows[0], ctx.cache_columns, ctx.cache_written
    copies = copies_for(2 * batch * kv_heads * dim * 2 * columns, ctx.smoke)
    q = randn(gen, ctx, batch, heads, 1, dim)
    kvs = [
        tuple(randn(gen, ctx, batch, kv_heads, columns, dim) for _ in "kv") for _ in range(copies)
    ]
    pads = torch.randint(0, 32, (batch, 1), device=ctx.device, generator=gen)
    col = torch.arange(columns, device=ctx.device)
    valid = (col[None] >= pads) & (col[None] < pads + written)
    positions = valid.sum(-1, keepdim=True) - 1
    additive = torch.where(valid, 0.0, torch.finfo(DTYPE).min).to(DTYPE)
    origin, reach = exact.row_origin(valid[:, None, :], positions)

    def exact_function(kv):
        return exact.attention(None, q, *kv, valid[:, None, None], position_ids=positions)

    def exact_kernel(kv):
        return exact._launch_attention(q, *kv, valid[:, None, :], origin, reach, scale)

    def split(kv):
        return split_kv.split_kv_decode(q[:, :, 0], *kv, additive, scale, 0.0)

    def sdpa(kv):
        mask = valid[:, None, None]
        return F.scaled_dot_product_attention(q, *kv, attn_mask=mask, scale=scale, enable_gqa=True)

    calls = {"exact_function": exact_function, "exact_kernel_alone": exact_kernel}
    calls |= {"split_kv": split, "sdpa_gqa": sdpa}
    with torch.no_grad():
        timings = {key: ctx.timer.graph(call, kvs) for key, call in calls.items()}
    ctx.say(
        "attention decode: " + ", ".join(f"{k} {v['median_us']:.1f} us" for k, v in timings.items())
    )
    over = timings["exact_function"]["median_us"] / timings["split_kv"]["median_us"]
    return {
        "case": "decode", "rows": batch, "cache_columns": columns, "keys_written": written,
        **timings, "exact_over_split_kv": over,
    }  # fmt: skip


def trainer_attention(ctx: Context, gen: torch.Generator, shape: dict[str, int]) -> dict[str, Any]:
    """The trainer's causal forward over a batch, a quarter of the rows left-padded."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    exact = ctx.exact
    heads, kv_heads, dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    scale = dim**-0.5
    batch, length = ctx.train_batch, ctx.train_len
    q, k, v = (
        randn(gen, ctx, batch, h, length, dim).requires_grad_() for h in (heads, kv_heads, kv_heads)
    )
    real = torch.ones(batch, length, dtype=torch.bool, device=ctx.device)
    real[::4, : length // 4] = False
    col = torch.arange(length, device=ctx.device)
    mask = real[:, None, None, :] & (col[None, :] <= col[:, None])[None, None]
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)
    module = torch.nn.Module()  # what transformers' SDPA function reads off an attention module
    module.num_key_value_groups = heads // kv_heads
    module.is_causal = True

    def default_attention(q, k, v):
        return sdpa_attention_forward(module, q, k, v, mask, scaling=scale)[0]

    def exact_attention(q, k, v):
        return exact.attention(None, q, k, v, mask, scaling=scale, position_ids=positions)[0]

    with torch.no_grad():
        forward = pair(
            ctx.timer.eager(functools.partial(default_attention, q, k, v)),
            ctx.timer.eager(functools.partial(exact_attention, q, k, v)),
        )
    both = pair(
        ctx.timer.eager(forward_backward(default_attention, q, k, v)),
        ctx.timer.eager(forward_backward(exact_attention, q, k, v)),
    )
    ctx.say(
        f"attention trainer: forward {forward['ratio']:.2f}x, with backward {both['ratio']:.2f}x"
    )
    return {"case": "trainer", "batch": batch, "length": length, "forward": forward,
            "forward_backward": both}  # fmt: skip


# ---------------------------------------------------------------- rows
def norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The covered families' RMSNorm, as transformers writes it (the default forward's)."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def row_ops(ctx: Context) -> list[dict[str, Any]]:
    exact = ctx.exact
    rows = []
    gen = torch.Generator(device=ctx.device).manual_seed(2)
    vocabs_done = set()
    for name, shape in ctx.shapes.items():
        hidden, eps, vocab = shape["hidden"], shape["eps"], shape["vocab"]
        weight = (1 + 0.1 * randn(gen, ctx, hidden)).requires_grad_()
        norm = functools.partial(norm_reference, weight=weight, eps=eps)
        ours = functools.partial(exact.rms_norm, weight=weight, eps=eps)
        cases = [("rms_norm", hidden, norm, ours, DTYPE)]
        if vocab not in vocabs_done:
            vocabs_done.add(vocab)
            softmax = functools.partial(torch.log_softmax, dim=-1)
            cases.append(("log_softmax", vocab, softmax, exact.log_softmax, torch.float32))
        for op, width, default, exact_op, dtype in cases:
            row = {"shape": name, "op": op, "width": width}
            row |= row_case(ctx, gen, width, default, exact_op, dtype)
            rows.append(row)
            release()
            ratios = ", ".join(f"{key} {value['ratio']:.2f}x" for key, value in ratios_of(row))
            ctx.say(f"{op} {name}: {ratios}")
    return rows


def row_case(ctx, gen, width, default, ours, dtype) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for m in ctx.decode_rows:
        copies = copies_for(m * width * dtype.itemsize, ctx.smoke)
        xs = [
            torch.randn(m, width, device=ctx.device, generator=gen).to(dtype) for _ in range(copies)
        ]
        with torch.no_grad():
            row[f"decode_{m}"] = pair(ctx.timer.graph(default, xs), ctx.timer.graph(ours, xs))
    x = torch.randn(ctx.train_rows, width, device=ctx.device, generator=gen).to(dtype)
    x.requires_grad_()
    with torch.no_grad():
        row["trainer_forward"] = pair(
            ctx.timer.eager(functools.partial(default, x)),
            ctx.timer.eager(functools.partial(ours, x)),
        )
    row["trainer_forward_backward"] = pair(
        ctx.timer.eager(forward_backward(default, x)),
        ctx.timer.eager(forward_backward(ours, x)),
    )
    return row


# ---------------------------------------------------------------- profile
def kernel_table(prof: Any, on_device: bool) -> dict[str, dict[str, float]]:
    """Time and count per kernel (on the CPU: per operator, self time)."""
    table = {}
    for event in prof.key_averages():
        if on_device:
            us = getattr(event, "device_time_total", 0.0)
            if us <= 0 or event.key.startswith(("cudaGraphLaunch", "Memcpy", "Memset")):
                continue
            if getattr(event, "device_type", None) is None or "CPU" in str(event.device_type):
                continue
        else:
            us = event.self_cpu_time_total
            if us <= 0:
                continue
        table[event.key] = {"count": event.count, "us": us}
    return table


def profiled(call: Callable[[], Any], ctx: Context) -> tuple[dict[str, dict[str, float]], Any]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([] if ctx.smoke else [ProfilerActivity.CUDA])
    ctx.backend.synchronize()
    with profile(activities=activities) as prof:
        out = call()
        ctx.backend.synchronize()
    return kernel_table(prof, not ctx.smoke), out


#: Kernel families of the tables, by a piece of the kernel's name (first match wins).
FAMILIES = {
    "exact_linear": ("_linear",),
    "exact_attention": ("_ordered_attention",),
    "exact_rows": ("_rms_norm", "_log_softmax"),
    "blas": ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "cublas", "aten::mm", "aten::addmm"),
    "attention": ("attention", "fmha", "flash", "split_kv"),
}


def family(kernel: str) -> str:
    name = kernel.lower()
    return next((fam for fam, keys in FAMILIES.items() if any(k in name for k in keys)), "other")


def top(table: dict[str, dict[str, float]], per: float = 1.0) -> dict[str, Any]:
    ranked = sorted(table.items(), key=lambda kv: -kv[1]["us"])
    families: dict[str, float] = {}
    for name, k in table.items():
        families[family(name)] = families.get(family(name), 0.0) + k["us"] / per
    return {
        "total_us": sum(k["us"] for k in table.values()) / per,
        "launches": sum(k["count"] for k in table.values()) / per,
        "us_by_family": families,
        "top": [
            {"name": n[:140], "count": k["count"] / per, "us": k["us"] / per}
            for n, k in ranked[:TOP_KERNELS]
        ],
    }


def profile_part(ctx: Context) -> dict[str, Any]:
    from graphcap.preset_models import build_model

    name = next(iter(ctx.shapes))
    model = build_model(name, dtype=DTYPE, device=ctx.backend.device)
    out: dict[str, Any] = {"model": name}
    for mode, extra in (("trainer_exact", {"trainer_exact": True}), ("default", {})):
        out[f"rollout_decode_step_{mode}"] = rollout_step_profile(ctx, model, extra)
        release()
        ctx.say(f"profile rollout {mode}: {out[f'rollout_decode_step_{mode}']['total_us']:.0f} us")
    for mode, exact in (("trainer_exact", True), ("default", False)):
        out[f"trainer_forward_backward_{mode}"] = trainer_profile(ctx, model, exact)
        release()
        ctx.say(
            f"profile trainer {mode}: {out[f'trainer_forward_backward_{mode}']['total_us']:.0f} us"
        )
    return out


def rollout_step_profile(ctx: Context, model: torch.nn.Module, extra: dict) -> dict[str, Any]:
    """One decode step's kernels: a long call less a 2-token call on the same graph, per step.
    8 prompts of 64-256 tokens (left-padded) x 8 samples, as trainer_exact_h200.py."""
    from dataclasses import replace

    from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts, samples, widths = (2, 2, (4, 12)) if ctx.smoke else (8, 8, (64, 256))
    lengths = torch.randint(widths[0], widths[1] + 1, (prompts,), generator=gen)
    width = int(lengths.max())
    mask = (torch.arange(width)[None] >= width - lengths[:, None]).long()
    ids = torch.randint(3, model.config.vocab_size, (prompts, width), generator=gen) * mask
    ids, mask = ids.to(ctx.backend.device), mask.to(ctx.backend.device)
    new = 8 if ctx.smoke else PROFILE_NEW
    params = SamplingParams(
        max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0, seed=1,
        num_return_sequences=samples, return_logprobs=True, logprobs_mode="raw",
    )  # fmt: skip
    short = replace(params, max_new_tokens=2, min_new_tokens=2)
    config = RolloutConfig(
        backend=ctx.backend, enable_graph_capture=True, length_buckets=(width + new,), **extra
    )
    engine = RolloutEngine(model, config)
    try:
        engine.generate(ids, mask, params)  # capture (and compile, by default)
        full, long_call = profiled(functools.partial(engine.generate, ids, mask, params), ctx)
        base, short_call = profiled(functools.partial(engine.generate, ids, mask, short), ctx)
    finally:
        engine.shutdown()
    steps = long_call.stats.steps - short_call.stats.steps
    step = {
        key: {
            "count": k["count"] - base.get(key, {}).get("count", 0),
            "us": k["us"] - base.get(key, {}).get("us", 0.0),
        }
        for key, k in full.items()
    }
    return {
        "rows": prompts * samples,
        "path": long_call.stats.path,
        "steps_differenced": steps,
        "decode_ms_per_step_wall": 1000 * long_call.stats.decode_s / long_call.stats.steps,
        **top(step, per=max(1, steps)),
    }


def trainer_profile(ctx: Context, model: torch.nn.Module, exact: bool) -> dict[str, Any]:
    """One forward + backward of a policy-gradient-shaped loss (a quarter of the rows
    left-padded), under ``trainer_exact`` or the model's default forward."""
    from graphcap.rollout import token_logprobs, trainer_exact
    from graphcap.rollout.exact import real_positions

    batch, length = ctx.train_batch, ctx.train_len
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(3, model.config.vocab_size, (batch, length), generator=gen)
    attend = torch.ones_like(tokens)
    attend[::4, : length // 4] = 0
    tokens, attend = (tokens * attend).to(ctx.backend.device), attend.to(ctx.backend.device)
    positions = real_positions(attend)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with trainer_exact(model) if exact else contextlib.nullcontext():
            logits = model(tokens, attention_mask=attend, position_ids=positions, use_cache=False)
            if exact:
                logp = token_logprobs(logits.logits[:, :-1], tokens[:, 1:])
            else:
                logp = torch.log_softmax(logits.logits[:, :-1].float(), -1)
                logp = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
        (-(logp * attend[:, 1:]).sum() / attend.sum()).backward()

    model.train()
    try:
        step()  # warm-up: Triton compiles, cuBLAS picks
        start = time.perf_counter()
        table, _ = profiled(step, ctx)
        wall = time.perf_counter() - start
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
    return {"batch": batch, "length": length, "wall_s_profiled": round(wall, 4), **top(table)}


# ---------------------------------------------------------------- main
class Context:
    def __init__(self, args: argparse.Namespace) -> None:
        import graphcap

        self.smoke = args.smoke
        self.backend = graphcap.get_backend("cpu" if args.smoke else None)
        self.device = torch.device("cpu" if args.smoke else "cuda")
        self.timer = Timer(args.smoke)
        self.shapes = shapes(args.models.split(","))
        if args.smoke:
            self.decode_rows, self.train_batch, self.train_len = (4, 16), 2, 16
            self.cache_columns, self.cache_written = 48, 36
        else:
            self.decode_rows, self.train_batch, self.train_len = DECODE_ROWS, TRAIN_BATCH, TRAIN_LEN
            self.cache_columns, self.cache_written = CACHE_COLUMNS, CACHE_WRITTEN
        self.train_rows = self.train_batch * self.train_len
        self.exact = importlib.import_module("graphcap_cuda.kernels.exact")

    def say(self, line: str) -> None:
        print(line, flush=True)


PART_FUNCTIONS = {
    "products": products,
    "tiles": tiles,
    "attention": attention,
    "rows": row_ops,
    "profile": profile_part,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the JSON report")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    parser.add_argument(
        "--models", default="llama-1b,llama-8b", help="presets (profile: the first)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PART_FUNCTIONS))
    if unknown:
        parser.error(f"unknown parts {unknown}")
    if args.smoke:
        args.models = "tiny-llama"
    import triton

    global DTYPE
    DTYPE = torch.float32 if args.smoke else DTYPE
    ctx = Context(args)
    report: dict[str, Any] = {
        "command": " ".join(["python3", *sys.argv]),
        "device": "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(DTYPE).removeprefix("torch."),
        "linear_blocks": list(ctx.exact.LINEAR_BLOCKS),
        "shapes": ctx.shapes,
        "decode_rows": list(ctx.decode_rows),
        "trainer": {"batch": ctx.train_batch, "length": ctx.train_len},
        "timing": "decode: CUDA graph over input copies (kernels_h200.time_calls); trainer: "
        f"eager between CUDA events, median of {EAGER_REPEATS} after a warm-up; microseconds",
        "errors": {},
    }
    start = time.perf_counter()
    for part in parts:
        try:
            report[part] = PART_FUNCTIONS[part](ctx)
        except Exception as exc:  # recorded; the other parts still run
            report["errors"][part] = (
                f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
            )
            print(f"{part} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        release()
        report["elapsed_s"] = round(time.perf_counter() - start, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")  # each part as it ends
    print(f"wrote {args.out} in {report['elapsed_s']} s ({len(report['errors'])} parts failed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
