"""A fingerprint of the Python-level state a forward reads on the host.

A replayed graph runs the kernels forward launched at capture. Which kernels those are depends on
more than tensors: hooks (a LoRA-style hook, a debugging hook), plain attributes that forward
branches on or multiplies by (``attention_scaling``, PEFT's ``_disable_adapters`` and
``merged_adapters``, ``_active_adapter``), functions held as attributes (an instance-level
``forward`` such as accelerate's hooks install), which class each module is (an activation
swapped for another), and objects holding weights outside ``parameters()`` (torch.ao's packed
int8 weights). :func:`host_state` collects all of that into a
:class:`HostState` taken at every call and made part of the graph signature, so any change means
a recapture instead of a stale replay. What it cannot see is listed in docs/rollout-mechanism.md
("What the signature sees").
"""

from __future__ import annotations

import enum
import functools
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["HostState", "host_state"]

#: Values a forward can branch on or compute with that are compared by value (and enums).
_PRIMITIVES = frozenset(
    {int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device}
)
_SEQUENCES = frozenset({tuple, list})
#: Callables a module can hold as plain attributes, compared by identity: an instance-level
#: ``forward`` (accelerate's hooks wrap a module's forward this way) or a function forward calls.
_CALLABLES = frozenset(
    {types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial}
)
_SETS = frozenset({set, frozenset})
#: Per-module hook dictionaries that decide what runs around ``forward`` (torch's names).
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
#: ``nn.Module`` bookkeeping the scan skips: tensors and submodules (the signature's tensor facts
#: and the module walk cover them), ``training`` (its own signature member), hook dictionaries
#: (read by :func:`_hooks`), hooks that never run in a forward (backward, state dict), and the
#: function transformers' ``gradient_checkpointing_enable`` installs (a new partial each call;
#: trainers re-enable checkpointing after every generate), which rollouts never call: they run
#: with checkpointing off (:func:`graphcap.rollout.prefill.without_checkpointing`).
_SKIPPED = frozenset(
    {
        "_gradient_checkpointing_func",
        "_parameters",
        "_buffers",
        "_modules",
        "training",
        "_backward_pre_hooks",
        "_backward_hooks",
        "_is_full_backward_hook",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        *_HOOK_DICTS,
    }
)
#: Forward hooks known to issue no device work in a rollout, by (module, qualified name): they
#: are not part of the host state. transformers' ``gradient_checkpointing_enable`` registers
#: ``make_inputs_require_grads`` on the input embeddings each time it is called and 5.17's
#: ``gradient_checkpointing_disable`` leaves it there, so a trainer that toggles checkpointing
#: around every generate (TRL) adds one a step; it only sets ``requires_grad`` on the
#: embeddings' output, which a ``no_grad`` rollout never uses (tests/test_drop_in.py checks
#: both that the name still exists and that the hook issues no operation).
INERT_HOOKS = frozenset(
    {
        (
            "transformers.modeling_utils",
            "PreTrainedModel.enable_input_require_grads.<locals>.make_inputs_require_grads",
        )
    }
)
#: How deep nested containers of primitives are followed (PEFT keeps ``{"adapter": value}``).
_DEPTH = 3


class _Opaque:
    """Marker for a value the fingerprint does not compare (not a primitive container)."""


_OPAQUE = _Opaque()


def _value(value: Any, keep: list[Any], depth: int = _DEPTH) -> Any:
    """A comparable, hashable form of ``value``, or ``_OPAQUE``.

    Primitives (and enums) compare by value, containers of them element by element. Tensors that
    are not parameters or buffers compare by address, shape, strides, dtype and device (as the
    signature's tensor facts do). TorchScript objects (torch.ao's packed weights) compare by
    identity: ``set_weight_bias`` packs a new object, and the old one cannot be changed in place
    from Python. Functions, methods, partials and classes compare by identity too (what they
    close over is not seen). ``keep`` holds everything compared by identity, so an identity is
    never reused while the state is held.
    """
    # Types are tested with type() / issubclass: isinstance on objects such as transformers
    # configs runs their __getattribute__, which dominated the cost on an 8B module tree.
    kind = type(value)
    if kind in _PRIMITIVES or issubclass(kind, enum.Enum):
        return value
    if issubclass(kind, torch.Tensor):
        if value.is_meta or value.layout != torch.strided:
            return ("tensor", tuple(value.shape), value.dtype, value.device, id(value))
        return ("tensor", value.data_ptr(), tuple(value.shape), value.stride(), value.dtype)
    if issubclass(kind, torch.ScriptObject):
        keep.append(value)
        return ("script_object", id(value))
    if kind in _CALLABLES or issubclass(kind, type):
        keep.append(value)
        return ("callable", id(value))
    if depth == 0:
        return _OPAQUE
    if kind in _SEQUENCES:
        items = tuple(_value(v, keep, depth - 1) for v in value)
        return _OPAQUE if _OPAQUE in items else (kind.__name__, items)
    if kind in _SETS:
        items = tuple(_value(v, keep, depth - 1) for v in value)
        return _OPAQUE if _OPAQUE in items else frozenset(items)
    if issubclass(kind, dict):
        items = tuple((k, _value(v, keep, depth - 1)) for k, v in value.items())
        if any(v is _OPAQUE or type(k) not in _PRIMITIVES for k, v in items):
            return _OPAQUE
        return ("dict", items)
    return _OPAQUE


def _attributes(module: torch.nn.Module, keep: list[Any]) -> tuple[tuple[str, Any], ...]:
    """(name, value) of every comparable attribute in ``module.__dict__``."""
    found = []
    for name, value in vars(module).items():
        if name in _SKIPPED:
            continue
        comparable = _value(value, keep)
        if comparable is not _OPAQUE:
            found.append((name, comparable))
    return tuple(found)


def _hook_entries(
    hooks: dict[int, Callable[..., Any]], flags: tuple[dict[int, bool], ...], keep: list[Any]
) -> tuple[Any, ...]:
    """(handle id, callable identity, flags) per hook, in call order.

    The flags are torch's ``with_kwargs`` / ``always_call`` dictionaries (handle id -> True).
    The callables go to ``keep``, so their ids cannot be reused while the state is held.
    :data:`INERT_HOOKS` are left out.
    """
    live = {h: hook for h, hook in hooks.items() if hook_name(hook) not in INERT_HOOKS}
    keep.extend(live.values())
    return tuple(
        (handle, id(hook), tuple(handle in flag for flag in flags)) for handle, hook in live.items()
    )


def hook_name(hook: Callable[..., Any]) -> tuple[str, str]:
    """(module, qualified name) of a hook function, as :data:`INERT_HOOKS` lists them."""
    return getattr(hook, "__module__", "") or "", getattr(hook, "__qualname__", "")


def _hooks(module: torch.nn.Module, keep: list[Any]) -> tuple[Any, ...]:
    """The module's forward pre-hooks and forward hooks with their flags."""
    state = vars(module)
    pre = state.get("_forward_pre_hooks", {})
    post = state.get("_forward_hooks", {})
    if not pre and not post:
        return ()
    entries = (
        _hook_entries(pre, (state.get("_forward_pre_hooks_with_kwargs", {}),), keep),
        _hook_entries(
            post,
            (
                state.get("_forward_hooks_with_kwargs", {}),
                state.get("_forward_hooks_always_called", {}),
            ),
            keep,
        ),
    )
    return entries if any(entries) else ()


def global_forward_hooks() -> tuple[dict[int, Any], ...]:
    """torch's process-wide module forward hooks (``register_module_forward_pre_hook`` and
    ``register_module_forward_hook``): pre-hooks, hooks, with-kwargs flags, always-call flags.

    torch keeps them only in private module-level dictionaries of ``torch.nn.modules.module``
    (same names in torch 2.11 and 2.13; no public accessor exists); this is the one place that
    reads them. A dictionary a future torch renames reads as empty: docs/rollout-mechanism.md
    lists it.
    """
    from torch.nn.modules import module as torch_module

    names = (
        "_global_forward_pre_hooks",
        "_global_forward_hooks",
        "_global_forward_hooks_with_kwargs",
        "_global_forward_hooks_always_called",
    )
    return tuple(getattr(torch_module, name, {}) for name in names)


@dataclass(frozen=True)
class HostState:
    """Hooks and comparable attributes of every module, the model config and global hooks."""

    #: (module path, module class, hooks, attributes) per module, in ``named_modules`` order.
    modules: tuple[tuple[str, type, tuple[Any, ...], tuple[tuple[str, Any], ...]], ...]
    config: tuple[tuple[str, Any], ...]
    global_hooks: tuple[Any, ...]
    #: Hook callables and packed-weight objects whose identities are compared (never compared).
    keep: tuple[Any, ...] = field(default=(), compare=False, repr=False)

    def hooked_module(self) -> str | None:
        """Where a live forward hook runs (a module path, or ``"global module forward hooks"``),
        or ``None``: compiled captures are not taken of hooked models (plan.compile_refusal)."""
        if any(self.global_hooks):
            return "global module forward hooks"
        return next((path or "<root>" for path, _, hooks, _ in self.modules if hooks), None)

    def differences(self, other: HostState, limit: int = 3) -> list[str]:
        """Up to ``limit`` readable changes, e.g. ``"model.layers.0.q_proj: forward hooks"``."""
        return list(_changes(self, other))[:limit]


def _changes(old: HostState, new: HostState) -> Iterator[str]:
    if old.global_hooks != new.global_hooks:
        yield "global module forward hooks"
    if old.config != new.config:
        before, after = dict(old.config), dict(new.config)
        keys = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        yield "config." + ", config.".join(keys)
    if len(old.modules) != len(new.modules):
        yield "the module tree"
        return
    for (path, kind_a, hooks_a, attrs_a), (_, kind_b, hooks_b, attrs_b) in zip(
        old.modules, new.modules, strict=True
    ):
        where = path or "<root>"
        if kind_a is not kind_b:
            yield f"{where}: {kind_a.__name__} replaced by {kind_b.__name__}"
        if hooks_a != hooks_b:
            yield f"{where}: forward hooks"
        if attrs_a != attrs_b:
            before, after = dict(attrs_a), dict(attrs_b)
            keys = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
            yield f"{where}.{', '.join(keys)}"


def host_state(
    model: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]] | None = None
) -> HostState:
    """The host-side state ``model``'s forward reads, cheap enough to take on every call.

    ``modules``: ``model.named_modules(remove_duplicate=False)`` when the caller has it already.
    """
    keep: list[Any] = []
    if modules is None:
        modules = list(model.named_modules(remove_duplicate=False))
    module_state = tuple(
        (path, type(module), _hooks(module, keep), _attributes(module, keep))
        for path, module in modules
    )
    config = getattr(model, "config", None)
    config_state: tuple[tuple[str, Any], ...] = ()
    if config is not None and hasattr(config, "__dict__"):
        config_state = tuple(
            (name, v)
            for name, value in vars(config).items()
            if (v := _value(value, keep)) is not _OPAQUE
        )
    pre, post, with_kwargs, always = global_forward_hooks()
    global_hooks = (
        _hook_entries(pre, (), keep),
        _hook_entries(post, (with_kwargs, always), keep),
    )
    return HostState(module_state, config_state, global_hooks, tuple(keep))
