"""Compile the launches graphcap_cuda's host functions make for a Hopper GPU, without one.

Run as a script in a process without ``TRITON_INTERPRET`` (test_kernels_compile.py does): the
kernels are replaced by recorders, the host functions are called on CPU tensors for a set of
cases (dependent launches on), and every recorded launch is compiled by Triton's own code
generator for sm_90 down to a cubin (Triton ships ptxas), its arguments specialised as the
JIT specialises them on the GPU. Prints one JSON line per launch: the kernel, its constexprs,
the shared memory it needs, or the error.
"""

from __future__ import annotations

import functools
import itertools
import json
import sys

import torch
import triton
from graphcap_cuda.kernels import exact, exact_pointwise, gemv, launch, sampler, split_kv
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type

TARGET = GPUTarget("cuda", 90, 32)
#: Shared memory a block may use on an H100 / H200 (227 KB).
SHARED_LIMIT = 232448
OPTIONS = ("num_warps", "num_stages")
#: The sampler's kernels, launched in turn by ``graphcap_cuda::truncated_draw``.
SAMPLER_KERNELS = ("_extremes", "_search_pass", "_draw_pass", "_finish")


class Recorder:
    """Stands for a kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, kernel: triton.JITFunction, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: object):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def _marks(args: tuple) -> dict:
    """The divisibility marks Triton's JIT gives a launch's arguments on the GPU (16-byte-aligned
    tensors, ints divisible by 16), which let the compiler use vector and asynchronous copies.
    Without them a bf16 split-KV launch compiled here had no asynchronous copies and a third of
    its shared memory, unlike the same launch on the GPU."""
    marks = {}
    for index, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            mark = BaseBackend.get_tensor_specialization(value, align=True)
        elif isinstance(value, int) and not isinstance(value, bool):
            mark = BaseBackend.get_int_specialization(value, align=True)
        else:
            continue
        if mark:
            marks[(index,)] = BaseBackend.parse_attr(mark)
    return marks


def compile_launch(kernel: triton.JITFunction, args: tuple, kwargs: dict) -> dict:
    names = kernel.arg_names
    # Types as the JIT mangles them; an int equal to 1 becomes a constant there too.
    signature = {name: mangle_type(value, True) for name, value in zip(names, args, strict=False)}
    constexprs = {k: v for k, v in kwargs.items() if k in names}
    constexprs |= {k: v for k, v in zip(names, args, strict=False) if signature[k] == "constexpr"}
    signature |= dict.fromkeys(constexprs, "constexpr")
    options = {k: v for k, v in kwargs.items() if k in OPTIONS}
    record = {"kernel": kernel.__name__, "constexprs": constexprs, "options": options}
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs=_marks(args),
    )
    try:
        compiled = triton.compile(source, target=TARGET, options=options)
    except Exception as exc:  # reported, not raised: every launch is tried
        cause = exc.__cause__ or exc.__context__
        why = f"{type(exc).__name__}: {exc}" + (f"\ncaused by {cause!r}" if cause else "")
        return record | {"error": why[-3000:]}
    return record | {"shared": compiled.metadata.shared}


def _gemv_cases() -> None:
    for dtype in (torch.bfloat16, torch.float32):  # fp16 compiles as bf16 does
        make = functools.partial(_random, dtype)
        for n, k in ((96, 256), (70, 300), (20, gemv.GATED_LONG_K)):
            x, w, g, r = make(1, 1, k), make(n, k), make(n, k), make(n)
            gemv.gemv(x, w)
            gemv.gemv(x, w, make(n), r)
            for activation in gemv.ACTIVATIONS:
                gemv.gemv(x, w, None, r, g, make(n), activation)
            for norm, one_load in itertools.product(gemv.NORMS, (True, False)):
                gemv.NORM_ONE_LOAD = one_load
                gemv.gemv(x, w, norm=norm, norm_weight=make(k), eps=1e-5)
                gemv.gemv(
                    x, w, None, r, g, None, "silu", norm, make(k), 1e-5, make(1, 1, k), make(n)
                )


def _random(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def _split_kv_cases() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        for rows, heads, kv_heads, length, head_dim in (
            (1, 32, 8, 640, 128),  # llama-8b batch 1: split chunks, combined
            (64, 32, 8, 640, 128),  # batch 64: one chunk a row and K/V head
            (256, 32, 8, 640, 64),
            (2, 8, 8, 100, 80),  # no grouping, a head size that is not a power of two
        ):
            q = torch.randn(rows, heads, head_dim).to(dtype)
            k, v = (torch.randn(rows, kv_heads, length, head_dim).to(dtype) for _ in range(2))
            for mask in (
                torch.ones(rows, length, dtype=torch.bool),
                torch.zeros(rows, length, dtype=dtype),
            ):
                for softcap in (0.0, 30.0):
                    split_kv.split_kv_decode(q, k, v, mask, head_dim**-0.5, softcap)
                for block_size in (16, 5):  # a block size that divides no tile too
                    _paged_case(q, kv_heads, length, head_dim, block_size, mask)


def _paged_case(
    q: torch.Tensor,
    kv_heads: int,
    length: int,
    head_dim: int,
    block_size: int,
    mask: torch.Tensor,
) -> None:
    """The paged launch over pools behind a block table of ``length`` logical columns."""
    rows, per_row = q.shape[0], -(-length // block_size)
    pools = (torch.randn(1 + rows * per_row, kv_heads, block_size, head_dim).to(q.dtype),) * 2
    table = torch.arange(1, 1 + rows * per_row, dtype=torch.int32).view(rows, per_row)
    lengths = torch.full((rows,), length, dtype=torch.int32)
    wide = torch.nn.functional.pad(mask, (0, per_row * block_size - length))
    split_kv.split_kv_decode_paged(q, *pools, wide, table, lengths, head_dim**-0.5, 0.0)


def _sampler_cases() -> None:
    for rows, vocab in ((4, 128256), (3, 1000)):  # llama's vocabulary, and one short of a block
        settings = [torch.rand(rows), torch.randint(0, 60, (rows,)), torch.rand(rows)]
        flags = [torch.ones(rows, dtype=torch.bool)] * 2
        key, finished = torch.randint(0, 2**32, (rows,)), torch.zeros(rows, dtype=torch.bool)
        for generated in (torch.tensor([3]), torch.arange(rows)):  # static, continuous
            sampler.truncated_draw(
                torch.randn(rows, vocab), *settings, torch.rand(rows), *flags, key, finished,
                generated,
            )  # fmt: skip


def _exact_cases() -> None:
    """The trainer-exact kernels at llama-1b's and llama-8b's shapes, one row and many."""
    for dtype in (torch.bfloat16, torch.float32):
        for rows, (n, k) in itertools.product((1, 64, 4096), ((2048, 2048), (512, 4096), (70, 96))):
            exact.linear(_random(dtype, rows, k), _random(dtype, n, k))
        for width in (2048, 4096, 128):
            exact.rms_norm(_random(dtype, 3, width), _random(dtype, width), 1e-5)
        for batch, queries, keys, heads, kv_heads, head_dim in (
            (4, 1, 300, 32, 8, 64),  # decode steps reading a cache
            (2, 96, 96, 32, 8, 128),  # a trainer's forward
            (1, 5, 5, 4, 2, 16),
        ):
            q = _random(dtype, batch, heads, queries, head_dim)
            k, v = (_random(dtype, batch, kv_heads, keys, head_dim) for _ in range(2))
            mask = torch.ones(batch, 1, queries, keys, dtype=torch.bool).tril(keys - queries)
            positions = torch.arange(queries)[None].expand(batch, -1)
            exact.attention(None, q, k, v, mask, position_ids=positions)
        for heads, kv_heads, head_dim in ((32, 8, 64), (32, 8, 128), (4, 2, 16)):
            q = _random(dtype, 2, 5, heads, head_dim).transpose(1, 2)
            k = _random(dtype, 2, 5, kv_heads, head_dim).transpose(1, 2)
            exact_pointwise.rotary(q, k, *(_random(dtype, 1, 5, head_dim) for _ in range(2)))
        exact_pointwise.silu_mul(_random(dtype, 3, 8192), _random(dtype, 3, 8192))
    exact.log_softmax(torch.randn(3, 128256))


def main() -> None:
    launches: list = []
    launch.dependent = lambda device: True  # compile the dependent-launch code too
    # private: the Triton kernels themselves, wrapped to record every launch's compile
    gemv._gemv = Recorder(gemv._gemv, launches)
    split_kv._split_kv_partial = Recorder(split_kv._split_kv_partial, launches)
    for name in SAMPLER_KERNELS:
        setattr(sampler, name, Recorder(getattr(sampler, name), launches))
    for name in ("_linear", "_ordered_attention", "_rms_norm", "_softmax_chunks", "_softmax_write"):
        setattr(exact, name, Recorder(getattr(exact, name), launches))
    for name in ("_rotary", "_silu_mul"):
        setattr(exact_pointwise, name, Recorder(getattr(exact_pointwise, name), launches))
    _gemv_cases()
    _split_kv_cases()
    _sampler_cases()
    _exact_cases()
    seen = set()
    for kernel, args, kwargs in launches:
        key = (
            kernel.__name__,
            tuple(mangle_type(a, True) for a in args),
            repr(sorted(kwargs.items())),
        )
        if key not in seen:
            seen.add(key)
            print(json.dumps(compile_launch(kernel, args, kwargs)), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
