"""The kinds of the batch-flow analysis, and what tracing knows of a tensor's value (shapes, axes).

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches. What each kind means is
in :mod:`hetero_cs.engine._compat.batch_flow`; what each op does to kinds in
:mod:`hetero_cs.engine._compat.batch_rules`.
"""

import dataclasses
from fractions import Fraction
from typing import Any

import numpy as np
import tensorflow as tf

REP, ROWS, AGG, COUNT, SHAPE, INDEX, LIST, MIXED = "rep", "rows", "agg", "count", "shape", "index", "list", "mixed"


@dataclasses.dataclass(frozen=True)
class Tag:
    """Which rows a ``ROWS`` tensor holds: ``per_example`` rows for each example of ``root`` (the replica's batch),
    or the rows of a subset the data picked, or of tensors concatenated (``root`` then says which)."""

    root: Any
    per_example: Fraction | None = Fraction(1)  # None: a fixed number not known while tracing
    ordered: bool = True  # False: rows of several tensors concatenated, one device's order differs (sums are alike)


@dataclasses.dataclass(frozen=True)
class Kind:
    what: str
    axis: int = 0  # ROWS: the batch axis; SHAPE: the entry that counts rows
    tag: Tag | None = None
    element: "Kind | None" = None  # LIST: the kind of its elements
    reason: str = ""  # MIXED: the op and why

    def at(self, axis: int) -> "Kind":
        return dataclasses.replace(self, axis=axis)

    def __repr__(self) -> str:
        return f"rows(axis={self.axis})" if self.what == ROWS else self.what if self.what != MIXED else \
            f"mixed({self.reason})"


REPLICATED, AGGREGATE = Kind(REP), Kind(AGG)


def same_rows(a: Tag | None, b: Tag | None) -> bool:
    """True when two tags name the same rows (a number per example not known while tracing matches any)."""
    if a is None or b is None:
        return a is b
    return a.root == b.root and (a.per_example == b.per_example or None in (a.per_example, b.per_example))


def mixed(op, why: str) -> Kind:
    if "tensordot" in op.name.lower():  # its Reshape/MatMul names say nothing of the contraction that mixes rows
        why += (" (a tensordot that contracts the batch axis, e.g. tensordot(u, v, 2); for one dot product per "
                "example use keras.ops.sum(u * v, axis=-1))")
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
        return AGGREGATE
    return Kind(MIXED, reason=f"a value that is {a} on one path and {b} on another")


_ARITHMETIC = {"Sub": np.subtract, "AddV2": np.add, "Add": np.add, "Mul": np.multiply, "FloorMod": np.mod,
               "Maximum": np.maximum, "Minimum": np.minimum, "FloorDiv": np.floor_divide}


def static(tensor):
    """The value of a tensor that tracing can compute (TensorFlow's constant folding, a rank, shape entries known
    statically, integer arithmetic on those), else None."""
    try:
        value = tf.get_static_value(tensor)
    except (TypeError, ValueError):
        value = None
    if value is not None:
        return value
    op = tensor.op  # (TensorFlow's constant folding reads a Rank of a known rank already)
    if op.type in ("Identity", "Cast") and op.inputs:
        inner = static(op.inputs[0])
        return None if inner is None else np.asarray(inner).astype(tensor.dtype.as_numpy_dtype)
    if op.type in _ARITHMETIC and len(op.inputs) == 2:
        a, b = static(op.inputs[0]), static(op.inputs[1])
        return None if a is None or b is None else _ARITHMETIC[op.type](a, b)
    if op.type == "Pack":
        values = [static(t) for t in op.inputs]
        return None if any(v is None for v in values) else np.stack(values, axis=op.get_attr("axis"))
    if op.type == "StridedSlice" and op.inputs[0].op.type == "Shape" and op.get_attr("shrink_axis_mask") == 1:
        index, dims = static(op.inputs[1]), op.inputs[0].op.inputs[0].shape
        if index is not None and dims.rank is not None:
            dim = dims[int(np.ravel(index)[0])]
            return None if dim is None else np.int32(dim)
    return None


def entries(tensor) -> list | None:
    """A shape vector's entries (ints, None where not known while tracing), or None when its length is unknown."""
    value = static(tensor)
    if value is not None:
        return [int(v) for v in np.ravel(value)]
    op = tensor.op
    if op.type == "Pack":
        return [None if (v := static(t)) is None else int(v) for t in op.inputs]
    if op.type == "ConcatV2":
        parts = [entries(t) for t in op.inputs[:-1]]
        return None if any(p is None for p in parts) else [v for p in parts for v in p]
    if op.type == "Shape" and op.inputs[0].shape.rank is not None:
        return op.inputs[0].shape.as_list()
    if op.type == "Slice":  # part of a shape vector (the last axis of logits, for a softmax over classes)
        whole, begin, size = entries(op.inputs[0]), static(op.inputs[1]), static(op.inputs[2])
        if whole is not None and begin is not None and size is not None:
            start, length = int(np.ravel(begin)[0]), int(np.ravel(size)[0])
            return whole[start:] if length < 0 else whole[start:start + length]
    return [None] * tensor.shape[0] if tensor.shape.rank == 1 and tensor.shape[0] is not None else None


def axes(tensor, rank: int | None) -> list[int] | None:
    """The axes a static axis tensor names, as non-negative ints, or None."""
    value = static(tensor)
    return None if value is None or rank is None else [int(a) % max(rank, 1) for a in np.ravel(value)]


def captured(tensor):
    """The outer graph's tensor that a function graph's input ``tensor`` captures, else None (also for an eager
    tensor: a variable's handle captured from outside every function, whose ``graph`` raises AttributeError)."""
    # FuncGraph.captures: (outer tensor, placeholder inside the function) pairs.
    graph = getattr(tensor, "graph", None)
    return next((outer for outer, inner in getattr(graph, "captures", ()) if inner is tensor), None)


def rows_of(op, kind: Kind, what: str) -> Kind | None:
    """The kind for an op whose data input is not rows (an aggregate stays one; anything else is refused), or None
    when it is rows and the op's own rule decides."""
    if kind.what == ROWS:
        return None
    return AGGREGATE if kind.what in (AGG, COUNT) else mixed(op, f"{what} a {kind} value")
