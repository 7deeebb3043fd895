"""An inductor graph pass that moves the one-row product's neighbours into it.

In a batch-1 compiled step, :func:`graphcap_cuda.gemv.gemv` is a custom op: inductor cannot fuse
the elementwise work around it into it, so that work is a kernel of its own. Run X's profile of
llama-8b's step showed two per layer: a gated MLP's ``silu(gate) * up`` between the gate/up
product and the down product (1.9 µs), and the residual add after the down product (1.6 µs;
the next layer's norm is in another compiled frame, so it cannot take the add). This pass
rewrites, in the post-grad graph of every region ``compile=True`` compiles:

- ``act(gemv(x, Wg)) * gemv(x, Wu)``, with the two products joined as one (``fuse_projections``:
  one product split in two) or not, into one ``gemv(x, Wu, gate=Wg, activation=...)``;
- ``gemv(...) + r``, where ``r`` has the product's shape and dtype, into ``gemv(..., residual=r)``.

Only products whose every use is the pattern are rewritten, so no weight is read twice. The
kernel rounds each intermediate to the activation dtype where the eager ops round it.

``act`` is recognised by what it computes, not by how it is written: the elementwise nodes
between the product and the multiply are evaluated on a probe of values and compared with each
activation the kernel has (SiLU, tanh-approximated GELU). Inductor decomposes both into a few
primitive ops whose form differs between torch versions; a form matched by its nodes would lose
the rewrite silently when it changed.
"""

from __future__ import annotations

import functools
import operator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from graphcap_cuda import gemv

aten, prims = torch.ops.aten, torch.ops.prims
GEMV = torch.ops.graphcap_cuda.gemv.default
SPLITS = (aten.split_with_sizes.default, aten.split.Tensor)
CAST = prims.convert_element_type.default
ARGS = ("x", "weight", "bias", "residual", "gate", "gate_bias", "activation")
#: torch's definition of each of the kernel's activations (gemv.ACTIVATIONS), in fp32.
DEFINITIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}
#: Elementwise operators an activation's decomposition may be made of.
ELEMENTWISE = {
    CAST,
    *(getattr(aten, op).Tensor for op in ("mul", "add", "sub", "div")),
    *(getattr(aten, op).default for op in ("neg", "exp", "tanh", "sigmoid", "silu", "erf")),
    aten.gelu.default,
    aten.reciprocal.default,
    aten.pow.Tensor_Scalar,
}
#: The values an activation's nodes are evaluated on: where SiLU and GELU saturate and between.
PROBE = torch.linspace(-12.0, 12.0, 2401)


def _is(node: object, target: object) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target == target


def _value(node: object) -> torch.Tensor | None:
    return node.meta.get("val") if isinstance(node, Node) else None


def _arguments(node: Node) -> dict[str, object]:
    """A one-row product node's arguments, by name."""
    return dict(zip(ARGS, node.args, strict=False)) | node.kwargs


def _product(node: object) -> dict[str, object] | None:
    """The arguments of a plain one-row product node (no epilogue yet), by name."""
    if not _is(node, GEMV):
        return None
    args = _arguments(node)
    plain = all(args.get(name) is None for name in ("residual", "gate", "gate_bias"))
    return args if plain else None


def activation_of(act: Node) -> tuple[Node, str, list[Node]] | None:
    """``(v, name, nodes)`` where ``act`` computes the kernel's activation ``name`` of ``v``
    elementwise in ``v``'s dtype through ``nodes`` (``act`` included), else None."""
    nodes, sources, todo = [], [], [act]
    while todo:
        node = todo.pop()
        if node in nodes or node in sources:
            continue
        if node.op == "call_function" and node.target in ELEMENTWISE:
            nodes.append(node)
            todo.extend(node.all_input_nodes)
        else:
            sources.append(node)
    if len(sources) != 1 or _value(sources[0]) is None or _value(act) is None:
        return None
    (source,) = sources
    dtype = _value(source).dtype
    if _value(act).dtype != dtype or not dtype.is_floating_point:
        return None
    try:
        name = _identify(act, source, dtype)
    except Exception:  # an operand the probe cannot stand for: not an activation of v alone
        return None
    return None if name is None else (source, name, nodes)


def _identify(act: Node, source: Node, dtype: torch.dtype) -> str | None:
    """The kernel's activation ``act`` computes of ``source`` on :data:`PROBE`, if any."""
    probe = PROBE.to(dtype)
    got = _evaluate(act, source, probe, {}).float()
    tol = 2 * torch.finfo(dtype).eps
    for name in gemv.ACTIVATIONS:
        want = DEFINITIONS[name](probe.float()).to(dtype).float()
        if got.shape == want.shape and torch.allclose(got, want, rtol=tol, atol=tol):
            return name
    return None


def _evaluate(node: Node, source: Node, value: torch.Tensor, seen: dict) -> torch.Tensor:
    """``node``'s value when ``source`` holds ``value`` (the nodes between are elementwise)."""
    if node is source:
        return value
    if node not in seen:
        inputs = (node.args, node.kwargs)
        args, kwargs = map_arg(inputs, lambda n: _evaluate(n, source, value, seen))
        seen[node] = node.target(*args, **kwargs)
    return seen[node]


def _pieces(node: object) -> tuple[Node, int, int, int] | None:
    """(product, first row, rows, piece count) when ``node`` is a piece of a product split along
    its last dimension."""
    if not (_is(node, operator.getitem) and any(_is(node.args[0], s) for s in SPLITS)):
        return None
    split, index = node.args
    product, sizes, dim = (*split.args, -1)[:3]
    ndim = _value(product).dim() if _value(product) is not None else 0
    if _product(product) is None or dim % max(ndim, 1) != ndim - 1:
        return None
    rows = _value(product).shape[-1]
    if isinstance(sizes, int):
        sizes = [min(sizes, rows - i) for i in range(0, rows, sizes)]
    return product, sum(sizes[:index]), sizes[index], len(sizes)


def _only_feeds(nodes: list[Node], into: Node) -> bool:
    """Whether every use of ``nodes`` is another of them or ``into``."""
    inside = {*nodes, into}
    return all(user in inside for node in nodes for user in node.users)


def _rows(graph: Graph, tensor: object, first: int, count: int) -> object:
    """An FX node for rows ``[first, first + count)`` of ``tensor`` (None stays None)."""
    if tensor is None:
        return None
    node = graph.call_function(aten.slice.Tensor, (tensor, 0, first, first + count))
    node.meta["val"] = _value(tensor)[first : first + count]
    return node


def _fuse_gate(graph: Graph, mul: Node) -> bool:
    if len(mul.args) != 2 or mul.kwargs:
        return False
    for act, up in (mul.args, mul.args[::-1]):
        found = activation_of(act) if isinstance(act, Node) else None
        if found is None or not isinstance(up, Node):
            continue
        gate, activation, nodes = found
        split_gate, split_up = _pieces(gate), _pieces(up)
        if split_gate and split_up and split_gate[0] is split_up[0] and split_gate[3] == 2:
            product = split_gate[0]
            args = _product(product) | {"activation": activation}
            gate_rows, up_rows = split_gate[1:3], split_up[1:3]
            inner = [product, gate.args[0], gate, up, *nodes]
            if gate_rows[1] != up_rows[1] or not _only_feeds(inner, mul):
                continue
            with graph.inserting_before(mul):
                new = dict(args)
                new["weight"] = _rows(graph, args["weight"], *up_rows)
                new["bias"] = _rows(graph, args.get("bias"), *up_rows)
                new["gate"] = _rows(graph, args["weight"], *gate_rows)
                new["gate_bias"] = _rows(graph, args.get("bias"), *gate_rows)
                return _replace(graph, mul, new)
        gate_args, up_args = _product(gate), _product(up)
        if gate_args and up_args and gate_args["x"] is up_args["x"]:
            if not _only_feeds([gate, up, *nodes], mul):
                continue
            with graph.inserting_before(mul):
                new = dict(up_args, gate=gate_args["weight"], gate_bias=gate_args.get("bias"))
                return _replace(graph, mul, new | {"activation": activation})
    return False


def _fuse_residual(graph: Graph, add: Node) -> bool:
    if len(add.args) != 2 or add.kwargs:
        return False
    for product, other in (add.args, add.args[::-1]):
        if not _is(product, GEMV) or not isinstance(other, Node) or len(product.users) != 1:
            continue
        args = _arguments(product)
        mine, theirs = _value(product), _value(other)
        if args.get("residual") is not None or mine is None or theirs is None:
            continue
        if not _same_static_shape(mine, theirs) or mine.dtype != theirs.dtype:
            continue  # a broadcast or a type promotion is not the kernel's add
        with graph.inserting_before(add):
            return _replace(graph, add, dict(args, residual=other))
    return False


def _same_static_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes of plain sizes (a symbolic size is never matched: no guard is added)."""
    sizes = (*a.shape, *b.shape)
    return all(isinstance(size, int) for size in sizes) and tuple(a.shape) == tuple(b.shape)


def _replace(graph: Graph, old: Node, args: dict[str, object]) -> bool:
    values = [args.get(name) for name in ARGS]
    while values[-1] is None:  # unset trailing arguments keep the operator's defaults
        values.pop()
    new = graph.call_function(GEMV, tuple(values))
    new.meta["val"] = _value(old)
    old.replace_all_uses_with(new)
    graph.erase_node(old)
    return True


class GemvEpilogues(CustomGraphPass):
    """The pass, for inductor's ``post_grad_custom_post_pass``; ``fused`` counts what it
    rewrote (tests and benchmarks read it)."""

    def __init__(self) -> None:
        self.fused = {"gate": 0, "residual": 0}

    def __call__(self, graph: Graph) -> None:
        for node in list(graph.nodes):
            if _is(node, aten.mul.Tensor):
                self.fused["gate"] += _fuse_gate(graph, node)
        for node in list(graph.nodes):
            if _is(node, aten.add.Tensor):
                self.fused["residual"] += _fuse_residual(graph, node)
        graph.eliminate_dead_code()

    def uuid(self) -> bytes:
        """Inductor's cache key: this file and the kernel's."""
        return get_hash_for_files((__file__, str(Path(__file__).with_name("gemv.py"))))


#: The instance the CUDA backend's compile options carry.
PASS = GemvEpilogues()
