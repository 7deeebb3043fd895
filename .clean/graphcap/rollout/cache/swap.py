"""Attributes swapped for the length of a block: module forwards (compiled regions, joined
projections, one-row products), the rotary function of a modeling file, the cache's K/V write
and a joined group's product.

A module's swapped ``forward`` is an instance attribute, which ``nn.Module.__call__`` prefers to
the class's, so hooks still run. Afterwards each object gets back what its own ``__dict__``
held, or loses the attribute if it held none (an instance forward another library installed
stays; a class attribute shows through again).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

_ABSENT = object()


@contextlib.contextmanager
def attributes_swapped(swaps: Sequence[tuple[object, str, object]]) -> Iterator[None]:
    """Within the block, each object's attribute ``name`` is the value paired with it."""
    own = [vars(obj).get(name, _ABSENT) for obj, name, _ in swaps]
    for obj, name, value in swaps:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for (obj, name, _), value in reversed(list(zip(swaps, own, strict=True))):
            if value is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


def forwards_swapped(
    swaps: Sequence[tuple[torch.nn.Module, Callable[..., object]]],
) -> contextlib.AbstractContextManager[None]:
    """Within the block, each module's forward is the callable paired with it."""
    return attributes_swapped([(module, "forward", forward) for module, forward in swaps])
