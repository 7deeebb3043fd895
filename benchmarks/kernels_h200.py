"""The CUDA plugin's kernels alone against PyTorch's own, on one H200.

    python3 benchmarks/kernels_h200.py OUT.json [--parts attention,accuracy,products,epilogues]
    python3 benchmarks/kernels_h200.py OUT.json --parts launch    # the split-KV launch sweep

Parts (llama-8b and llama-1b shapes from graphcap's presets, bf16):

- ``attention``: ``graphcap_cuda.kernels.split_kv.split_kv_decode`` against
  ``F.scaled_dot_product_attention(..., enable_gqa=True)`` with the engine's additive mask, one
  decode token a row, at 1-256 rows on a 640-column cache (128 prompt + 512 new tokens) with a
  quarter, three fifths and all of it written, and at 1-32 rows on a 2,176-column cache three
  fifths written; the launch the kernel's rule chose (columns a block, chunks a row) and each
  timing's share of 4.8 TB/s for the bytes it must read (the kernel: the written K/V; SDPA: the
  whole cache).
- ``accuracy``: the kernel's and SDPA's bf16 outputs against a float64 reference.
- ``products``: ``graphcap_cuda.kernels.gemv.gemv`` (the one-row product of compiled batch-1
  captures) against ``F.linear`` (cuBLAS) for every projection of a decode step (joined q/k/v,
  o, joined gate/up, down, LM head), with its share of 4.8 TB/s for the weight bytes.
- ``epilogues``: the product with its neighbours inside (the residual add before the MLP, the
  RMSNorm, the gate/up product and the SiLU gate as one launch; the down product with the
  residual add after it) against the eager ops they replace (add, norm, ``F.linear``, ``silu
  * up``; ``F.linear`` + add).
- ``launch`` (not run by default, a few minutes): every block width and chunk count the kernel
  can launch at 1-32 rows, against the rule's choice and SDPA.

Each time is a CUDA graph that runs the call over enough copies of its inputs to outgrow the
L2 cache (as a step's layers read different weights and caches), replayed and timed with CUDA
events; reported per call in microseconds as the median, the interquartile range and min-max
over the replays. ``--smoke`` runs every part once on tiny shapes under Triton's interpreter on
the CPU (timings meaningless), to check the script.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if "--smoke" in sys.argv:  # before Triton reads it, at the kernels' definition
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

PEAK_BYTES_PER_S = 4.8e12  # the H200's HBM bandwidth, as graphcap bench's roofline takes it
L2_OUTGROW_BYTES = 400 * 2**20  # inputs of one timing, at least (the H200's L2 is 50 MB)
MAX_COPIES = 32
REPLAYS = 30
DTYPE = torch.bfloat16  # float32 under --smoke: the interpreter cannot multiply bf16
PARTS = ("attention", "accuracy", "products", "epilogues")
FULL_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CACHES = ((640, 0.25, FULL_BATCHES), (640, 0.6, FULL_BATCHES), (640, 1.0, FULL_BATCHES))
LONG_CACHE = (2176, 0.6, (1, 2, 4, 8, 16, 32))
SWEEP_BLOCKS = (32, 64, 128)
SWEEP_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def shapes(smoke: bool) -> dict[str, dict[str, int]]:
    """Attention and projection sizes of each preset."""
    from graphcap.preset_models import preset_config

    out = {}
    for name in ("tiny-llama",) if smoke else ("llama-8b", "llama-1b"):
        c = preset_config(name)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        out[name] = {
            "heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads,
            "head_dim": head_dim,
            "hidden": c.hidden_size,
            "intermediate": c.intermediate_size,
            "vocab": c.vocab_size,
            "eps": c.rms_norm_eps,
        }
    return out


def summary_us(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=4) if len(times) > 1 else times * 3
    return {
        "median_us": statistics.median(times),
        "iqr_us": q[2] - q[0],
        "min_us": min(times),
        "max_us": max(times),
    }


def copies_for(nbytes: int, smoke: bool) -> int:
    return 1 if smoke else max(1, min(MAX_COPIES, -(-L2_OUTGROW_BYTES // max(1, nbytes))))


def time_over(fn: Callable[[Any], Any], copies: list[Any], smoke: bool) -> dict[str, float]:
    """Per-call time of ``fn(copy)`` for each input copy, run back to back."""
    return time_calls([functools.partial(fn, copy) for copy in copies], smoke)


def time_calls(
    calls: list[Callable[[], Any]], smoke: bool, generators: Sequence[torch.Generator] = ()
) -> dict[str, float]:
    """Per-call time of ``calls`` run back to back: on the GPU one CUDA graph of all of them,
    replayed ``REPLAYS`` times, each replay timed with events. ``generators``: the explicit
    generators the calls draw from; a capture knows only the default one unless told (a draw
    from another raised "Attempt to increase offset for a CUDA generator not in capture
    mode"), as the engine tells its graphs (``Backend.register_generator``)."""
    if smoke:
        start = time.perf_counter()
        for call in calls:
            call()
        return summary_us([(time.perf_counter() - start) * 1e6 / len(calls)])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # Triton compiles, cuBLAS picks its kernels, outside the capture
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    for generator in generators:
        graph.register_generator_state(generator)
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return summary_us(times)


# ---------------------------------------------------------------- attention
def attention_inputs(shape, rows, length, fill, device, seed=0, copies=1):
    """Query, K/V copies and the engine's additive mask: ``fill`` of the cache written after up
    to 31 columns of left padding a row."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = DTYPE
    heads, kv_heads, dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    q = torch.randn(rows, heads, dim, device=device, dtype=dtype, generator=gen)
    kv = [
        tuple(
            torch.randn(rows, kv_heads, length, dim, device=device, dtype=dtype, generator=gen)
            for _ in range(2)
        )
        for _ in range(copies)
    ]
    columns = torch.arange(length, device=device)
    pads = torch.randint(0, 32, (rows, 1), device=device, generator=gen)
    valid = (columns[None] < int(length * fill)) & (columns[None] >= pads)
    mask = torch.where(valid, 0.0, torch.finfo(dtype).min).to(dtype)
    return q, kv, valid, mask


def sdpa(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(
        q[:, :, None], k, v, attn_mask=mask[:, None, None], scale=scale, enable_gqa=True
    )[:, :, 0]


def run_split_kv(split_kv, q, mask, scale, kv):
    return split_kv.split_kv_decode(q, *kv, mask, scale, 0.0)


def run_sdpa(q, mask, scale, kv):
    return sdpa(q, *kv, mask, scale)


def attention_case(split_kv, name, shape, rows, length, fill, device, smoke) -> dict[str, Any]:
    dim, kv_heads = shape["head_dim"], shape["kv_heads"]
    column_bytes = 2 * rows * kv_heads * dim * DTYPE.itemsize  # K and V of one column
    copies = copies_for(column_bytes * length, smoke)
    q, kv, valid, mask = attention_inputs(shape, rows, length, fill, device, copies=copies)
    scale = dim**-0.5
    block_bytes = max(16, 1 << (dim - 1).bit_length()) * DTYPE.itemsize
    block_n, wanted = split_kv.launch_shape(rows, kv_heads, length, q.device, block_bytes)
    written = int(valid.sum(-1).float().mean())
    kernel = time_over(functools.partial(run_split_kv, split_kv, q, mask, scale), kv, smoke)
    baseline = time_over(functools.partial(run_sdpa, q, mask, scale), kv, smoke)
    return {
        "shape": name,
        "rows": rows,
        "cache_columns": length,
        "written_share": fill,
        "launch": {
            "columns_a_block": block_n,
            "chunks": split_kv.chunking(length, block_n, wanted)[1],
        },
        "split_kv": kernel,
        "sdpa_gqa": baseline,
        "sdpa_over_split_kv": baseline["median_us"] / kernel["median_us"],
        "split_kv_share_of_written_bytes": column_bytes
        * written
        / PEAK_BYTES_PER_S
        / (kernel["median_us"] * 1e-6),
        "sdpa_share_of_cache_bytes": column_bytes
        * length
        / PEAK_BYTES_PER_S
        / (baseline["median_us"] * 1e-6),
    }


def attention(shape_map, device, smoke) -> list[dict[str, Any]]:
    from graphcap_cuda.kernels import split_kv

    rows = []
    cases = ((64, 0.6, (1, 4)),) if smoke else (*CACHES, LONG_CACHE)
    for name, shape in shape_map.items():
        for length, fill, batches in cases:
            for batch in batches:
                row = attention_case(split_kv, name, shape, batch, length, fill, device, smoke)
                rows.append(row)
                print(
                    f"attention {name} rows {batch} cache {length} x {fill}: split-KV "
                    f"{row['split_kv']['median_us']:.1f} us {row['launch']}, SDPA "
                    f"{row['sdpa_gqa']['median_us']:.1f} us",
                    flush=True,
                )
    return rows


def accuracy(shape_map, device, smoke) -> list[dict[str, Any]]:
    from graphcap_cuda.kernels import split_kv

    rows = []
    for name, shape in shape_map.items():
        for batch, length, fill in ((1, 64, 0.5),) if smoke else (
            (1, 640, 0.3), (16, 640, 0.6), (64, 640, 0.6), (256, 640, 1.0), (4, 2176, 0.6)
        ):  # fmt: skip
            q, [(k, v)], valid, mask = attention_inputs(shape, batch, length, fill, device, batch)
            scale = shape["head_dim"] ** -0.5
            ref = F.scaled_dot_product_attention(
                q[:, :, None].double(),
                k.double(),
                v.double(),
                attn_mask=valid[:, None, None],
                scale=scale,
                enable_gqa=True,
            )[:, :, 0]
            out = split_kv.split_kv_decode(q, k, v, mask, scale, 0.0).double()
            base = sdpa(q, k, v, mask, scale).double()
            rows.append(
                {
                    "shape": name,
                    "rows": batch,
                    "cache_columns": length,
                    "written_share": fill,
                    "split_kv_rel_err": float((out - ref).norm() / ref.norm()),
                    "sdpa_rel_err": float((base - ref).norm() / ref.norm()),
                    "finite": bool(torch.isfinite(out).all()),
                }
            )
            print(f"accuracy {rows[-1]}", flush=True)
    return rows


def launch_sweep(shape_map, device, smoke) -> list[dict[str, Any]]:
    """Every (columns a block, chunks) launch at a few rows: ``split_kv.launch_shape`` is
    replaced per timing (``split_kv_decode`` looks it up at each call)."""
    from graphcap_cuda.kernels import split_kv

    rule = split_kv.launch_shape
    rows = []
    few = (1, 2, 4, 8, 16, 32)
    cases = ((64, 0.6, (2,)),) if smoke else ((640, 0.6, few), (640, 1.0, few), (2176, 0.6, few))
    for name, shape in shape_map.items():
        for length, fill, batches in cases:
            for batch in batches:
                row = attention_case(split_kv, name, shape, batch, length, fill, device, smoke)
                column_bytes = 2 * batch * shape["kv_heads"] * shape["head_dim"] * DTYPE.itemsize
                copies = copies_for(column_bytes * length, smoke)
                q, kv, _, mask = attention_inputs(shape, batch, length, fill, device, copies=copies)
                kernel = functools.partial(
                    run_split_kv, split_kv, q, mask, shape["head_dim"] ** -0.5
                )
                times = {}
                try:
                    for block in SWEEP_BLOCKS:
                        counts = {split_kv.chunking(length, block, s)[1] for s in SWEEP_SPLITS}
                        for chunks in sorted(counts):
                            split_kv.launch_shape = lambda *a, b=block, c=chunks: (b, c)
                            timed = time_over(kernel, kv, smoke)
                            times[f"{block}x{chunks}"] = timed["median_us"]
                finally:
                    split_kv.launch_shape = rule
                best = min(times, key=times.get)
                row.update(launches_us=times, best=best, best_us=times[best])
                rows.append(row)
                print(
                    f"launch {name} rows {batch} cache {length} x {fill}: rule {row['launch']} "
                    f"{row['split_kv']['median_us']:.1f} us, best {best} {times[best]:.1f} us, "
                    f"SDPA {row['sdpa_gqa']['median_us']:.1f} us",
                    flush=True,
                )
    return rows


# ---------------------------------------------------------------- products
def projections(shape) -> dict[str, tuple[int, int]]:
    """(rows, columns) of each weight a decode step reads, projections joined as
    ``fuse_projections`` joins them."""
    hidden, inter, dim = shape["hidden"], shape["intermediate"], shape["head_dim"]
    return {
        "qkv": ((shape["heads"] + 2 * shape["kv_heads"]) * dim, hidden),
        "o": (hidden, shape["heads"] * dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (shape["vocab"], hidden),
    }


def weights(n, k, copies, device, gen):
    return [
        torch.randn(n, k, device=device, dtype=DTYPE, generator=gen) * k**-0.5
        for _ in range(copies)
    ]


def products(shape_map, device, smoke) -> list[dict[str, Any]]:
    from graphcap_cuda.kernels import gemv

    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, shape in shape_map.items():
        for product, (n, k) in projections(shape).items():
            ws = weights(n, k, copies_for(n * k * DTYPE.itemsize, smoke), device, gen)
            x = torch.randn(1, 1, k, device=device, dtype=DTYPE, generator=gen)
            ref = F.linear(x.double(), ws[0].double())
            cublas = time_over(functools.partial(F.linear, x), ws, smoke)
            kernel = time_over(functools.partial(gemv.gemv, x), ws, smoke)
            weight_s = n * k * DTYPE.itemsize / PEAK_BYTES_PER_S
            rows.append(
                {
                    "shape": name,
                    "product": product,
                    "n": n,
                    "k": k,
                    "copies": len(ws),
                    "cublas": cublas,
                    "one_row": kernel,
                    "cublas_over_one_row": cublas["median_us"] / kernel["median_us"],
                    "cublas_share": weight_s / (cublas["median_us"] * 1e-6),
                    "one_row_share": weight_s / (kernel["median_us"] * 1e-6),
                    "cublas_max_abs_err": (F.linear(x, ws[0]).double() - ref).abs().max().item(),
                    "one_row_max_abs_err": (gemv.gemv(x, ws[0]).double() - ref).abs().max().item(),
                }
            )
            print(
                f"product {name} {product} ({n}x{k}): cuBLAS {cublas['median_us']:.1f} us, "
                f"one-row {kernel['median_us']:.1f} us",
                flush=True,
            )
            del ws
    return rows


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm as transformers writes it."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def mlp_in_eager(x, a, h, norm_w, eps, inter, w):
    t = F.linear(rms_norm(x + a, norm_w, eps), w)
    return F.silu(t[..., :inter]) * t[..., inter:]


def mlp_in_fused(x, a, h, norm_w, eps, inter, w):
    from graphcap_cuda.kernels import gemv

    return gemv.gemv(
        x, w[inter:], gate=w[:inter], norm="rms", norm_weight=norm_w, eps=eps, addend=a
    )


def mlp_out_eager(x, a, h, norm_w, eps, inter, w):
    return F.linear(h, w) + x


def mlp_out_fused(x, a, h, norm_w, eps, inter, w):
    from graphcap_cuda.kernels import gemv

    return gemv.gemv(h, w, residual=x)


def epilogues(shape_map, device, smoke) -> list[dict[str, Any]]:
    """The MLP of a batch-1 step as the epilogue pass leaves it (two one-row launches) against
    the eager ops it replaces."""
    rows = []
    gen = torch.Generator(device=device).manual_seed(1)
    for name, shape in shape_map.items():
        hidden, inter, eps = shape["hidden"], shape["intermediate"], shape["eps"]
        copies = copies_for(3 * inter * hidden * DTYPE.itemsize, smoke)
        gate_ups = weights(2 * inter, hidden, copies, device, gen)
        downs = weights(hidden, inter, copies, device, gen)
        norm_w = 1 + 0.1 * torch.randn(hidden, device=device, dtype=DTYPE, generator=gen)
        x, a = (torch.randn(1, 1, hidden, device=device, dtype=DTYPE, generator=gen) for _ in "xa")
        h = torch.randn(1, 1, inter, device=device, dtype=DTYPE, generator=gen)

        args = (x, a, h, norm_w, eps, inter)
        forms = {
            "add_norm_gate_up_silu": (mlp_in_eager, mlp_in_fused, gate_ups),
            "down_residual": (mlp_out_eager, mlp_out_fused, downs),
        }
        for form, (eager_fn, fused_fn, ws) in forms.items():
            eager, fused = functools.partial(eager_fn, *args), functools.partial(fused_fn, *args)
            eager_t = time_over(eager, ws, smoke)
            fused_t = time_over(fused, ws, smoke)
            want, got = eager(ws[0]).float(), fused(ws[0]).float()
            rows.append(
                {
                    "shape": name,
                    "form": form,
                    "copies": len(ws),
                    "eager_ops": eager_t,
                    "one_row_fused": fused_t,
                    "eager_over_fused": eager_t["median_us"] / fused_t["median_us"],
                    "max_abs_diff": (got - want).abs().max().item(),
                    "max_abs_eager": want.abs().max().item(),
                }
            )
            print(
                f"epilogue {name} {form}: eager {eager_t['median_us']:.1f} us, fused "
                f"{fused_t['median_us']:.1f} us, max |diff| {rows[-1]['max_abs_diff']:.3g}",
                flush=True,
            )
    return rows


PART_FUNCTIONS = {
    "attention": attention,
    "accuracy": accuracy,
    "products": products,
    "epilogues": epilogues,
    "launch": launch_sweep,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the JSON report")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PART_FUNCTIONS)}")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU under Triton's interpreter"
    )
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PART_FUNCTIONS))
    if unknown:
        parser.error(f"unknown parts {unknown}")
    import triton
    from graphcap_cuda.kernels import split_kv

    global DTYPE
    DTYPE = torch.float32 if args.smoke else DTYPE
    device = torch.device("cpu" if args.smoke else "cuda")
    report: dict[str, Any] = {
        "command": " ".join(["python3", *sys.argv]),
        "device": "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(DTYPE),
        "peak_bytes_per_s": PEAK_BYTES_PER_S,
        "split_kv_rule": {
            "PROGRAMS_PER_SM": split_kv.PROGRAMS_PER_SM,
            "BLOCK_BYTES": split_kv.BLOCK_BYTES,
            "BLOCK_N_FEW_ROWS": split_kv.BLOCK_N_FEW_ROWS,
        },
        "timing": f"CUDA graph over input copies, {REPLAYS} replays, microseconds per call",
    }
    shape_map = shapes(args.smoke)
    report["shapes"] = shape_map
    start = time.perf_counter()
    for part in parts:
        with torch.no_grad():
            report[part] = PART_FUNCTIONS[part](shape_map, device, args.smoke)
        report["elapsed_s"] = round(time.perf_counter() - start, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")  # each part as it ends
    print(f"wrote {args.out} in {report['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
