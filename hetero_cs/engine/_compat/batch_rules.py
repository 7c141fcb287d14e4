"""The rules of the batch-flow analysis: what each TensorFlow op does to the kinds of its inputs.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches. The kinds are described
in :mod:`hetero_cs.engine._compat.batch_flow`, which walks a replica step's graph and applies :func:`rule` (it reads
calls, loops and conditionals itself). The rules are a whitelist: an op not listed here makes its outputs ``MIXED``,
naming the op.
"""

import numpy as np

from hetero_cs.engine._compat.batch_kinds import AGG, AGGREGATE, COUNT, INDEX, LIST, MIXED, REP, REPLICATED, ROWS
from hetero_cs.engine._compat.batch_kinds import SHAPE, Kind, Tag, axes, join, mixed, rows_of, same_rows, static
from hetero_cs.engine._compat.batch_shapes import SHAPE_RULES

_PASS_THROUGH = frozenset({
    "Identity", "Snapshot", "StopGradient", "PreventGradient", "CheckNumerics", "CheckNumericsV2", "EnsureShape",
    "Cast", "Bitcast", "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Cos", "Cosh", "Digamma",
    "Elu", "Erf", "Erfc", "Erfinv", "Exp", "Expm1", "Floor", "Gelu", "Inv", "Invert", "IsFinite", "IsInf", "IsNan",
    "LeakyRelu", "Lgamma", "Log", "Log1p", "LogicalNot", "Neg", "Ndtri", "OnesLike", "Reciprocal", "Relu", "Relu6",
    "Rint", "Round", "Rsqrt", "Selu", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus", "Softsign", "Sqrt", "Square", "Tan",
    "Tanh", "ZerosLike", "Real", "Imag", "Angle", "Conj", "ComplexAbs", "AsString", "StringToNumber",
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


def rule(op, kinds: list[Kind]) -> list[Kind]:
    """The kinds of ``op``'s outputs, given its inputs'."""
    outputs, t = len(op.outputs), op.type
    broken = next((k for k in kinds if k.what == MIXED), None)
    if not outputs or broken is not None:
        return [broken] * outputs
    if t in _LISTS:  # a list that is REP is a list of REP elements
        return [_LISTS[t](op, [Kind(LIST) if k.what == REP and i == 0 else k for i, k in enumerate(kinds)])] * outputs
    if all(k.what == REP for k in kinds) and t not in _RANDOM:
        return [REPLICATED] * outputs
    result = _HANDLERS.get(t, _unknown)(op, kinds)
    return result if isinstance(result, list) else [result] * outputs


def _python(op, kinds) -> Kind:
    return mixed(op, "runs Python code (tf.py_function, tf.numpy_function), whose computation hetero_cs cannot read; "
                     "write it in TensorFlow ops, or, if it works example by example, mark its output with "
                     "hetero_cs.per_example(...) (keras.layers.Lambda(hetero_cs.per_example) in a functional model)")


def _unknown(op, kinds) -> Kind:
    return mixed(op, "is not an op hetero_cs knows (it cannot tell whether it keeps examples apart); if it computes "
                     "each example from that example alone, mark its output with hetero_cs.per_example(...) "
                     "(keras.layers.Lambda(hetero_cs.per_example) in a functional model)")


# -- families of ops ------------------------------------------------------------------------------------------------
def _elementwise(op, kinds) -> Kind:
    rank, rows = op.outputs[0].shape.rank, []
    for tensor, kind in zip(op.inputs, kinds):
        if kind.what in (AGG, COUNT):
            rows.append(AGGREGATE)
        elif kind.what == ROWS and rank is not None and tensor.shape.rank is not None:
            rows.append(kind.at(kind.axis + rank - tensor.shape.rank))  # broadcasting aligns the trailing axes
        elif kind.what != REP:
            return mixed(op, f"combines a {kind} value element by element")
    if not any(k.what == ROWS for k in rows):
        return AGGREGATE
    if any(k.what != ROWS for k in rows):
        return mixed(op, "combines each example's values with a value computed from the whole slice (a batch "
                         "statistic): one device would use the whole batch's")
    lined_up = all(k.axis == rows[0].axis and same_rows(k.tag, rows[0].tag) for k in rows)
    return rows[0] if lined_up else mixed(op, "pairs values of different examples (their rows do not line up)")


def _reduction(op, kinds) -> Kind:
    kind = kinds[0]
    if kind.what == SHAPE:  # a product of a shape's entries: a number of elements, a fixed multiple of the rows
        return Kind(COUNT, tag=Tag(kind.tag.root, None)) if op.type == "Prod" else AGGREGATE
    if (early := rows_of(op, kind, "reduces")) is not None:
        return early
    reduced = axes(op.inputs[1], op.inputs[0].shape.rank)
    if reduced is None:
        return mixed(op, "reduces along axes not known while tracing")
    if kind.axis in reduced:
        return AGGREGATE
    keep = op.get_attr("keep_dims") if "keep_dims" in op.node_def.attr else False
    return kind if keep else kind.at(kind.axis - sum(a < kind.axis for a in reduced))


def _along_axis(op, kinds) -> Kind:
    kind = kinds[0]
    if (early := rows_of(op, kind, "works along an axis of")) is not None:
        return early
    along = axes(op.inputs[1], op.inputs[0].shape.rank)
    if along is None or kind.axis in along:
        return mixed(op, "works along the batch axis (its result for one example depends on the others)")
    return kind.at(kind.axis - (along[0] < kind.axis)) if op.type in ("ArgMax", "ArgMin") else kind


def _last_axis(op, kinds) -> Kind:
    kind, rank = kinds[0], op.inputs[0].shape.rank
    if kind.what in (AGG, COUNT):
        return AGGREGATE
    if kind.what != ROWS or rank is None or kind.axis == rank - 1:
        return mixed(op, "works along the batch axis (its result for one example depends on the others)")
    return mixed(op, "combines values of other kinds") if op.type != "InTopKV2" and any(
        k.what != REP for k in kinds[1:]) else kind


def _convolution(op, kinds) -> Kind:
    kind = kinds[0]
    if kind.what != ROWS or kind.axis != 0 or any(k.what != REP for k in kinds[1:]):
        return mixed(op, "slides over the batch axis or takes weights that depend on the examples")
    training = op.type.startswith("FusedBatchNorm") and op.get_attr("is_training")
    return mixed(op, "normalises each example by its slice's statistics") if training else kind


def _filled(op, kinds) -> Kind:
    shape = kinds[0]
    if shape.what == REP:
        return REPLICATED
    if shape.what == SHAPE:
        return Kind(ROWS, shape.axis, shape.tag)
    return mixed(op, "makes a tensor of a shape computed from the examples' values")


# -- products -------------------------------------------------------------------------------------------------------
def _matmul(op, kinds) -> Kind:
    a, b = kinds[:2]
    if {a.what, b.what} & {AGG, COUNT}:
        return AGGREGATE if ROWS not in (a.what, b.what) else mixed(op, "multiplies examples by a batch aggregate")
    ta = op.get_attr("transpose_a") if "transpose_a" in op.node_def.attr else op.get_attr("adj_x")
    tb = op.get_attr("transpose_b") if "transpose_b" in op.node_def.attr else op.get_attr("adj_y")
    rank = op.outputs[0].shape.rank
    if None in (op.inputs[0].shape.rank, op.inputs[1].shape.rank, rank):
        return mixed(op, "multiplies tensors of unknown rank")
    present = []  # (kind, role, axis of the product): a batch dimension, a row/column of the product, or inner
    for kind, tensor, transposed, left in ((a, op.inputs[0], ta, True), (b, op.inputs[1], tb, False)):
        if kind.what == REP:
            continue
        n = tensor.shape.rank
        outer = (n - 1 if transposed else n - 2) if left else (n - 2 if transposed else n - 1)
        role = "batch" if kind.axis < n - 2 else "outer" if kind.axis == outer else "inner"
        present.append((kind, role, {"batch": rank - n + kind.axis, "outer": rank - 2 if left else rank - 1}.get(role)))
    if any(role == "inner" for _, role, _ in present):
        if len(present) == 1 or all(role == "inner" for _, role, _ in present) and same_rows(present[0][0].tag,
                                                                                            present[1][0].tag):
            return AGGREGATE  # x^T y over the batch: a sum over the examples
        return mixed(op, "multiplies values of different examples together")
    if len(present) == 2:
        (ka, ra, axa), (kb, rb, axb) = present
        return Kind(ROWS, axa, ka.tag) if ra == rb == "batch" and axa == axb and same_rows(ka.tag, kb.tag) else \
            mixed(op, "pairs every example with every other (a matrix of examples by examples)")
    return Kind(ROWS, present[0][2], present[0][0].tag)  # one operand holds rows: at their axis of the product


def _einsum(op, kinds) -> Kind:
    equation = op.get_attr("equation")
    equation = equation.decode() if isinstance(equation, bytes) else equation
    if "..." in equation or "->" not in equation:
        return mixed(op, f"has an equation hetero_cs does not read ({equation!r})")
    left, output = equation.replace(" ", "").split("->")
    letters, tag = set(), None
    for letters_in, kind in zip(left.split(","), kinds):
        if kind.what == REP:
            continue
        if kind.what != ROWS:
            return AGGREGATE if kind.what in (AGG, COUNT) and all(k.what != ROWS for k in kinds) else \
                mixed(op, f"combines a {kind} value")
        if tag is not None and not same_rows(kind.tag, tag):
            return mixed(op, "combines values of different examples")
        letters.add(letters_in[kind.axis])
        tag = kind.tag
    if len(letters) != 1:
        return mixed(op, "pairs every example with every other (the examples' axes differ)")
    letter = letters.pop()
    return Kind(ROWS, output.index(letter), tag) if letter in output else AGGREGATE  # else: summed over the examples


# -- picking rows ---------------------------------------------------------------------------------------------------
def _gather(op, kinds) -> Kind:  # GatherV2(params, indices, axis), ResourceGather(resource, indices)
    params, indices, axis = kinds[0], kinds[1], 0
    if op.type == "GatherV2":
        static_axis = static(op.inputs[2])
        if static_axis is None:
            return mixed(op, "gathers along an axis not known while tracing")
        axis = int(static_axis) % max(op.inputs[0].shape.rank or 1, 1)
    batch_dims = op.get_attr("batch_dims") if "batch_dims" in op.node_def.attr else 0
    if op.inputs[1].shape.rank is None:
        return mixed(op, "gathers with indices of unknown rank")
    if params.what == SHAPE:
        positions = static(op.inputs[1])
        if indices.what != REP or positions is None:
            return mixed(op, "gathers a shape by the examples' values")
        kept = [int(p) for p in np.ravel(positions)]
        if params.axis not in kept:
            return REPLICATED
        return Kind(SHAPE, kept.index(params.axis), params.tag) if np.ndim(positions) else Kind(COUNT, tag=params.tag)
    if params.what == REP and indices.what == ROWS:
        return Kind(ROWS, axis + indices.axis - batch_dims, indices.tag)  # an embedding lookup
    if params.what == ROWS and indices.what == REP:
        return mixed(op, "picks examples by their position in the slice") if params.axis == axis else \
            params.at(params.axis + (op.inputs[1].shape.rank - 1 - batch_dims if params.axis > axis else 0))
    if params.what == ROWS and params.axis == axis == 0 and same_rows(params.tag, indices.tag):
        if indices.what == INDEX:
            return Kind(ROWS, 0, Tag(("subset", op.name)))  # a subset of the rows the data picked, in order
        if indices.what == ROWS and indices.axis == 0 and batch_dims >= 1:
            return params  # each example gathers from its own rows (tf.gather(..., batch_dims=1))
    return AGGREGATE if AGG in (params.what, indices.what) and ROWS not in (params.what, indices.what) else \
        mixed(op, "gathers values of one example by another's indices")


def _where(op, kinds) -> Kind:
    if len(op.inputs) != 1:
        return _elementwise(op, kinds)
    kind = kinds[0]  # tf.where(condition): the coordinates of the true entries
    if kind.what == ROWS:
        return Kind(INDEX, tag=kind.tag) if kind.axis == 0 else mixed(op, "picks entries along another axis")
    return AGGREGATE


def _one_hot(op, kinds) -> Kind:
    indices = kinds[0]
    if any(k.what != REP for k in kinds[1:]):
        return mixed(op, "takes a depth or values that depend on the examples")
    axis = op.get_attr("axis")
    axis = op.outputs[0].shape.rank - 1 if axis == -1 else axis
    return rows_of(op, indices, "encodes") or indices.at(indices.axis + (axis <= indices.axis))


def _range(op, kinds) -> Kind:
    if any(k.what == COUNT for k in kinds):
        return mixed(op, "numbers the examples of the slice (one device numbers the whole batch)")
    return AGGREGATE if any(k.what == AGG for k in kinds) else mixed(op, "makes a range hetero_cs cannot follow")


def _cross_entropy(op, kinds) -> Kind:
    first, second = kinds[:2]
    ok = first.what == second.what == ROWS and first.axis == second.axis == 0 and same_rows(first.tag, second.tag)
    return first if ok else mixed(op, "combines labels and logits that are not one row per example")


def _transposed_convolution(op, kinds) -> Kind:  # Conv2DBackpropInput(input_sizes, filter, out_backprop)
    ok = kinds[2].what == ROWS and kinds[2].axis == 0 and kinds[1].what == REP
    return kinds[2] if ok else mixed(op, "transposes a convolution across the batch axis")


# -- TensorLists (tf.while_loop's TensorArrays) ---------------------------------------------------------------------
def _list_from_tensor(op, kinds) -> Kind:
    kind = kinds[0]
    if kind.what == LIST:  # the REP tensor it unstacks
        return Kind(LIST, element=REPLICATED)
    return mixed(op, "unstacks the examples into a list") if kind.what != ROWS or kind.axis == 0 else \
        Kind(LIST, element=kind.at(kind.axis - 1))


def _list_get(op, kinds) -> Kind:
    return mixed(op, "reads a list at a position computed from the examples") if kinds[0].what != LIST or any(
        k.what != REP for k in kinds[1:]) else kinds[0].element or REPLICATED


def _list_set(op, kinds) -> Kind:
    if kinds[0].what != LIST or kinds[1].what != REP:
        return mixed(op, "writes a list at a position computed from the examples")
    element = join(kinds[0].element, kinds[2])
    return mixed(op, element.reason) if element.what == MIXED else Kind(LIST, element=element)


def _list_stack(op, kinds) -> Kind:
    element = (kinds[0].element or REPLICATED) if kinds[0].what == LIST else None
    if element is None or element.what not in (ROWS, REP, AGG):
        return mixed(op, f"stacks {element or kinds[0]} values")
    return element.at(element.axis + 1) if element.what == ROWS else element


_LISTS = {
    "TensorListFromTensor": _list_from_tensor, "TensorListReserve": lambda op, kinds: Kind(LIST),
    "EmptyTensorList": lambda op, kinds: Kind(LIST), "TensorListGetItem": _list_get,
    "TensorListSetItem": _list_set, "TensorListStack": _list_stack,
}
_HANDLERS = {
    **dict.fromkeys(_PASS_THROUGH, lambda op, kinds: kinds[0]),
    **dict.fromkeys(("PyFunc", "PyFuncStateless", "EagerPyFunc"), _python),
    **dict.fromkeys(("Rank", "VarIsInitializedOp", "TensorListLength", "TensorListElementShape"),
                    lambda op, kinds: REPLICATED),
    "MatMul": _matmul, "BatchMatMul": _matmul, "BatchMatMulV2": _matmul, "BatchMatMulV3": _matmul, "Einsum": _einsum,
    **SHAPE_RULES, "Size": lambda op, kinds: Kind(COUNT, tag=kinds[0].tag) if kinds[0].what == ROWS else REPLICATED,
    "GatherV2": _gather, "ResourceGather": _gather, "Gather": _gather, "Where": _where, "OneHot": _one_hot,
    **dict.fromkeys(("SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits"), _cross_entropy),
    "Range": _range, "IdentityN": lambda op, kinds: list(kinds), **dict.fromkeys(_RANDOM, _filled),
    "L2Loss": lambda op, kinds: AGGREGATE if kinds[0].what in (ROWS, AGG, COUNT) else mixed(op, "reduces a value"),
    "Conv2DBackpropInput": _transposed_convolution, "Conv3DBackpropInputV2": _transposed_convolution,
    **dict.fromkeys(("ScatterNd", "TensorScatterUpdate", "TensorScatterAdd", "UnsortedSegmentSum", "SparseToDense",
                     "Unique"), lambda op, kinds: mixed(op, "scatters values to positions hetero_cs cannot follow")),
    **dict.fromkeys(_ELEMENTWISE, _elementwise), **dict.fromkeys(_CONVOLUTIONS, _convolution),
    **{t: _reduction for t in ("Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm")},
    **{t: _along_axis for t in ("ArgMax", "ArgMin", "Cumsum", "Cumprod", "CumulativeLogsumexp", "ReverseV2")},
    **{t: _last_axis for t in ("Softmax", "LogSoftmax", "TopKV2", "InTopKV2")},
}
