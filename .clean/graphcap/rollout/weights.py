"""Loading new weights without moving them, so a captured graph keeps seeing its tensors.

A graph replays on fixed addresses. Assigning new tensors to parameters (``load_state_dict``
with ``assign=True``, ``module.weight = ...``) changes addresses and forces a recapture; copying
into the existing tensors does not, and replay then reads the new values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WeightsLoaded:
    """What :func:`load_weights_in_place` did.

    ``updated``: the names copied. ``not_updated``: the model's state-dict entries (parameters
    and persistent buffers) that kept their old values because ``weights`` lacked them and no
    tied alias of them was copied; always empty after a strict load.
    """

    updated: tuple[str, ...]
    not_updated: tuple[str, ...]


def load_weights_in_place(
    model: torch.nn.Module, weights: Mapping[str, torch.Tensor], strict: bool = True
) -> WeightsLoaded:
    """Copy ``weights`` into the model's existing parameters/buffers; report what was copied.

    ``strict`` requires every entry of ``model.state_dict()`` (so non-persistent buffers such as
    rotary ``inv_freq``, never in a state dict, are not required; they may still be given).
    Raises ``KeyError`` for unknown names (and, with ``strict``, for missing ones), ``ValueError``
    for a shape mismatch, and ``RuntimeError`` if any address changed anyway.
    """
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    unknown = sorted(set(weights) - set(targets))
    if unknown:
        raise KeyError(f"weights name no parameter or buffer of the model: {unknown[:5]}")
    copied = {targets[name].data_ptr() for name in weights}
    persistent = model.state_dict(keep_vars=True)
    missing = sorted(n for n, t in persistent.items() if t.data_ptr() not in copied)
    if strict and missing:
        raise KeyError(
            f"weights lack {len(missing)} tensors of the model's state dict (e.g. "
            f"{missing[:5]}); pass strict=False for a partial update"
        )
    for name, source in weights.items():
        if tuple(source.shape) != tuple(targets[name].shape):
            raise ValueError(
                f"{name}: shape {tuple(source.shape)} does not match the model's "
                f"{tuple(targets[name].shape)}"
            )
    before = {name: t.data_ptr() for name, t in targets.items()}
    with torch.no_grad():
        for name, source in weights.items():
            targets[name].copy_(source)
    after = dict(model.named_parameters(remove_duplicate=False))
    after.update(model.named_buffers(remove_duplicate=False))
    moved = sorted(n for n, t in after.items() if before.get(n) != t.data_ptr())
    if moved:
        raise RuntimeError(f"tensor addresses changed while loading weights: {moved[:5]}")
    return WeightsLoaded(updated=tuple(sorted(weights)), not_updated=tuple(missing))
