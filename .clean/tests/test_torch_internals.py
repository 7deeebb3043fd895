"""What the CPU graph takes from torch's internals still holds (graphcap.cpu.torch_internals).

Each test pins one name or behaviour the module lists, and says in its failure what torch
changed: an upgrade that moves one fails here, by name, before it shows up as a graph that
records too little somewhere in a rollout. Naming torch's private modules and operators is
this file's point.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from graphcap.cpu import torch_internals as ti

aten = torch.ops.aten


def written(func: ti.OpOverload) -> list[str]:
    return [
        a.name
        for a in ti.schema_arguments(func)
        if a.alias_info is not None and a.alias_info.is_write
    ]


def position(func: ti.OpOverload, name: str) -> int:
    names = [a.name for a in ti.schema_arguments(func)]
    assert name in names, f"{func} has no argument {name!r} any more: {names}"
    return names.index(name)


class Seen(ti.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.funcs: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_every_aten_op_as_an_op_overload():
    a, b = torch.ones(2, 2), torch.full((2, 2), 2.0)
    with Seen() as seen:
        a.add_(1)
        torch.mm(a, b)
        a[torch.tensor([True, False])] = 0.0
    assert aten.add_.Tensor in seen.funcs, f"TorchDispatchMode missed an in-place op: {seen.funcs}"
    assert aten.mm.default in seen.funcs, f"TorchDispatchMode missed aten.mm: {seen.funcs}"
    assert aten.index_put_.default in seen.funcs, f"mask assignment changed op: {seen.funcs}"
    kinds = {type(f).__name__ for f in seen.funcs if not isinstance(f, ti.OpOverload)}
    assert not kinds, f"a dispatch mode now receives {kinds}, not torch._ops.OpOverload"


def test_an_op_overload_names_itself_and_calls_its_entry_point():
    func = aten.mm.default
    assert callable(func.op), "OpOverload.op (the C++ entry point a replay calls) is gone"
    a = torch.arange(4.0).reshape(2, 2)
    assert torch.equal(func.op(a, a), a @ a), "OpOverload.op no longer computes the op"
    assert func.namespace == "aten" and func.overloadpacket.__name__ == "mm", (
        "OpOverload.namespace / overloadpacket.__name__ no longer name the operator"
    )


def test_schema_arguments_mark_the_arguments_an_op_writes():
    assert written(aten.add_.Tensor) == ["self"], "alias_info.is_write misses in-place writes"
    assert written(aten.add.out) == ["out"], "alias_info.is_write misses out= writes"
    assert written(aten.add.Tensor) == [], "alias_info.is_write marks a pure op as writing"
    assert position(aten.normal_.default, "generator") >= 0
    assert position(aten.repeat_interleave.Tensor, "output_size") >= 0


def test_index_put_ops_take_indices_second():
    # the host-sync rule reads the indices as args[1] (or kwargs["indices"])
    for func in (
        aten.index_put.default,
        aten.index_put_.default,
        ti.INDEX_PUT_IMPL,
        aten.index.Tensor,
    ):
        assert position(func, "indices") == 1, f"{func}: indices moved"


def test_storage_key_is_the_identity_of_memory():
    base = torch.zeros(4, 4)
    assert ti.storage_key(base) == ti.storage_key(base.t()[1:]), "views no longer share a key"
    assert ti.storage_key(base) != ti.storage_key(base.clone()), "copies share a key"
    empty = [torch.empty(0), torch.empty(0)]
    assert ti.storage_key(empty[0]) != ti.storage_key(empty[1]), "empty storages share a key"


@pytest.mark.parametrize(
    ("tag", "ops"),
    [
        (ti.DATA_DEPENDENT_OUTPUT, (aten._local_scalar_dense.default, aten.equal.default)),
        (
            ti.DYNAMIC_OUTPUT_SHAPE,
            (
                aten.nonzero.default,
                aten.masked_select.default,
                aten.index.Tensor,
                aten.repeat_interleave.Tensor,
            ),
        ),
        (ti.INPLACE_VIEW, (aten.t_.default, aten.unsqueeze_.default, aten.as_strided_.default)),
    ],
)
def test_the_operator_tags_the_graph_reads(tag, ops):
    for func in ops:
        assert tag in func.tags, f"{func} lost the tag {tag}: the CPU graph would not see it"
    assert tag not in aten.add_.Tensor.tags


@pytest.mark.skipif(not dist.is_available(), reason="torch built without distributed")
def test_functional_collectives_keep_their_operators():
    import torch.distributed._functional_collectives  # noqa: F401  registers the helper op

    ops = ti.FUNCTIONAL_COLLECTIVES
    for name in (
        "all_reduce",
        "all_reduce_",
        "broadcast",
        "broadcast_",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        *ti.COLLECTIVE_HELPERS,
    ):
        assert hasattr(ops, name), f"torch.ops._c10d_functional.{name} is gone"
    assert ops.all_reduce_.default.namespace in ti.COLLECTIVE_NAMESPACES
    for func in (ops.all_gather_into_tensor.default, ops.reduce_scatter_tensor.default):
        position(func, "group_size")
    assert written(ops.all_reduce_.default) == ["input"]
    assert [a.name for a in ti.schema_arguments(ops.all_reduce_.default)] == [
        "input",
        "reduce_op",
        "group_name",
    ], "all_reduce_(input, reduce_op, group_name), as a blocking all_reduce is reissued, changed"


@pytest.mark.skipif(not dist.is_available(), reason="torch built without distributed")
def test_blocking_collectives_reach_a_torch_function_mode_by_module(tmp_path):
    class SeenCalls(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.modules: list[str | None] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            self.modules.append(getattr(func, "__module__", None))
            return func(*args, **(kwargs or {}))

    assert dist.all_reduce.__module__ == ti.C10D_MODULE, "dist.all_reduce moved module"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        with SeenCalls() as seen:
            dist.all_reduce(torch.ones(2))
    finally:
        dist.destroy_process_group()
    assert ti.C10D_MODULE in seen.modules, "dist.all_reduce no longer reaches a TorchFunctionMode"


def test_every_compiled_entry_asks_callback_from_stance(monkeypatch):
    import torch._dynamo.eval_frame as eval_frame

    original = getattr(eval_frame, "_callback_from_stance", None)
    assert original is not None, "torch._dynamo.eval_frame._callback_from_stance is gone"
    state = {"refuse": True, "asked": []}
    compiled = []

    def probe(callback):
        state["asked"].append(callback)
        return None if state["refuse"] else original(callback)

    def backend(gm, example_inputs):
        compiled.append(gm)
        return gm.forward

    monkeypatch.setattr(eval_frame, "_callback_from_stance", probe)
    fn = torch.compile(lambda t: t * 2 + 1, backend=backend)
    assert torch.equal(fn(torch.ones(2)), torch.full((2,), 3.0))
    assert any(c is not None for c in state["asked"]), "a compiled call skips the stance probe"
    assert not compiled, "the probe answering None no longer runs the region eagerly"
    state["refuse"] = False
    assert torch.equal(fn(torch.ones(2)), torch.full((2,), 3.0))
    assert compiled, "with the probe answering as torch does, the region must compile"
    state["asked"] = []
    torch.compiler.disable(lambda t: t + 1)(torch.ones(2))
    disabled = state["asked"]
    assert disabled and all(c is None for c in disabled), "compiler.disable no longer asks for None"
