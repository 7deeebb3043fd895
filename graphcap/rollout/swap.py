"""Module forwards swapped for the length of a block (compiled regions, joined projections).

The swap sets an instance ``forward``, which ``nn.Module.__call__`` prefers to the class's, so
hooks still run; afterwards each module gets back what it had (an instance forward another
library installed, or none).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch


@contextlib.contextmanager
def forwards_swapped(
    swaps: Sequence[tuple[torch.nn.Module, Callable[..., object]]],
) -> Iterator[None]:
    """Within the block, each module's forward is the callable paired with it."""
    own = [module.__dict__.get("forward") for module, _ in swaps]
    for module, forward in swaps:
        module.forward = forward
    try:
        yield
    finally:
        for (module, _), forward in zip(swaps, own, strict=True):
            if forward is None:
                del module.forward
            else:
                module.forward = forward
