"""The decode step's projections: ``F.linear`` through graphcap_cuda's one-row kernel (batch 1)
or few-row kernel (2 to ``few_rows.MAX_ROWS`` rows), cuBLAS for everything else."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphcap_cuda import few_rows, gemv


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the kernel that serves ``x``'s row count."""
    if serves(x, weight) and (bias is None or bias.dtype == x.dtype):
        rows = x.numel() // x.shape[-1]
        if rows == 1:
            return gemv.gemv(x, weight, bias)
        if rows <= few_rows.MAX_ROWS:
            return few_rows.few_rows(x, weight, bias)
    return F.linear(x, weight, bias)


def serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernels compute ``F.linear(x, weight)``: floating point of the weight's
    dtype, the weight's rows contiguous (a view of a joined buffer is), some rows of x."""
    return (
        x.dtype == weight.dtype
        and weight.dim() == 2
        and weight.stride(1) == 1
        and x.is_floating_point()
        and x.numel() > 0
    )
