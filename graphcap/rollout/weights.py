"""Loading new weights without moving them, so a captured graph keeps seeing its tensors.

A graph replays on fixed addresses. Assigning new tensors to parameters (``load_state_dict``
with ``assign=True``, ``module.weight = ...``) changes addresses and forces a recapture; copying
into the existing tensors does not, and replay then reads the new values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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


#: What :func:`load_weights_in_place` takes: a state dict, or vLLM's ``load_weights`` input.
Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def load_weights_in_place(
    model: torch.nn.Module, weights: Weights, strict: bool = True
) -> WeightsLoaded:
    """Copy ``weights`` into the model's existing parameters/buffers; report what was copied.

    ``weights``: a mapping of names to tensors (a state dict), or an iterable of
    ``(name, tensor)`` pairs, as vLLM's ``model.load_weights`` takes them (verl, OpenRLHF). A
    mapping is checked whole before anything is copied; an iterable is copied as it is read,
    so a trainer's generator of gathered tensors is never held whole, and an error found in it
    leaves the tensors before it copied (the error says how many). A name given twice is
    copied twice, the last value kept, as vLLM does.
    ``strict`` requires every entry of ``model.state_dict()`` (so non-persistent buffers such as
    rotary ``inv_freq``, never in a state dict, are not required; they may still be given).
    Raises ``KeyError`` for unknown names (and, with ``strict``, for missing ones), ``TypeError``
    for an entry that is not a name and a tensor, ``ValueError`` for a shape mismatch, and
    ``RuntimeError`` if any address changed anyway. Errors name tensors, never print them.
    """
    targets = _tensors(model)
    persistent = model.state_dict(keep_vars=True)
    if isinstance(weights, Mapping):
        unknown = sorted(set(weights) - set(targets))
        if unknown:
            raise KeyError(f"weights name no parameter or buffer of the model: {unknown[:5]}")
        for name, source in weights.items():
            _check(targets, name, source)
        given = {targets[name].data_ptr() for name in weights}
        _check_complete(persistent, given, strict, copied=0)
    before = {name: t.data_ptr() for name, t in targets.items()}
    updated: set[str] = set()
    with torch.no_grad():
        for index, item in enumerate(weights.items() if isinstance(weights, Mapping) else weights):
            name, source = _pair(item, index, len(updated))
            if name not in targets:
                raise KeyError(
                    f"weights name no parameter or buffer of the model: [{name!r}] (the "
                    f"{len(updated)} tensors before it were copied)"
                )
            _check(targets, name, source)
            targets[name].copy_(source)
            updated.add(name)
    missing = _check_complete(
        persistent, {targets[n].data_ptr() for n in updated}, strict, len(updated)
    )
    after = _tensors(model)
    moved = sorted(n for n, t in after.items() if before.get(n) != t.data_ptr())
    if moved:
        raise RuntimeError(f"tensor addresses changed while loading weights: {moved[:5]}")
    return WeightsLoaded(updated=tuple(sorted(updated)), not_updated=tuple(missing))


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by each of its names (tied ones under each)."""
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    return targets


def _pair(item: object, index: int, copied: int) -> tuple[str, torch.Tensor]:
    """``item`` as a (name, tensor) pair, or a ``TypeError`` that describes it by its types."""
    if (
        isinstance(item, (tuple, list))
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor)
    ):
        return item[0], item[1]
    kinds = (
        f"{type(item).__name__} of ({', '.join(type(x).__name__ for x in item)})"
        if isinstance(item, (tuple, list))
        else type(item).__name__
    )
    raise TypeError(
        f"weights entry {index} is a {kinds}, not a (name, tensor) pair (the {copied} "
        "tensors before it were copied): pass a mapping of names to tensors or an iterable of "
        "(name, tensor) pairs, as vLLM's load_weights takes"
    )


def _check(targets: dict[str, torch.Tensor], name: str, source: object) -> None:
    if not isinstance(source, torch.Tensor):
        raise TypeError(f"{name}: a {type(source).__name__}, not a tensor")
    if tuple(source.shape) != tuple(targets[name].shape):
        raise ValueError(
            f"{name}: shape {tuple(source.shape)} does not match the model's "
            f"{tuple(targets[name].shape)}"
        )


def _check_complete(
    persistent: dict[str, torch.Tensor], given: set[int], strict: bool, copied: int
) -> list[str]:
    """The state-dict entries no given tensor (or tied alias of one) covers; raised under
    ``strict``."""
    missing = sorted(n for n, t in persistent.items() if t.data_ptr() not in given)
    if strict and missing:
        done = f"; the {copied} given were copied" if copied else ""
        raise KeyError(
            f"weights lack {len(missing)} tensors of the model's state dict (e.g. "
            f"{missing[:5]}); pass strict=False for a partial update{done}"
        )
    return missing
