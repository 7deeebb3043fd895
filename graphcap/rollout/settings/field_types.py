"""Dataclass fields checked against their own annotations, so a new field is covered by its type.

Annotation parts outside ``_TYPE_NAMES`` (``Backend``, ``ProcessGroup``) are left to the
field's own check.
"""

from __future__ import annotations

import ast
import numbers
from dataclasses import fields
from typing import Any

import torch

_TYPE_NAMES = {
    "None": "None",
    "bool": "a bool",
    "int": "an int",
    "float": "a float",
    "str": "a str",
    "list[int]": "a list of ints",
    "tuple[int, ...]": "a tuple of ints",
}
_NO_MATCH = object()


def check_field_types(obj: Any) -> None:
    """Refuse a dataclass field value of the wrong type, naming the field and the type wanted.

    ``"no"`` is not a bool, ``8.5`` and ``"5"`` are not ints, ``"0.7"`` is not a float. What
    ``generate`` accepts as a number passes and is normalised to the Python type: numpy scalars
    and 0-d tensors (``eos_token_id=np.int64(1)``), ints for floats (``temperature=1``), and
    1-d integer tensors / arrays for id lists.
    """
    for f in fields(obj):
        parts = [p.strip() for p in str(f.type).split("|")]
        if any(p not in _TYPE_NAMES and not p.startswith("Literal[") for p in parts):
            continue
        value = getattr(obj, f.name)
        for part in parts:
            converted = _convert(part, value)
            if converted is not _NO_MATCH:
                break
        else:
            wanted = " or ".join(_TYPE_NAMES.get(p) or _literal_name(p) for p in parts)
            raise TypeError(
                f"{type(obj).__name__}.{f.name} must be {wanted}, got {value!r} "
                f"({type(value).__name__})"
            )
        if converted is not value:
            object.__setattr__(obj, f.name, converted)


def _literal_values(kind: str) -> tuple[Any, ...]:
    """The values of a ``Literal[...]`` annotation part."""
    return ast.literal_eval(f"({kind[len('Literal[') : -1]},)")


def _literal_name(kind: str) -> str:
    return " or ".join(repr(v) for v in _literal_values(kind))


def _convert(kind: str, value: Any) -> Any:
    """``value`` as ``kind``, or ``_NO_MATCH``; never converts text or bools to numbers."""
    if kind.startswith("Literal["):
        values = _literal_values(kind)
        return value if isinstance(value, str) and value in values else _NO_MATCH
    if kind == "None":
        return value if value is None else _NO_MATCH
    if kind == "str":
        return value if isinstance(value, str) else _NO_MATCH
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.item()
        elif value.dim() == 1 and kind in ("list[int]", "tuple[int, ...]"):
            value = value.tolist()
        else:
            return _NO_MATCH
    elif hasattr(value, "dtype") and hasattr(value, "tolist"):  # numpy scalars and arrays
        value = value.tolist()
    if kind == "bool":
        return value if isinstance(value, bool) else _NO_MATCH
    if isinstance(value, bool):
        return _NO_MATCH
    if kind == "int":
        return int(value) if isinstance(value, numbers.Integral) else _NO_MATCH
    if kind == "float":
        return float(value) if isinstance(value, numbers.Real) else _NO_MATCH
    if isinstance(value, (list, tuple)):
        ints = [_convert("int", v) for v in value]
        if _NO_MATCH in ints:
            return _NO_MATCH
        return ints if kind == "list[int]" else tuple(ints)
    return _NO_MATCH
