"""An inductor graph pass that moves the one-row product's neighbours into it.

In a batch-1 compiled step, :func:`graphcap_cuda.kernels.gemv.gemv` is a custom op: inductor cannot
fuse the elementwise work around it into it, so that work is a kernel of its own. A step's profile
showed two per layer: a gated MLP's ``silu(gate) * up`` between the gate/up product and the down
product, and the residual add after the down product (the next layer's norm is in another compiled
frame, so it cannot take the add; docs/decisions.md, decision 23). This pass rewrites, in the
post-grad graph of every region ``compile=True`` compiles:

- ``act(gemv(x, Wg)) * gemv(x, Wu)``, with the two products joined as one (``fuse_projections``:
  one product split in two) or not, into one ``gemv(x, Wu, gate=Wg, activation=...)``;
- ``gemv(...) + r``, where ``r`` has the product's shape and dtype, into ``gemv(..., residual=r)``;
- ``gemv(norm(s), ...)``, an RMSNorm of ``s`` feeding only products, into
  ``gemv(s, ..., norm=...)``; where ``s = a + b`` feeds nothing else but residuals of products,
  the add moves into them too (``addend``, ``residual_addend``), so the add and norm after
  attention, one kernel, are gone (each kernel that reads ``s`` adds ``a + b`` itself).

Only products whose every use is the pattern are rewritten, so no weight is read twice. The
kernel rounds each intermediate to the activation dtype where the eager ops round it.

``act`` and ``norm`` are recognised by what they compute, not by how they are written: the
nodes between the product and its source are evaluated on probe values and compared with each
activation (SiLU, tanh-approximated GELU) and norm (Llama's RMSNorm, Gemma's) the kernel has.
Inductor decomposes them into a few primitive ops whose form differs between torch versions; a
form matched by its nodes would lose the rewrite silently when it changed.
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

from graphcap_cuda.kernels import gemv

aten, prims = torch.ops.aten, torch.ops.prims
GEMV = torch.ops.graphcap_cuda.gemv.default
SPLITS = (aten.split_with_sizes.default, aten.split.Tensor)
CAST = prims.convert_element_type.default
ARGS = ("x", "weight", "bias", "residual", "gate", "gate_bias", "activation")
ARGS += ("norm", "norm_weight", "eps", "addend", "residual_addend")
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
#: What an RMSNorm's decomposition may be made of besides elementwise operators.
NORM_OPS = ELEMENTWISE | {
    aten.mean.dim,
    aten.sum.dim_IntList,
    aten.rsqrt.default,
    aten.sqrt.default,
    aten.add.Scalar,
    aten.mul.Scalar,
}
#: Whether the pass moves norms (and the adds before them) into products (benchmarks turn it
#: off to time the step without it).
FOLD_NORMS = True
#: Scales of the inputs a norm's nodes are evaluated on: small enough that eps matters.
NORM_SCALES = (1e-3, 1.0, 30.0)


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


#: torch's form of each of the kernel's norms (gemv.NORMS): transformers' Llama and Gemma
#: RMSNorms of ``x`` with weight ``w``.
NORM_DEFINITIONS = {
    "rms": lambda x, w, eps: w * (x.float() * _rstd(x, eps)).to(x.dtype),
    "rms_one_plus": lambda x, w, eps: (x.float() * _rstd(x, eps) * (1.0 + w.float())).to(x.dtype),
}


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


def _cone(top: Node, ops: set, stop: Node | None = None) -> tuple[list[Node], list[Node]]:
    """(nodes, sources): the nodes of ``ops`` that ``top`` is computed from (``top`` included)
    and what they read that is not one of them (``stop`` is read, not entered)."""
    nodes, sources, todo = [], [], [top]
    while todo:
        node = todo.pop()
        if node in nodes or node in sources:
            continue
        if node is not stop and node.op == "call_function" and node.target in ops:
            nodes.append(node)
            todo.extend(node.all_input_nodes)
        else:
            sources.append(node)
    return nodes, sources


def activation_of(act: Node) -> tuple[Node, str, list[Node]] | None:
    """``(v, name, nodes)`` where ``act`` computes the kernel's activation ``name`` of ``v``
    elementwise in ``v``'s dtype through ``nodes`` (``act`` included), else None."""
    nodes, sources = _cone(act, ELEMENTWISE)
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
    got = _evaluate(act, {source: probe}, {}).float()
    tol = 2 * torch.finfo(dtype).eps
    for name in gemv.ACTIVATIONS:
        want = DEFINITIONS[name](probe.float()).to(dtype).float()
        if got.shape == want.shape and torch.allclose(got, want, rtol=tol, atol=tol):
            return name
    return None


def norm_of(x: Node) -> tuple[Node, Node, str, float, list[Node]] | None:
    """``(s, w, name, eps, nodes)`` where ``x`` is the kernel's norm ``name`` of ``s`` (x's shape
    and dtype) with weight ``w`` (a vector of x's last size and dtype) computed through
    ``nodes``, else None. Which node is ``s`` is tried node by node: the probe decides."""
    mine = _value(x)
    if mine is None or not mine.dtype.is_floating_point or not _static(mine):
        return None
    nodes, sources = _cone(x, NORM_OPS)
    weights = [n for n in sources if _is_vector(_value(n), mine)]
    for source in [n for n in nodes[1:] + sources if _like(_value(n), mine)]:
        inner, reads = _cone(x, NORM_OPS, stop=source)
        others = [n for n in reads if n is not source]
        if len(others) != 1 or others[0] not in weights:
            continue
        found = _identify_norm(x, source, others[0], inner)
        if found is not None:
            return source, others[0], *found, inner
    return None


def _identify_norm(x: Node, source: Node, weight: Node, nodes: list[Node]) -> tuple | None:
    """``(name, eps)`` of the kernel's norm ``x`` computes of ``source`` on probe values, with
    ``eps`` one of the numbers the nodes hold, if any."""
    shape, dtype = _value(x).shape, _value(x).dtype
    generator = torch.Generator().manual_seed(0)
    w = (torch.randn(shape[-1], generator=generator) * 0.5).to(dtype)
    probes = [(torch.randn(shape, generator=generator) * s).to(dtype) for s in NORM_SCALES]
    numbers = {a for n in nodes for a in n.args if isinstance(a, float) and 0 < a < 1}
    tol = max(2 * torch.finfo(dtype).eps, 1e-5)
    try:
        got = [_evaluate(x, {source: p, weight: w}, {}).float() for p in probes]
    except Exception:  # an operand the probe cannot stand for: not a norm of source alone
        return None
    for name, define in NORM_DEFINITIONS.items():
        for eps in sorted(numbers):
            want = [define(p, w, eps).float() for p in probes]
            if all(
                g.shape == v.shape and torch.allclose(g, v, rtol=tol, atol=tol)
                for g, v in zip(got, want, strict=True)
            ):
                return name, eps
    return None


def _static(value: torch.Tensor) -> bool:
    return all(isinstance(size, int) for size in value.shape)


def _like(value: torch.Tensor | None, mine: torch.Tensor) -> bool:
    return value is not None and value.dtype == mine.dtype and _same_static_shape(value, mine)


def _is_vector(value: torch.Tensor | None, mine: torch.Tensor) -> bool:
    return (
        value is not None and value.dtype == mine.dtype and tuple(value.shape) == (mine.shape[-1],)
    )


def _evaluate(node: Node, values: dict[Node, torch.Tensor], seen: dict) -> torch.Tensor:
    """``node``'s value when the nodes of ``values`` hold theirs (the nodes between are pure
    operators)."""
    if node in values:
        return values[node]
    if node not in seen:
        inputs = (node.args, node.kwargs)
        args, kwargs = map_arg(inputs, lambda n: _evaluate(n, values, seen))
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


def _only_feeds(nodes: list[Node], *into: Node) -> bool:
    """Whether every use of ``nodes`` is another of them or one of ``into``."""
    inside = {*nodes, *into}
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
            _replace(graph, mul, new)
            return True
        gate_args, up_args = _product(gate), _product(up)
        if gate_args and up_args and gate_args["x"] is up_args["x"]:
            if not _only_feeds([gate, up, *nodes], mul):
                continue
            new = dict(up_args, gate=gate_args["weight"], gate_bias=gate_args.get("bias"))
            _replace(graph, mul, new | {"activation": activation})
            return True
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
        _replace(graph, add, dict(args, residual=other))
        return True
    return False


def _fold_norm(graph: Graph, x: Node) -> tuple[int, int]:
    """Moves the norm computing ``x`` into every product ``x`` feeds, and the add computing the
    norm's input where only residuals of products read it besides; (norms, sums) moved."""
    users = list(x.users)
    takes_x = [u for u in users if _is(u, GEMV) and _arguments(u)["x"] is x]
    if not users or len(takes_x) != len(users):
        return 0, 0
    if any(_arguments(u).get(name) is not None for u in users for name in ("norm", "addend")):
        return 0, 0
    found = norm_of(x)
    if found is None:
        return 0, 0
    source, weight, name, eps, nodes = found
    if not _only_feeds(nodes, *users):
        return 0, 0
    parts = _sum_parts(source, nodes)
    if parts is None and _inductor_computes(source):
        return 0, 0  # its own kernel stays: nothing would be saved
    a, b, residuals = parts if parts is not None else (source, None, [])
    norm = {"x": a, "norm": name, "norm_weight": weight, "eps": eps, "addend": b}
    renamed = {user: _replace(graph, user, _arguments(user) | norm) for user in users}
    for user in residuals:  # a product may read the sum both ways: its new node then
        user = renamed.get(user, user)
        _replace(graph, user, _arguments(user) | {"residual": a, "residual_addend": b})
    return 1, int(parts is not None)


def _sum_parts(source: Node, nodes: list[Node]) -> tuple[Node, Node, list[Node]] | None:
    """``(a, b, products)`` when ``source`` is ``a + b`` (same shape and dtype, no broadcast)
    read only by ``nodes`` and as the plain residual of ``products``."""
    if not _is(source, aten.add.Tensor) or len(source.args) != 2 or source.kwargs:
        return None
    a, b = source.args
    if not all(isinstance(n, Node) and _like(_value(n), _value(source)) for n in (a, b)):
        return None
    residuals = [u for u in source.users if u not in nodes]
    for user in residuals:
        args = _arguments(user) if _is(user, GEMV) else {}
        if args.get("residual") is not source or args.get("residual_addend") is not None:
            return None
        if any(value is source for name, value in args.items() if name != "residual"):
            return None
    return a, b, residuals


def _inductor_computes(node: Node) -> bool:
    """Whether inductor computes ``node`` in a kernel of its own here (not an input or a
    product)."""
    return node.op == "call_function" and node.target in NORM_OPS


def _same_static_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes of plain sizes (a symbolic size is never matched: no guard is added)."""
    sizes = (*a.shape, *b.shape)
    return all(isinstance(size, int) for size in sizes) and tuple(a.shape) == tuple(b.shape)


def _replace(graph: Graph, old: Node, args: dict[str, object]) -> Node:
    """A product node with ``args`` in place of ``old`` (which it replaces in every use)."""
    given = {name: value for name, value in args.items() if value is not None}
    x, weight = given.pop("x"), given.pop("weight")  # unset arguments keep the op's defaults
    with graph.inserting_before(old):
        new = graph.call_function(GEMV, (x, weight), given)
    new.meta["val"] = _value(old)
    old.replace_all_uses_with(new)
    graph.erase_node(old)
    return new


class GemvEpilogues(CustomGraphPass):
    """The pass, for inductor's ``post_grad_custom_post_pass``; ``fused`` counts what it
    rewrote (tests and benchmarks read it)."""

    def __init__(self) -> None:
        self.fused = {"gate": 0, "residual": 0, "norm": 0, "sum": 0}

    def __call__(self, graph: Graph) -> None:
        for node in list(graph.nodes):
            if _is(node, aten.mul.Tensor):
                self.fused["gate"] += _fuse_gate(graph, node)
        for node in list(graph.nodes):
            if _is(node, aten.add.Tensor):
                self.fused["residual"] += _fuse_residual(graph, node)
        inputs = {_arguments(n)["x"] for n in graph.nodes if _is(n, GEMV)} if FOLD_NORMS else ()
        for x in [n for n in graph.nodes if n in inputs]:
            norms, sums = _fold_norm(graph, x)
            self.fused["norm"] += norms
            self.fused["sum"] += sums
        graph.eliminate_dead_code()

    def uuid(self) -> bytes:
        """Inductor's cache key: this file, the kernel's and whether norms move."""
        files = get_hash_for_files((__file__, str(Path(__file__).with_name("gemv.py"))))
        return files + bytes([FOLD_NORMS])


#: The instance the CUDA backend's compile options carry.
PASS = GemvEpilogues()
