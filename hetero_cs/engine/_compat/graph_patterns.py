"""Reading a traced value's graph: whether a metric variable's new value is the variable plus a delta.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches. An ``assign`` to a metric
variable accumulates when the value is ``var + delta`` in any linear form (``var + a + b``, ``tf.add_n([var, a,
b])``, ``var - (-d)``): the variable's reads have total coefficient 1 (:func:`accumulated_terms`). The walk
(:func:`linear_terms`) goes only through ops that keep a value linear: Identity, Cast, Add, AddV2, AddN, Sub, Neg, a
product with a constant scalar, and Keras' ``ops.sum`` of a stacked list. Anything else is a leaf.
"""

import numpy as np
import tensorflow as tf

from hetero_cs.engine._compat.batch_kinds import axes, captured, static

_PASS_THROUGH = ("Identity", "Cast", "StopGradient")
_MAX_OPS = 256  # bound on the ops visited per question (a linear combination of a few terms needs far fewer)


def _constant_scalar(tensor) -> float | None:
    """The value of a one-element tensor that tracing computes (a constant, maybe cast), else None."""
    value = static(tensor)
    return None if value is None or np.size(value) != 1 else float(np.reshape(value, ()))


def _scaled_by_constant(op):
    """``(factor, other input)`` when ``op`` is a product with (or a division by) a constant scalar, else None."""
    a, b = op.inputs
    if op.type == "Mul":
        return next(((factor, other) for const, other in ((a, b), (b, a))
                     if (factor := _constant_scalar(const)) is not None), None)
    divisor = _constant_scalar(b)  # RealDiv: only x / constant is linear in x
    return (1.0 / divisor, a) if divisor else None


def _sums_whole_stack(sum_op) -> bool:
    """True when a Sum op reduces a stacked list of scalars along the stacking axis to a scalar."""
    packed = sum_op.inputs[0]
    if packed.shape.rank != 1 or any(t.shape.rank != 0 for t in packed.op.inputs):
        return False
    axis = axes(sum_op.inputs[1], 1)
    return axis is not None and set(axis) <= {0}


def accumulated_terms(value, variable) -> list | None:
    """The terms ``[(c_k, t_k), ...]`` of ``delta`` when graph tensor ``value`` is ``variable + delta`` in some linear
    form (``delta = sum_k c_k * t_k``), else None.

    The variable's direct reads (its own handle, or a function graph's capture of it) must add up to coefficient
    1: ``var + a + b``, ``tf.add_n([var, a, b])``, ``var - (-d)`` and ``var - d`` qualify; ``var * decay + x``
    and ``2 * var + d`` do not. The other terms are not searched for further reads of the variable (they can be
    the whole model's forward pass): a value such as ``var + var * d`` counts as an accumulation of ``var * d``.
    None in eager mode (no graph) or when the walk visits more than a bounded number of ops.
    """
    terms = linear_terms(value, variable)
    return terms[1] if terms is not None and abs(terms[0] - 1.0) < 1e-12 else None


def linear_terms(value, variable=None) -> tuple[float, list] | None:
    """Graph tensor ``value`` as ``c * variable + sum_k c_k * t_k``: ``(c, [(c_k, t_k), ...])``.

    Followed through linear ops (see the module docstring) down to ``variable``'s direct reads (None: no variable),
    which add up to ``c`` and are not looked into, and to other leaves ``t_k``. None in eager mode (no graph), for
    a variable without a handle, or when the walk visits more than a bounded number of ops.
    """
    handles = set() if variable is None else {id(h) for h in _handles(variable)}
    if variable is not None and not handles or not hasattr(value, "op") or tf.executing_eagerly():
        return None

    def reads_variable(tensor) -> bool:
        op = tensor.op
        while op.type in _PASS_THROUGH and op.inputs:
            op = op.inputs[0].op
        return bool(handles) and op.type == "ReadVariableOp" and _captures_one_of(op.inputs[0], handles)

    coefficient, leaves, stack = 0.0, [], [(value, 1.0)]
    for _ in range(_MAX_OPS):
        if not stack:
            return coefficient, leaves
        tensor, coeff = stack.pop()
        if reads_variable(tensor):
            coefficient += coeff
            continue
        op, inputs = tensor.op, list(tensor.op.inputs)
        kind = op.type
        if kind in _PASS_THROUGH and inputs:
            stack.append((inputs[0], coeff))
        elif kind in ("AddV2", "Add", "AddN"):  # a sum of two (Add, AddV2) or of any number (AddN) of terms
            stack.extend((t, coeff) for t in inputs)
        elif kind == "Sub" and len(inputs) == 2:
            stack.extend([(inputs[0], coeff), (inputs[1], -coeff)])
        elif kind == "Neg" and inputs:
            stack.append((inputs[0], -coeff))
        elif kind in ("Mul", "RealDiv") and len(inputs) == 2 and (scaled := _scaled_by_constant(op)) is not None:
            factor, other = scaled
            stack.append((other, coeff * factor))
        elif kind == "Sum" and len(inputs) == 2 and inputs[0].op.type == "Pack" and _sums_whole_stack(op):
            stack.extend((t, coeff) for t in inputs[0].op.inputs)  # keras.ops.sum([a, b, ...])
        elif kind in ("Sum", "Mean") and len(inputs) == 2 and inputs[0].shape.rank == 0:
            stack.append((inputs[0], coeff))  # a reduction of a scalar is the scalar (Keras sums each add_loss value)
        else:
            leaves.append((coeff, tensor))  # anything else is a leaf that does not read the variable
    return None if stack else (coefficient, leaves)


def _captures_one_of(tensor, handle_ids: set) -> bool:
    """True when ``tensor`` is one of the handles, or a function graph's capture of one (through nested graphs)."""
    for _ in range(16):  # nesting depth bound
        if tensor is None:
            return False
        if id(tensor) in handle_ids:
            return True
        tensor = captured(tensor)
    return False


def _handles(variable) -> list:
    """The resource handles a read of ``variable`` may use in the current graph (its own, or its wrapped one's)."""
    candidates = (variable, getattr(variable, "_v", None))  # _v: the variable an AggregatingVariable wraps
    return [c.handle for c in candidates if getattr(c, "handle", None) is not None]
