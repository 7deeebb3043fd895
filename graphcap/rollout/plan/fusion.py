"""``RolloutConfig(fuse_projections=True)``: projections that read one input run as one GEMM.

At small batch a decode step is a chain of matrix-vector products, and each projection reads
its input and launches on its own; q/k/v and gate/up as one GEMM each made the batch-1 step
faster (docs/decisions.md, decisions 14 and 35). A group's weights are copied once
into one buffer and its parameters become views of that buffer, so memory does not grow and a
trainer's in-place updates (optimizer steps, ``load_weights_in_place``) reach the joined
product. A group whose parameters already lie back to back in one storage (another engine's
join of the same model, a flat-parameter library's buffer) is joined where it lies: nothing is
copied or moved. A parameter given new storage (``param.data = ...``, ``model.to(...)``) is
noticed at the next call and its group is joined again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from graphcap.rollout.cache.swap import attributes_swapped, forwards_swapped
from graphcap.rollout.plan.scan import ModelScan, is_dtensor

#: Projections that transformers' decoder models apply to the same input, by attribute name
#: (models that already fuse them, like GPT-2's ``c_attn``, need nothing).
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class JoinedGroup:
    """Linear layers applied to one input, whose weights (and biases) are views of one buffer.

    The first layer's forward computes the whole product and keeps its slices for the others,
    which return theirs when called on that same input (any other input: their own product).
    """

    def __init__(self, linears: list[torch.nn.Linear]):
        self.linears = linears
        self.sizes = [linear.out_features for linear in linears]
        #: each layer's first row in the joined buffer
        self.rows = [sum(self.sizes[:i]) for i in range(len(linears))]
        self.weight = torch.empty(0)
        self.bias: torch.Tensor | None = None
        #: whether the buffers are this group's own (a join copies into them) or storage it
        #: found the parameters in (never written by a join)
        self.owned = False
        #: computes the joined product (a backend's one-row kernel in compiled captures)
        self.product: Callable[..., torch.Tensor] = F.linear
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] = ()

    def joined(self) -> bool:
        """Whether every parameter is still the view of this group's buffer."""
        return all(
            _is_view_of(linear.weight, self.weight, row)
            and (self.bias is None or _is_view_of(linear.bias, self.bias, row))
            for linear, row in zip(self.linears, self.rows, strict=True)
        )

    def lying_joined(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The weight (and bias) buffers the parameters already form, each row block right
        after the previous one in one storage, or ``None`` where they do not."""
        weights = _back_to_back([linear.weight for linear in self.linears])
        if weights is None or self.linears[0].bias is None:
            return None if weights is None else (weights, None)
        biases = _back_to_back([linear.bias for linear in self.linears])
        return None if biases is None else (weights, biases)

    def owns_storage(self) -> bool:
        """Whether every parameter is the whole of its own storage or a view of this group's
        buffers. One that is a view of a buffer another library holds (DeepSpeed ZeRO-1/2's
        and FSDP's flat parameters) must not be joined: that library writes its updates into
        its buffer, which the joined parameter would no longer read."""
        ours = {b.untyped_storage().data_ptr() for b in (self.weight, self.bias) if b is not None}
        return all(
            p.untyped_storage().data_ptr() in ours
            or (
                p.storage_offset() == 0
                and p.untyped_storage().nbytes() == p.numel() * p.element_size()
            )
            for lin in self.linears
            for p in (lin.weight, lin.bias)
            if p is not None
        )

    def join(self) -> None:
        """Take the buffers the parameters already form (:meth:`lying_joined`), else copy the
        weights (and biases) into one buffer and make the parameters its views. A group
        joined before into its own buffer copies into it again, so captured graphs, which
        read the buffer, need no new capture when a trainer gave a parameter new storage."""
        lying = self.lying_joined()
        if lying is not None:
            (self.weight, self.bias), self.owned = lying, False
            return
        own = self.owned
        self.weight = _into(self.weight if own else None, [lin.weight for lin in self.linears])
        has_bias = self.linears[0].bias is not None
        biases = [lin.bias for lin in self.linears] if has_bias else None
        self.bias = _into(self.bias if own else None, biases) if biases is not None else None
        self.owned = True
        for linear, row, size in zip(self.linears, self.rows, self.sizes, strict=True):
            linear.weight.data = self.weight[row : row + size]
            if self.bias is not None:
                linear.bias.data = self.bias[row : row + size]

    def swaps(self) -> list[tuple[torch.nn.Linear, Callable[[torch.Tensor], torch.Tensor]]]:
        """Each layer with its forward while the group runs joined."""

        def first(x: torch.Tensor) -> torch.Tensor:
            self._input = x
            self._parts = self.product(x, self.weight, self.bias).split(self.sizes, dim=-1)
            return self._parts[0]

        def later(index: int, linear: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
            def forward(x: torch.Tensor) -> torch.Tensor:
                if x is not self._input:
                    return F.linear(x, linear.weight, linear.bias)
                part = self._parts[index]
                if index == len(self.linears) - 1:  # the last one: let the activations go
                    self._input, self._parts = None, ()
                return part

            return forward

        rest = [(lin, later(i, lin)) for i, lin in enumerate(self.linears) if i > 0]
        return [(self.linears[0], first), *rest]


def _into(buffer: torch.Tensor | None, parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` concatenated: in ``buffer`` when it has their joined shape, dtype and device,
    else in a new buffer."""
    joined = torch.cat([part.detach() for part in parts])
    if buffer is None or (buffer.shape, buffer.dtype, buffer.device) != (
        joined.shape,
        joined.dtype,
        joined.device,
    ):
        return joined
    return buffer.copy_(joined)


def _back_to_back(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """One tensor over ``parts`` (each contiguous, each starting where the previous ends in one
    storage, alike in dtype, device and trailing shape): a view, nothing copied; else
    ``None``."""
    first = parts[0]
    offset = first.storage_offset()
    for part in parts:
        if not (
            part.is_contiguous()
            and part.storage_offset() == offset
            and part.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and (part.dtype, part.device, part.shape[1:])
            == (first.dtype, first.device, first.shape[1:])
        ):
            return None
        offset += part.numel()
    rows = sum(part.shape[0] for part in parts)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride())


def _is_view_of(param: torch.Tensor, buffer: torch.Tensor, row: int) -> bool:
    return (
        buffer.numel() > 0
        and param.data_ptr() == buffer[row:].data_ptr()
        and param.dtype == buffer.dtype
        and param.device == buffer.device
    )


def joinable_groups(model: torch.nn.Module) -> list[list[torch.nn.Linear]]:
    """Each group of :data:`GROUPS` in ``model`` whose layers are plain ``nn.Linear`` (not a
    LoRA or quantised wrapper, not sharded) of one input size, dtype and device, all with a
    bias or none."""
    groups = []
    for module in model.modules():
        for names in GROUPS:
            linears = [getattr(module, name, None) for name in names]
            if all(type(lin) is torch.nn.Linear for lin in linears) and _alike(linears):
                groups.append(linears)
    return groups


def _alike(linears: list[torch.nn.Linear]) -> bool:
    first = linears[0]
    return all(
        lin.in_features == first.in_features
        and lin.weight.dtype == first.weight.dtype
        and lin.weight.device == first.weight.device
        and (lin.bias is None) == (first.bias is None)
        and not is_dtensor(lin.weight)
        for lin in linears
    )


class ProjectionFusion:
    """The engine's joined groups of ``model``: joined (again) before each call, and their
    layers' forwards swapped in for the call only."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.groups: list[JoinedGroup] = []
        #: the groups this call runs joined (none while parameters are not resident)
        self.active: list[JoinedGroup] = []

    def join(self, scan: ModelScan) -> bool:
        """Join the groups that are not (the first call, or storage replaced since); whether any
        parameter moved (the caller scans again). Parameters gathered in forward hooks (FSDP,
        ZeRO-3: ``scan.non_resident``) or sharded by a library that replaces their storage
        every round (``scan.sharded``: the library frees what a join would move) are never
        touched, nor are groups whose parameters are views of another buffer
        (:meth:`JoinedGroup.owns_storage`) unless they lie joined in it already
        (:meth:`JoinedGroup.lying_joined`); those run unjoined."""
        self.active = []
        if scan.non_resident is not None or scan.sharded is not None:
            return False
        linears = joinable_groups(self.model)
        if [g.linears for g in self.groups] != linears:
            self.groups = [JoinedGroup(group) for group in linears]
        moved = [group for group in self.groups if not group.joined()]
        foreign = [
            group for group in moved if not group.owns_storage() and group.lying_joined() is None
        ]
        with torch.no_grad():
            for group in moved:
                if group not in foreign:
                    group.join()
        self.active = [group for group in self.groups if group not in foreign]
        return len(moved) > len(foreign)

    def products_through(
        self, product: Callable[..., torch.Tensor]
    ) -> contextlib.AbstractContextManager[None]:
        """Within the block, the active groups compute their joined products with ``product``
        (``F.linear``'s signature)."""
        return attributes_swapped([(group, "product", product) for group in self.active])

    def applied(self) -> contextlib.AbstractContextManager[None]:
        """Within the block, each active group runs as one product; the layers' own forwards
        after."""
        return forwards_swapped([swap for group in self.active for swap in group.swaps()])
