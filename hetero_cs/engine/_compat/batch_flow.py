"""Which tensors of a replica step hold one row per example: the batch-flow analysis of a traced graph.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches (it reads the graphs of
``tf.while_loop``, ``tf.cond`` and nested ``tf.function`` calls through the attributes TensorFlow's own gradient code
reads).

A replica computes on its slice of the global batch. One device would run the same ops on the whole batch, and the
split equals it only where each example's values are computed from that example alone. This module proves that, op
by op, from the replica's inputs (:meth:`BatchFlow.kind`), and gives every tensor one of these kinds:

* ``REP``: the same on every replica and on one device (weights, constants, the step's global batch size,
  all-reduced sums);
* ``ROWS``: one device's value is the replicas' values concatenated along ``axis`` (per-example values; a subset of
  them picked by the data, such as ``tf.boolean_mask``, keeps this kind with a tag of its own);
* ``COUNT``: the number of rows of a ``ROWS`` tensor on this replica (``tf.shape(x)[0]``); ``SHAPE``: a shape vector
  holding one;
* ``AGG``: a value computed from the slice's rows together (a sum or a mean over the batch axis, and what is computed
  from it): one device's value is not this replica's. The loss reader
  (:mod:`hetero_cs.engine._compat.loss_reader`) turns the linear ones into exact shares;
* ``MIXED``: examples meet in a way no split reproduces (a ``[b, b]`` matrix of pairs, a batch statistic subtracted
  from each example, rows picked by position); the kind names the op and why.

The rules are a whitelist: an op this module does not know gives ``MIXED`` with its type named, so a program is
refused rather than trusted.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any

import numpy as np
import tensorflow as tf

REP, ROWS, AGG, COUNT, SHAPE, INDEX, LIST, MIXED = "rep", "rows", "agg", "count", "shape", "index", "list", "mixed"


@dataclasses.dataclass(frozen=True)
class Tag:
    """Which rows a ``ROWS`` tensor holds: ``per_example`` rows for each example of ``root`` (the replica's batch),
    or the rows of a subset the data picked (``root`` is then that op's name)."""

    root: Any
    per_example: Fraction | None = Fraction(1)  # None: a fixed number not known while tracing
    ordered: bool = True  # False: rows of several tensors concatenated, one device's order differs (sums are alike)


def same_rows(a: Tag | None, b: Tag | None) -> bool:
    """True when two tags name the same rows (a number per example not known while tracing matches any)."""
    if a is None or b is None:
        return a is b
    return a.root == b.root and (a.per_example == b.per_example or None in (a.per_example, b.per_example))


@dataclasses.dataclass(frozen=True)
class Kind:
    what: str
    axis: int = 0
    tag: Tag | None = None
    element: "Kind | None" = None  # LIST: the kind of its elements
    reason: str = ""  # MIXED: the op and why

    def __repr__(self) -> str:
        if self.what == ROWS:
            return f"rows(axis={self.axis})"
        return self.what if self.what != MIXED else f"mixed({self.reason})"


_REP = Kind(REP)
_AGG = Kind(AGG)


def mixed(op, why: str) -> Kind:
    return Kind(MIXED, reason=f"{op.type} op {op.name!r} {why}")


def join(a: Kind | None, b: Kind | None) -> Kind | None:
    """The kind a loop variable or a conditional's output has when it may be ``a`` or ``b``."""
    if a is None or a == b:
        return b
    if b is None:
        return a
    for first, second in ((a, b), (b, a)):
        if first.what == MIXED:
            return first
        if first.what == REP:
            return second
    if a.what == LIST and b.what == LIST:
        return Kind(LIST, element=join(a.element, b.element))
    if {a.what, b.what} <= {AGG, COUNT}:
        return _AGG
    return Kind(MIXED, reason=f"a value that is {a} on one path and {b} on another")


_PASS_THROUGH = frozenset({
    "Identity", "Snapshot", "StopGradient", "PreventGradient", "CheckNumerics", "CheckNumericsV2", "EnsureShape",
    "Cast", "Bitcast",
})
_UNARY = frozenset({
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Cos", "Cosh", "Digamma", "Elu", "Erf", "Erfc",
    "Erfinv", "Exp", "Expm1", "Floor", "Gelu", "Inv", "Invert", "IsFinite", "IsInf", "IsNan", "LeakyRelu", "Lgamma",
    "Log", "Log1p", "LogicalNot", "Neg", "Ndtri", "OnesLike", "Reciprocal", "Relu", "Relu6", "Rint", "Round",
    "Rsqrt", "Selu", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus", "Softsign", "Sqrt", "Square", "Tan", "Tanh",
    "ZerosLike", "Real", "Imag", "Angle", "Conj", "ComplexAbs", "AsString", "StringToNumber",
})
_ELEMENTWISE = frozenset({
    "Add", "AddV2", "AddN", "Sub", "Mul", "MulNoNan", "Div", "RealDiv", "DivNoNan", "FloorDiv", "FloorMod",
    "TruncateDiv", "TruncateMod", "Mod", "Maximum", "Minimum", "Pow", "SquaredDifference", "Xlogy", "Xdivy",
    "Xlog1py", "Atan2", "Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual", "LogicalAnd",
    "LogicalOr", "Select", "SelectV2", "BiasAdd", "ApproximateEqual", "ClipByValue", "BitwiseAnd", "BitwiseOr",
    "BitwiseXor", "LeftShift", "RightShift", "Complex", "Igamma", "Igammac", "Betainc", "Zeta", "Polygamma",
    "SigmoidGrad", "TanhGrad", "ReluGrad", "SoftplusGrad", "RsqrtGrad", "SqrtGrad", "ReciprocalGrad", "EluGrad",
    "SeluGrad", "Relu6Grad", "LeakyReluGrad", "GeluGrad",
})
_REDUCTIONS = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm"})
_ALONG_AXIS = frozenset({"ArgMax", "ArgMin", "Cumsum", "Cumprod", "CumulativeLogsumexp"})
_LAST_AXIS = frozenset({"Softmax", "LogSoftmax", "TopKV2", "InTopKV2"})
_CONVOLUTIONS = frozenset({
    "Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv", "MaxPool", "MaxPoolV2", "AvgPool", "MaxPool3D", "AvgPool3D",
    "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "Dilation2D", "LRN", "ResizeBilinear",
    "ResizeNearestNeighbor", "ResizeBicubic", "ResizeArea", "DepthToSpace", "SpaceToDepth",
})
_RANDOM = frozenset({
    "RandomUniform", "RandomStandardNormal", "TruncatedNormal", "RandomUniformInt", "StatelessRandomUniformV2",
    "StatelessRandomNormalV2", "StatelessTruncatedNormalV2", "StatelessRandomUniformIntV2",
    "StatelessRandomUniformFullIntV2", "StatelessRandomUniform", "StatelessRandomNormal",
    "StatelessTruncatedNormal", "StatelessRandomBinomial", "Fill",
})
_CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
_PYTHON = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})
_WHILES = frozenset({"While", "StatelessWhile"})
_CONDS = frozenset({"If", "StatelessIf", "Case", "StatelessCase"})
# Ops that only describe a tensor (its shape or type), whose outputs say nothing about its values.
_SHAPE_OF = frozenset({"Shape", "ShapeN"})
_NO_DATA = frozenset({"Rank", "VarIsInitializedOp", "TensorListLength", "TensorListElementShape"})


_ARITHMETIC = {"Sub": np.subtract, "AddV2": np.add, "Add": np.add, "Mul": np.multiply, "FloorMod": np.mod,
               "Maximum": np.maximum, "Minimum": np.minimum, "FloorDiv": np.floor_divide}


def _static(tensor):
    """The value of a tensor that tracing can compute (TensorFlow's constant folding, a rank, shape entries known
    statically, integer arithmetic on those), else None."""
    try:
        value = tf.get_static_value(tensor)
    except (TypeError, ValueError):
        value = None
    if value is not None:
        return value
    op = tensor.op
    if op.type == "Rank" and op.inputs[0].shape.rank is not None:
        return np.int32(op.inputs[0].shape.rank)
    if op.type in ("Identity", "Cast") and op.inputs:
        inner = _static(op.inputs[0])
        return None if inner is None else np.asarray(inner).astype(tensor.dtype.as_numpy_dtype)
    if op.type in _ARITHMETIC and len(op.inputs) == 2:
        a, b = _static(op.inputs[0]), _static(op.inputs[1])
        return None if a is None or b is None else _ARITHMETIC[op.type](a, b)
    if op.type == "Pack":
        values = [_static(t) for t in op.inputs]
        return None if any(v is None for v in values) else np.stack(values, axis=op.get_attr("axis"))
    if op.type == "StridedSlice" and op.inputs[0].op.type == "Shape" and op.get_attr("shrink_axis_mask") == 1:
        index, dims = _static(op.inputs[1]), op.inputs[0].op.inputs[0].shape
        if index is not None and dims.rank is not None:
            dim = dims[int(np.ravel(index)[0])]
            return None if dim is None else np.int32(dim)
    return None


def _entries(tensor) -> list | None:
    """A shape vector's entries (ints, None where not known while tracing), or None when its length is unknown."""
    value = _static(tensor)
    if value is not None:
        return [int(v) for v in np.ravel(value)]
    op = tensor.op
    if op.type == "Pack":
        return [None if (v := _static(t)) is None else int(v) for t in op.inputs]
    if op.type == "ConcatV2":
        parts = [_entries(t) for t in op.inputs[:-1]]
        return None if any(p is None for p in parts) else [v for p in parts for v in p]
    if op.type == "Shape" and op.inputs[0].shape.rank is not None:
        return op.inputs[0].shape.as_list()
    if op.type == "Slice":  # part of a shape vector (the last axis of logits, for a softmax over classes)
        whole, begin, size = _entries(op.inputs[0]), _static(op.inputs[1]), _static(op.inputs[2])
        if whole is not None and begin is not None and size is not None:
            start, length = int(np.ravel(begin)[0]), int(np.ravel(size)[0])
            return whole[start:] if length < 0 else whole[start:start + length]
    if tensor.shape.rank == 1 and tensor.shape[0] is not None:
        return [None] * tensor.shape[0]
    return None


def _axes(tensor, rank: int | None) -> list[int] | None:
    value = _static(tensor)
    if value is None or rank is None:
        return None
    return [int(a) % max(rank, 1) for a in np.ravel(value)]


def _rank(tensor) -> int | None:
    return tensor.shape.rank


@dataclasses.dataclass(frozen=True)
class _Scope:
    """A graph being read with its inputs' kinds (the graph is kept alive, so its id stays its own)."""

    key: Any
    graph: Any = None
    inputs: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)


_TOP = _Scope(None)


class BatchFlow:
    """The batch-flow analysis of one replica step: seeds (what the strategy knows) and the kinds derived from them.

    Args:
        replica_id: For messages.
    """

    def __init__(self, replica_id: int = 0):
        self.replica_id = replica_id
        self.batch = Tag(("batch", replica_id))
        self._seeds: dict = {}  # tensor ref -> Kind
        self._memo: dict = {}  # (scope key, tensor ref) -> Kind
        self._scopes: list = []

    # -- seeds ------------------------------------------------------------------------------------------------------
    def seed(self, tensors, kind: Kind) -> None:
        for tensor in tf.nest.flatten(tensors, expand_composites=True):
            if isinstance(tensor, tf.Tensor):
                self._seeds[tensor.ref()] = kind

    def seed_rows(self, tensors) -> None:
        """``tensors`` hold this replica's examples along their first axis (its slice of the batch)."""
        for tensor in tf.nest.flatten(tensors, expand_composites=True):
            if isinstance(tensor, tf.Tensor):
                rows = tensor.shape.rank is None or tensor.shape.rank >= 1
                self._seeds[tensor.ref()] = Kind(ROWS, 0, self.batch) if rows else _REP

    def seed_replicated(self, tensors) -> None:
        """``tensors`` are the same on every replica and equal to one device's values (e.g. all-reduced sums)."""
        self.seed(tensors, _REP)

    def seed_count(self, tensor) -> None:
        """``tensor`` is the number of this replica's examples (``b_i``)."""
        self.seed(tensor, Kind(COUNT, tag=self.batch))

    def rows_proportional(self, kind: Kind) -> bool:
        """True for rows whose number is a fixed multiple of the replica's examples (so of ``b_i / B``)."""
        return kind.what == ROWS and kind.tag is not None and kind.tag.root == self.batch.root

    # -- analysis ---------------------------------------------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def kind(self, tensor, scope: "_Scope | None" = None) -> Kind:
        """The kind of graph tensor ``tensor`` (see the module docstring); ``scope`` gives a nested function graph's
        inputs their kinds."""
        if not isinstance(tensor, tf.Tensor) or not hasattr(tensor, "op"):
            return _REP  # a Python number or a NumPy array: a constant
        scope = scope or _TOP
        stack = [tensor]
        while stack:
            current = stack[-1]
            if (scope.key, current.ref()) in self._memo:
                stack.pop()
                continue
            known = self._known(current, scope)
            if known is not None:
                self._memo[(scope.key, current.ref())] = known
                stack.pop()
                continue
            inputs = list(current.op.inputs)
            pending = [t for t in inputs if (scope.key, t.ref()) not in self._memo]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            kinds = [self._memo[(scope.key, t.ref())] for t in inputs]
            for output, kind in zip(current.op.outputs, self._rule(current.op, kinds)):
                self._memo[(scope.key, output.ref())] = kind
        return self._memo[(scope.key, tensor.ref())]

    def _known(self, tensor, scope) -> Kind | None:
        ref = tensor.ref()
        if ref in scope.inputs:
            return scope.inputs[ref]
        if ref in self._seeds:
            return self._seeds[ref]
        op = tensor.op
        if op.type == "Placeholder":
            return self._placeholder(tensor)
        if tensor.dtype == tf.resource:
            return _REP  # a variable's handle: variables live once, read alike by every replica
        if op.type == "Const" or not op.inputs and op.type in ("VarHandleOp", "NoOp"):
            return _REP
        if op.type == "EmptyTensorList":
            return Kind(LIST)
        return None

    def _placeholder(self, tensor) -> Kind:
        # A function graph's input: follow its capture to the outer graph (FuncGraph.captures: outer, inner pairs).
        graph = tensor.graph
        for outer, inner in getattr(graph, "captures", ()):
            if inner is tensor:
                return self.kind(outer)
        return Kind(MIXED, reason=f"an input {tensor.name!r} of a function hetero_cs cannot trace back to the step")

    # -- rules ------------------------------------------------------------------------------------------------------
    def _rule(self, op, kinds: list[Kind]) -> list[Kind]:
        outputs = len(op.outputs)
        if not outputs:
            return []
        broken = next((k for k in kinds if k.what == MIXED), None)
        t = op.type
        if t in _CALLS:
            return self._call(op, kinds)
        if t in _WHILES:
            return self._while(op, kinds)
        if t in _CONDS:
            return self._cond(op, kinds)
        if broken is not None:
            return [broken] * outputs
        if t in _LISTS:
            return [_LISTS[t](self, op, [Kind(LIST) if k.what == REP and i == 0 else k
                                         for i, k in enumerate(kinds)])] * outputs
        if all(k.what == REP for k in kinds) and t not in _RANDOM:
            return [_REP] * outputs
        handler = _HANDLERS.get(t)
        if handler is not None:
            result = handler(self, op, kinds)
            return result if isinstance(result, list) else [result] * outputs
        if t in _PASS_THROUGH or t in _UNARY:
            return [kinds[0]] * outputs
        if t in _ELEMENTWISE:
            return [self._elementwise(op, kinds)] * outputs
        if t in _REDUCTIONS:
            return [self._reduction(op, kinds)] * outputs
        if t in _CONVOLUTIONS:
            return [self._convolution(op, kinds)] * outputs
        if t in _RANDOM:
            return [self._filled(op, kinds)] * outputs
        if t in _ALONG_AXIS:
            return [self._along_axis(op, kinds)] * outputs
        if t in _LAST_AXIS:
            return [self._last_axis(op, kinds)] * outputs
        if t in _NO_DATA:
            return [_REP] * outputs
        if t in _PYTHON:
            return [mixed(op, "runs Python code (tf.py_function, tf.numpy_function), whose computation hetero_cs "
                              "cannot read; write it in TensorFlow ops, or, if it works example by example, mark "
                              "its output with hetero_cs.per_example(...)")] * outputs
        return [mixed(op, "is not an op hetero_cs knows (it cannot tell whether it keeps examples apart); if it "
                          "computes each example from that example alone, mark its output with "
                          "hetero_cs.per_example(...)")] * outputs

    def _elementwise(self, op, kinds) -> Kind:
        rank = _rank(op.outputs[0])
        rows = []
        for tensor, kind in zip(op.inputs, kinds):
            if kind.what == REP:
                continue
            if kind.what in (AGG, COUNT):
                rows.append(_AGG)
                continue
            if kind.what != ROWS or rank is None or _rank(tensor) is None:
                return mixed(op, f"combines a {kind} value element by element")
            rows.append(dataclasses.replace(kind, axis=kind.axis + rank - _rank(tensor)))
        if any(k.what == ROWS for k in rows):
            if any(k.what != ROWS for k in rows):
                return mixed(op, "combines each example's values with a value computed from the whole slice (a "
                                 "batch statistic): one device would use the whole batch's")
            first = rows[0]
            if any(k.axis != first.axis or not same_rows(k.tag, first.tag) for k in rows):
                return mixed(op, "pairs values of different examples (their rows do not line up)")
            return first
        return _AGG

    def _reduction(self, op, kinds) -> Kind:
        kind = kinds[0]
        if kind.what == SHAPE and op.type == "Prod":  # a number of elements: a fixed multiple of the rows
            return Kind(COUNT, tag=Tag(kind.tag.root, None))
        if kind.what in (AGG, COUNT, SHAPE):
            return _AGG
        if kind.what != ROWS:
            return mixed(op, f"reduces a {kind} value")
        rank = _rank(op.inputs[0])
        axes = _axes(op.inputs[1], rank)
        if axes is None:
            return mixed(op, "reduces along axes not known while tracing")
        if kind.axis in axes:
            return _AGG
        keep = op.get_attr("keep_dims") if "keep_dims" in op.node_def.attr else False
        return dataclasses.replace(kind, axis=kind.axis if keep else kind.axis - sum(a < kind.axis for a in axes))

    def _along_axis(self, op, kinds) -> Kind:
        kind = kinds[0]
        if kind.what != ROWS:
            return _AGG if kind.what in (AGG, COUNT) else mixed(op, f"works along an axis of a {kind} value")
        axes = _axes(op.inputs[1], _rank(op.inputs[0]))
        if axes is None or kind.axis in axes:
            return mixed(op, "works along the batch axis (its result for one example depends on the others)")
        if op.type in ("ArgMax", "ArgMin"):
            return dataclasses.replace(kind, axis=kind.axis - (axes[0] < kind.axis))
        return kind

    def _last_axis(self, op, kinds) -> Kind:
        kind = kinds[0]
        if kind.what == ROWS and _rank(op.inputs[0]) is not None and kind.axis != _rank(op.inputs[0]) - 1:
            if any(k.what not in (REP,) for k in kinds[1:]) and op.type != "InTopKV2":
                return mixed(op, "combines values of other kinds")
            return kind
        if kind.what in (AGG, COUNT):
            return _AGG
        return mixed(op, "works along the batch axis (its result for one example depends on the others)")

    def _convolution(self, op, kinds) -> Kind:
        kind = kinds[0]
        if kind.what == ROWS and kind.axis == 0 and all(k.what == REP for k in kinds[1:]):
            if op.type.startswith("FusedBatchNorm") and op.get_attr("is_training"):
                return mixed(op, "normalises each example by its slice's statistics")
            return kind
        return mixed(op, "slides over the batch axis or takes weights that depend on the examples")

    def _filled(self, op, kinds) -> Kind:
        shape = kinds[0]
        if shape.what == REP:
            return _REP
        if shape.what == SHAPE:
            return Kind(ROWS, shape.axis, shape.tag)
        return mixed(op, "makes a tensor of a shape computed from the examples' values")

    # -- nested graphs ----------------------------------------------------------------------------------------------
    def _run_graph(self, graph, input_kinds: list[Kind]) -> list[Kind]:
        scope = _Scope((id(graph), tuple(input_kinds)), graph,
                       {inner.ref(): kind for inner, kind in zip(graph.inputs, input_kinds)})
        self._scopes.append(scope)  # keeps the graph alive while its id is in a memo key
        return [self.kind(output, scope) for output in graph.outputs]

    def _call(self, op, kinds) -> list[Kind]:
        try:
            function = op.graph._get_function(op.get_attr("f").name)  # noqa: SLF001 - the callee's FuncGraph
            graph = function.graph
        except (AttributeError, ValueError, TypeError, KeyError):
            return [mixed(op, "calls a function hetero_cs cannot read")] * len(op.outputs)
        return self._run_graph(graph, kinds)

    def _while(self, op, kinds) -> list[Kind]:
        body = getattr(op, "_body_graph", None)  # noqa: SLF001 - set by while_v2 for its gradient
        if body is None:
            return [mixed(op, "is a loop hetero_cs cannot read")] * len(op.outputs)
        current, settled = list(kinds), False
        for _ in range(8):  # the lattice is shallow: a fixed point within a few passes
            joined = [join(a, b) for a, b in zip(current, self._run_graph(body, current))]
            settled, current = joined == current, joined
            if settled:
                break
        if not settled:
            return [mixed(op, "is a loop whose values hetero_cs cannot settle")] * len(op.outputs)
        cond = getattr(op, "_cond_graph", None)  # noqa: SLF001
        if cond is not None:
            predicate = self._run_graph(cond, current)[0]
            if predicate.what not in (REP,):
                return [mixed(op, "loops a number of times that depends on the examples")] * len(op.outputs)
        return current

    def _cond(self, op, kinds) -> list[Kind]:
        if kinds[0].what not in (REP,):
            return [mixed(op, "takes a branch that depends on the examples")] * len(op.outputs)
        names = (["_true_graph", "_false_graph"] if op.type.endswith("If")
                 else [f"_branch_graph_{i}" for i in range(len(op.get_attr("branches")))])
        graphs = [getattr(op, name, None) for name in names]
        if any(g is None for g in graphs):
            return [mixed(op, "branches into functions hetero_cs cannot read")] * len(op.outputs)
        result = None
        for graph in graphs:
            produced = self._run_graph(graph, kinds[1:])
            result = produced if result is None else [join(a, b) for a, b in zip(result, produced)]
        return result


# ---------------------------------------------------------------------------------------------------------------
# Op-specific rules (structural ops): each returns one Kind for every output, or a list.
# ---------------------------------------------------------------------------------------------------------------
def _matmul(flow, op, kinds) -> Kind:
    a, b = kinds[:2]
    if {a.what, b.what} & {AGG, COUNT}:
        return _AGG if ROWS not in (a.what, b.what) else mixed(op, "multiplies examples by a batch aggregate")
    ta = op.get_attr("transpose_a") if "transpose_a" in op.node_def.attr else op.get_attr("adj_x")
    tb = op.get_attr("transpose_b") if "transpose_b" in op.node_def.attr else op.get_attr("adj_y")
    rank_a, rank_b, rank = _rank(op.inputs[0]), _rank(op.inputs[1]), _rank(op.outputs[0])
    if None in (rank_a, rank_b, rank):
        return mixed(op, "multiplies tensors of unknown rank")

    def role(kind, rank_in, transposed, left):
        """'batch' (a batch dimension of the product), 'outer' (a row/column of the product) or 'inner'."""
        if kind.axis < rank_in - 2:
            return "batch", rank - rank_in + kind.axis
        row_axis = rank_in - 2
        outer_axis = (rank_in - 1 if transposed else row_axis) if left else (row_axis if transposed else rank_in - 1)
        if kind.axis == outer_axis:
            return "outer", rank - 2 if left else rank - 1
        return "inner", None

    roles = []
    for kind, rank_in, transposed, left in ((a, rank_a, ta, True), (b, rank_b, tb, False)):
        roles.append(None if kind.what == REP else (kind, *role(kind, rank_in, transposed, left)))
    present = [r for r in roles if r is not None]
    if any(r[1] == "inner" for r in present):
        if len(present) == 2 and all(r[1] == "inner" for r in present) and same_rows(present[0][0].tag, present[1][0].tag):
            return _AGG  # x^T y over the batch: a sum over the examples
        if len(present) == 1:
            return _AGG
        return mixed(op, "multiplies values of different examples together")
    if len(present) == 2:
        (ka, ra, axa), (kb, rb, axb) = present
        if ra == rb == "batch" and axa == axb and same_rows(ka.tag, kb.tag):
            return Kind(ROWS, axa, ka.tag)
        return mixed(op, "pairs every example with every other (a matrix of examples by examples)")
    kind, _, axis = present[0]
    return Kind(ROWS, axis, kind.tag)


def _einsum(flow, op, kinds) -> Kind:
    equation = op.get_attr("equation").decode() if isinstance(op.get_attr("equation"), bytes) \
        else op.get_attr("equation")
    if "..." in equation or "->" not in equation:
        return mixed(op, f"has an equation hetero_cs does not read ({equation!r})")
    left, output = equation.replace(" ", "").split("->")
    operands = left.split(",")
    letters = set()
    tag = None
    for letters_in, kind in zip(operands, kinds):
        if kind.what == REP:
            continue
        if kind.what != ROWS:
            return _AGG if kind.what in (AGG, COUNT) and all(k.what != ROWS for k in kinds) else \
                mixed(op, f"combines a {kind} value")
        letters.add(letters_in[kind.axis])
        if tag is not None and not same_rows(kind.tag, tag):
            return mixed(op, "combines values of different examples")
        tag = kind.tag
    if len(letters) != 1:
        return mixed(op, "pairs every example with every other (the examples' axes differ)")
    letter = letters.pop()
    if letter not in output:
        return _AGG  # summed over the examples
    return Kind(ROWS, output.index(letter), tag)


def _reshape(flow, op, kinds) -> Kind:
    kind, shape = kinds[:2]
    if kind.what in (AGG, COUNT):
        return _AGG
    if kind.what == SHAPE:
        return kind
    if kind.what != ROWS:
        return mixed(op, f"reshapes a {kind} value")
    if shape.what == SHAPE and shape.axis == 0 and kind.axis == 0 and shape.tag.root == kind.tag.root:
        # To a shape whose first entry counts rows of this slice (tf.shape(x)[0], or its product with other axes):
        # every new row holds consecutive values of the slice, which one device's whole batch cuts the same way.
        return Kind(ROWS, 0, shape.tag)
    before, after = op.inputs[0].shape, op.outputs[0].shape
    if before.rank is None or after.rank is None or after.rank == 0 or kind.axis != 0 or after[0] is not None:
        return mixed(op, "reshapes across the batch axis")
    inner_before, inner_after = before.as_list()[1:], after.as_list()[1:]
    target = _entries(op.inputs[1])
    if target is not None and len(target) == after.rank:  # entries tracing computes that shape inference did not
        inner_after = [a if a is not None else (t if t is not None and t >= 0 else None)
                       for a, t in zip(inner_after, target[1:])]
    if None in inner_after:
        return mixed(op, "reshapes rows to a shape not known while tracing")
    per_row_after = int(np.prod(inner_after)) if inner_after else 1
    if None in inner_before or kind.tag.per_example is None:
        # Rows of a size not known while tracing (a sequence of unknown length) cut into rows of a known size that
        # divides the last axis (Dense on a sequence: [b, T, d] -> [b * T, d]): each new row holds one example's
        # values, a number of them per example that tracing does not know.
        if per_row_after == 1 or (inner_before and inner_before[-1] is not None and per_row_after
                                  and inner_before[-1] % per_row_after == 0):
            return Kind(ROWS, 0, Tag(kind.tag.root, None))
        return mixed(op, "reshapes rows whose size is not known while tracing")
    per_row_before = int(np.prod(inner_before)) if inner_before else 1
    if per_row_after == 0 or per_row_before == 0:
        return kind
    per_example = kind.tag.per_example * Fraction(per_row_before, per_row_after)
    if per_example.denominator != 1:
        return mixed(op, "reshapes so that one row holds values of several examples")
    return Kind(ROWS, 0, Tag(kind.tag.root, per_example))


def _transpose(flow, op, kinds) -> Kind:
    kind = kinds[0]
    if kind.what in (AGG, COUNT):
        return _AGG
    perm = _static(op.inputs[1])
    if kind.what != ROWS or perm is None:
        return mixed(op, "transposes axes not known while tracing")
    return dataclasses.replace(kind, axis=[int(p) for p in np.ravel(perm)].index(kind.axis))


def _expand_dims(flow, op, kinds) -> Kind:
    kind = kinds[0]
    if kind.what != ROWS:
        return _AGG if kind.what in (AGG, COUNT) else mixed(op, f"expands a {kind} value")
    axis = _static(op.inputs[1])
    rank = _rank(op.outputs[0])
    if axis is None or rank is None:
        return mixed(op, "expands at an axis not known while tracing")
    axis = int(np.ravel(axis)[0]) % rank
    return dataclasses.replace(kind, axis=kind.axis + (axis <= kind.axis))


def _squeeze(flow, op, kinds) -> Kind:
    kind = kinds[0]
    if kind.what == INDEX:  # tf.where's coordinates of a 1-D condition, squeezed to a vector of positions
        return kind
    if kind.what != ROWS:
        return _AGG if kind.what in (AGG, COUNT) else mixed(op, f"squeezes a {kind} value")
    rank = _rank(op.inputs[0])
    dims = [int(d) % rank for d in op.get_attr("squeeze_dims")] if rank is not None else None
    if dims is None or not dims or kind.axis in dims:
        return mixed(op, "squeezes axes not known while tracing")
    return dataclasses.replace(kind, axis=kind.axis - sum(d < kind.axis for d in dims))


def _concat(flow, op, kinds) -> Kind:
    values, axis_kind = kinds[:-1], kinds[-1]
    axis_tensor = op.inputs[-1]
    if op.type == "Concat":  # the old op: the axis comes first
        values, axis_kind, axis_tensor = kinds[1:], kinds[0], op.inputs[0]
    if all(k.what in (REP, SHAPE, COUNT, AGG) for k in values) and any(k.what == AGG for k in values):
        return _AGG  # sizes that grow with the slice (e.g. a reshape's target shape)
    if all(k.what in (REP, SHAPE, COUNT) for k in values):
        shapes = [k for k in values if k.what in (SHAPE, COUNT)]
        if len(shapes) == 1 and _rank(op.outputs[0]) == 1:
            before = 0
            inputs = op.inputs[:-1] if op.type != "Concat" else op.inputs[1:]
            for tensor, kind in zip(inputs, values):
                if kind.what in (SHAPE, COUNT):
                    return Kind(SHAPE, before + (kind.axis if kind.what == SHAPE else 0), kind.tag)
                length = tensor.shape[0] if tensor.shape.rank == 1 else 1
                if length is None:
                    break
                before += length
        return mixed(op, "concatenates shapes hetero_cs cannot follow")
    rank = _rank(op.outputs[0])
    axis = _axes(axis_tensor, rank)
    rows = [k for k in values if k.what != REP]
    if axis is None or any(k.what != ROWS for k in rows) or any(
            k.axis != rows[0].axis or (k.axis != axis[0] and not same_rows(k.tag, rows[0].tag)) for k in rows):
        return mixed(op, "concatenates values of different kinds")
    if len(rows) != len(values):
        return mixed(op, "concatenates values of other kinds")
    if rows[0].axis == axis[0]:
        if rows[0].axis != 0 or any(k.tag.per_example is None for k in rows):
            return mixed(op, "concatenates along the batch axis")
        # Each row still one example's, but one device's order interleaves the tensors' rows differently: sums and
        # means over them are alike, a prediction row by row is not (Tag.ordered).
        # Tensors concatenated from rows of the same tags (a generator's and the data's, their labels) line up.
        return Kind(ROWS, 0, Tag(("concat", tuple(k.tag for k in rows)), Fraction(sum(k.tag.per_example for k in rows)),
                                 ordered=False))
    return rows[0]


def _pack(flow, op, kinds) -> Kind:
    rank = _rank(op.outputs[0])
    axis = op.get_attr("axis") % rank if rank else 0
    if all(k.what in (REP, COUNT) for k in kinds) and rank == 1:
        position = next(i for i, k in enumerate(kinds) if k.what == COUNT)
        return Kind(SHAPE, position, kinds[position].tag) if sum(k.what == COUNT for k in kinds) == 1 else _AGG
    if all(k.what in (REP, AGG, COUNT) for k in kinds):
        return _AGG
    rows = [k for k in kinds if k.what != REP]
    if len(rows) != len(kinds) or any(k.what != ROWS or k.axis != rows[0].axis or not same_rows(k.tag, rows[0].tag) for k in rows):
        return mixed(op, "stacks values of different kinds")
    return dataclasses.replace(rows[0], axis=rows[0].axis + (axis <= rows[0].axis))


def _unpack(flow, op, kinds) -> list[Kind]:
    kind = kinds[0]
    if kind.what == SHAPE:
        return [Kind(COUNT, tag=kind.tag) if i == kind.axis else _REP for i in range(len(op.outputs))]
    if kind.what in (AGG, COUNT):
        return [_AGG] * len(op.outputs)
    axis = op.get_attr("axis") % _rank(op.inputs[0]) if _rank(op.inputs[0]) else 0
    if kind.what != ROWS or axis == kind.axis:
        return [mixed(op, "unstacks along the batch axis")] * len(op.outputs)
    return [dataclasses.replace(kind, axis=kind.axis - (axis < kind.axis))] * len(op.outputs)


def _split(flow, op, kinds) -> Kind:
    # Split(axis, value) / SplitV(value, size_splits, axis)
    value_kind, axis_tensor, value = ((kinds[1], op.inputs[0], op.inputs[1]) if op.type == "Split"
                                      else (kinds[0], op.inputs[2], op.inputs[0]))
    if value_kind.what in (AGG, COUNT):
        return _AGG
    axis = _axes(axis_tensor, _rank(value))
    if value_kind.what != ROWS or axis is None or axis[0] == value_kind.axis:
        return mixed(op, "splits along the batch axis")
    return value_kind


def _strided_slice(flow, op, kinds) -> Kind:
    kind = kinds[0]
    if kind.what in (AGG, COUNT):
        return _AGG
    begin, end, strides = (_static(t) for t in op.inputs[1:4])
    if any(v is None for v in (begin, end, strides)) or any(k.what != REP for k in kinds[1:]):
        return mixed(op, "slices at positions computed while the step runs")
    masks = {name: op.get_attr(name) for name in
             ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")}
    specs = len(np.ravel(begin))
    if masks["ellipsis_mask"]:
        rank = _rank(op.inputs[0])
        if rank is None or kind.what != ROWS:
            return mixed(op, "slices with an ellipsis a shape hetero_cs cannot follow")
        ellipsis = (masks["ellipsis_mask"] & -masks["ellipsis_mask"]).bit_length() - 1
        new = [bool(masks["new_axis_mask"] & (1 << i)) for i in range(specs)]
        covered = rank - sum(1 for i in range(specs) if i != ellipsis and not new[i])
        consumed = sum(1 for i in range(ellipsis) if not new[i])  # input axes the specs before the ellipsis take
        if not consumed <= kind.axis < consumed + covered:
            return mixed(op, "slices the batch axis (an ellipsis covers other axes)")
        # The batch axis is among the ellipsis' whole axes: it moves by the new and removed axes before it.
        shift = sum(new[:ellipsis]) - sum(1 for i in range(ellipsis)
                                          if masks["shrink_axis_mask"] & (1 << i) and not new[i])
        return dataclasses.replace(kind, axis=kind.axis + shift)
    input_axis, output_axis, result = 0, 0, None
    target = kind.axis if kind.what in (ROWS, SHAPE) else None
    for i in range(specs):
        bit = 1 << i
        if masks["new_axis_mask"] & bit:
            output_axis += 1
            continue
        whole = (masks["begin_mask"] & bit or int(begin[i]) == 0) and masks["end_mask"] & bit and int(strides[i]) == 1
        if kind.what == SHAPE:
            # A shape vector: which entries are kept (the row count among them?).
            if masks["shrink_axis_mask"] & bit:
                return Kind(COUNT, tag=kind.tag) if int(begin[i]) % max(op.inputs[0].shape[0] or 1, 1) == \
                    kind.axis else _REP
            if whole:
                return kind
            start = 0 if masks["begin_mask"] & bit else int(begin[i])
            stop = None if masks["end_mask"] & bit else int(end[i])
            length = op.inputs[0].shape[0]
            positions = list(range(length))[start:stop:int(strides[i])] if length is not None else None
            if positions is None:
                return mixed(op, "slices a shape hetero_cs cannot follow")
            return Kind(SHAPE, positions.index(kind.axis), kind.tag) if kind.axis in positions else _REP
        if input_axis == target:
            if not whole or masks["shrink_axis_mask"] & bit:
                return mixed(op, "picks examples by their position in the slice (one device's positions differ)")
            result = output_axis
        if not masks["shrink_axis_mask"] & bit:
            output_axis += 1
        input_axis += 1
    if kind.what == SHAPE:
        return kind
    if result is None:  # the batch axis is past the sliced ones: it moves with the new and removed axes
        result = target + (output_axis - input_axis)
    return dataclasses.replace(kind, axis=result)


def _slice(flow, op, kinds) -> Kind:
    kind = kinds[0]
    if kind.what in (AGG, COUNT):
        return _AGG
    begin, size = _static(op.inputs[1]), _static(op.inputs[2])
    if kind.what not in (ROWS, SHAPE) or begin is None or size is None:
        return mixed(op, "slices at positions computed while the step runs")
    start, length = int(np.ravel(begin)[kind.axis if kind.what == ROWS else 0]), \
        int(np.ravel(size)[kind.axis if kind.what == ROWS else 0])
    if kind.what == SHAPE:  # part of a shape vector: the row count among its entries or not
        inside = start <= kind.axis and (length < 0 or kind.axis < start + length)
        return Kind(SHAPE, kind.axis - start, kind.tag) if inside else _REP
    if start != 0 or length != -1:
        return mixed(op, "picks examples by their position in the slice")
    return kind


def _pad(flow, op, kinds) -> Kind:
    kind = kinds[0]
    paddings = _static(op.inputs[1])
    if kind.what != ROWS or paddings is None:
        return _AGG if kind.what in (AGG, COUNT) else mixed(op, "pads by amounts not known while tracing")
    if np.any(np.asarray(paddings)[kind.axis] != 0):
        return mixed(op, "pads along the batch axis")
    return kind


def _tile(flow, op, kinds) -> Kind:
    kind = kinds[0]
    if kind.what == REP and kinds[1].what == SHAPE:
        return Kind(ROWS, kinds[1].axis, kinds[1].tag)
    multiples = _entries(op.inputs[1])
    if kind.what != ROWS or multiples is None or multiples[kind.axis] is None:
        return mixed(op, "tiles by multiples not known while tracing")
    if multiples[kind.axis] != 1:
        return mixed(op, "tiles along the batch axis")
    return kind


def _broadcast_to(flow, op, kinds) -> Kind:
    kind, shape = kinds[:2]
    rank = _rank(op.outputs[0])
    if kind.what == REP and shape.what == SHAPE:
        return Kind(ROWS, shape.axis, shape.tag)
    if kind.what == ROWS and rank is not None and _rank(op.inputs[0]) is not None:
        return dataclasses.replace(kind, axis=kind.axis + rank - _rank(op.inputs[0]))
    return _AGG if kind.what in (AGG, COUNT) else mixed(op, "broadcasts a value hetero_cs cannot follow")


def _shape(flow, op, kinds) -> list[Kind]:
    result = []
    for kind in kinds[:len(op.outputs)]:
        if kind.what == ROWS:
            result.append(Kind(SHAPE, kind.axis, kind.tag))
        elif kind.what == REP or kind.what in (AGG, COUNT):
            result.append(_REP)
        else:
            result.append(mixed(op, f"takes the shape of a {kind} value"))
    return result


def _size(flow, op, kinds) -> Kind:
    kind = kinds[0]
    return Kind(COUNT, tag=kind.tag) if kind.what == ROWS else _REP if kind.what != MIXED else kind


def _gather(flow, op, kinds) -> Kind:
    # GatherV2(params, indices, axis), ResourceGather(resource, indices), Gather(params, indices)
    params, indices = kinds[0], kinds[1]
    axis = 0
    if op.type == "GatherV2":
        static_axis = _static(op.inputs[2])
        if static_axis is None:
            return mixed(op, "gathers along an axis not known while tracing")
        axis = int(static_axis) % max(_rank(op.inputs[0]) or 1, 1)
    batch_dims = op.get_attr("batch_dims") if "batch_dims" in op.node_def.attr else 0
    index_rank = _rank(op.inputs[1])
    if index_rank is None:
        return mixed(op, "gathers with indices of unknown rank")
    if params.what == SHAPE:
        positions = _static(op.inputs[1])
        if indices.what != REP or positions is None:
            return mixed(op, "gathers a shape by the examples' values")
        positions = [int(p) for p in np.ravel(positions)]
        if params.axis not in positions:
            return _REP
        return Kind(SHAPE, positions.index(params.axis), params.tag) if np.ndim(_static(op.inputs[1])) else \
            Kind(COUNT, tag=params.tag)
    if params.what == REP and indices.what == ROWS:
        return Kind(ROWS, axis + indices.axis - batch_dims, indices.tag)  # an embedding lookup
    if params.what == ROWS and indices.what == REP:
        if params.axis == axis:
            return mixed(op, "picks examples by their position in the slice")
        shift = index_rank - 1 - batch_dims if params.axis > axis else 0
        return dataclasses.replace(params, axis=params.axis + shift)
    if params.what == ROWS and indices.what == INDEX and params.axis == axis == 0 and same_rows(params.tag, indices.tag):
        return Kind(ROWS, 0, Tag(("subset", op.name)))  # a subset of the rows the data picked, in order
    if params.what == ROWS and indices.what == ROWS and batch_dims >= 1 and params.axis == indices.axis == 0 \
            and same_rows(params.tag, indices.tag):
        return params  # each example gathers from its own rows (tf.gather(..., batch_dims=1))
    if AGG in (params.what, indices.what) and ROWS not in (params.what, indices.what):
        return _AGG
    return mixed(op, "gathers values of one example by another's indices")


def _where(flow, op, kinds) -> Kind:
    if len(op.inputs) == 1:  # tf.where(condition): the coordinates of the true entries
        kind = kinds[0]
        if kind.what == ROWS and kind.axis == 0:
            return Kind(INDEX, tag=kind.tag)
        return mixed(op, "picks entries along an axis other than the batch's") if kind.what == ROWS else _AGG
    return flow._elementwise(op, kinds)


def _one_hot(flow, op, kinds) -> Kind:
    indices = kinds[0]
    if any(k.what != REP for k in kinds[1:]):
        return mixed(op, "takes a depth or values that depend on the examples")
    if indices.what != ROWS:
        return _AGG if indices.what in (AGG, COUNT) else mixed(op, f"encodes a {indices} value")
    axis = op.get_attr("axis")
    rank = _rank(op.outputs[0])
    axis = rank - 1 if axis == -1 else axis
    return dataclasses.replace(indices, axis=indices.axis + (axis <= indices.axis))


def _range(flow, op, kinds) -> Kind:
    if any(k.what == COUNT for k in kinds):
        return mixed(op, "numbers the examples of the slice (one device numbers the whole batch)")
    return _AGG if any(k.what == AGG for k in kinds) else mixed(op, "makes a range hetero_cs cannot follow")


def _cross_entropy(flow, op, kinds) -> Kind:
    first, second = kinds[:2]
    if first.what == ROWS and second.what == ROWS and first.axis == second.axis == 0 and same_rows(first.tag, second.tag):
        return first
    return mixed(op, "combines labels and logits that are not one row per example")


def _tensor_list_from_tensor(flow, op, kinds) -> Kind:
    kind = kinds[0]
    if kind.what == LIST:  # the REP tensor it unstacks
        return Kind(LIST, element=_REP)
    if kind.what != ROWS or kind.axis == 0:
        return mixed(op, "unstacks the examples into a list")
    return Kind(LIST, element=dataclasses.replace(kind, axis=kind.axis - 1))


def _tensor_list_reserve(flow, op, kinds) -> Kind:
    return Kind(LIST)


def _tensor_list_get(flow, op, kinds) -> Kind:
    lst = kinds[0]
    if lst.what != LIST or any(k.what not in (REP,) for k in kinds[1:]):
        return mixed(op, "reads a list at a position computed from the examples")
    return lst.element or _REP


def _tensor_list_set(flow, op, kinds) -> Kind:
    lst, item = kinds[0], kinds[2]
    if lst.what != LIST or kinds[1].what != REP:
        return mixed(op, "writes a list at a position computed from the examples")
    element = join(lst.element, item)
    return mixed(op, element.reason) if element.what == MIXED else Kind(LIST, element=element)


def _tensor_list_stack(flow, op, kinds) -> Kind:
    lst = kinds[0]
    if lst.what != LIST:
        return mixed(op, "stacks a value that is not a list")
    element = lst.element or _REP
    if element.what == ROWS:
        return dataclasses.replace(element, axis=element.axis + 1)
    return element if element.what in (REP, AGG) else mixed(op, f"stacks {element} values")


def _identity_n(flow, op, kinds) -> list[Kind]:
    return list(kinds)


def _sparse_dense(flow, op, kinds) -> Kind:
    return mixed(op, "scatters values to positions hetero_cs cannot follow")


_HANDLERS = {
    "MatMul": _matmul, "BatchMatMul": _matmul, "BatchMatMulV2": _matmul, "BatchMatMulV3": _matmul,
    "Einsum": _einsum, "Reshape": _reshape, "Transpose": _transpose, "ExpandDims": _expand_dims,
    "Squeeze": _squeeze, "ConcatV2": _concat, "Concat": _concat, "Pack": _pack, "Unpack": _unpack,
    "Split": _split, "SplitV": _split, "StridedSlice": _strided_slice, "Slice": _slice, "Pad": _pad,
    "PadV2": _pad, "MirrorPad": _pad, "Tile": _tile, "BroadcastTo": _broadcast_to, "Shape": _shape,
    "ShapeN": _shape, "Size": _size, "GatherV2": _gather, "ResourceGather": _gather, "Gather": _gather,
    "Where": _where, "OneHot": _one_hot, "Range": _range,
    "L2Loss": lambda flow, op, kinds: _AGG if kinds[0].what in (ROWS, AGG, COUNT) else mixed(op, "reduces a value"),
    "ReverseV2": lambda flow, op, kinds: flow._along_axis(op, kinds),
    "Conv2DBackpropInput": lambda flow, op, kinds: kinds[2] if kinds[2].what == ROWS and kinds[2].axis == 0 and
    kinds[1].what == REP else mixed(op, "transposes a convolution across the batch axis"),
    "Conv3DBackpropInputV2": lambda flow, op, kinds: kinds[2] if kinds[2].what == ROWS and kinds[2].axis == 0 and
    kinds[1].what == REP else mixed(op, "transposes a convolution across the batch axis"),
    "SparseSoftmaxCrossEntropyWithLogits": _cross_entropy, "SoftmaxCrossEntropyWithLogits": _cross_entropy,
    "IdentityN": _identity_n,
    "ScatterNd": _sparse_dense, "TensorScatterUpdate": _sparse_dense, "TensorScatterAdd": _sparse_dense,
    "UnsortedSegmentSum": _sparse_dense, "SparseToDense": _sparse_dense, "Unique": _sparse_dense,
}


# Ops on TensorLists (tf.while_loop's TensorArrays); a list that is REP is a list of REP elements.
_LISTS = {
    "TensorListFromTensor": _tensor_list_from_tensor, "TensorListReserve": _tensor_list_reserve,
    "EmptyTensorList": _tensor_list_reserve, "TensorListGetItem": _tensor_list_get,
    "TensorListSetItem": _tensor_list_set, "TensorListStack": _tensor_list_stack,
}


def describe(kind: Kind) -> str:
    """A phrase for messages: what the kind says about a value."""
    return {REP: "the same on every replica", ROWS: "one row per example", AGG: "computed from the whole slice",
            COUNT: "the slice's number of rows", MIXED: kind.reason}.get(kind.what, kind.what)

