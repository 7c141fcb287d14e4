"""The batch-flow rules for ops that move values between axes and shapes: reshapes, transposes, concatenations,
slices, pads, tiles and shape vectors (what each does to the axis that holds a replica's examples).

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches; the dispatch is
:func:`hetero_cs.engine._compat.batch_rules.rule`.
"""

from fractions import Fraction

import numpy as np

from hetero_cs.engine._compat.batch_kinds import AGG, AGGREGATE, COUNT, INDEX, REP, REPLICATED, ROWS, SHAPE, Kind, Tag
from hetero_cs.engine._compat.batch_kinds import axes, entries, mixed, rows_of as _rows_of, same_rows, static


def _reshape(op, kinds) -> Kind:
    kind, shape = kinds[:2]
    if kind.what == SHAPE:
        return kind
    if (early := _rows_of(op, kind, "reshapes")) is not None:
        return early
    if shape.what == SHAPE and shape.axis == 0 and kind.axis == 0 and shape.tag.root == kind.tag.root:
        # To a shape whose first entry counts rows of this slice (tf.shape(x)[0], or its product with other axes):
        # every new row holds consecutive values of the slice, which one device's whole batch cuts the same way.
        return Kind(ROWS, 0, shape.tag)
    before, after = op.inputs[0].shape, op.outputs[0].shape
    if before.rank is None or after.rank is None or after.rank == 0 or kind.axis != 0 or after[0] is not None:
        return mixed(op, "reshapes across the batch axis")
    inner_before, inner_after = before.as_list()[1:], after.as_list()[1:]
    target = entries(op.inputs[1])
    if target is not None and len(target) == after.rank:  # entries tracing computes that shape inference did not
        inner_after = [a if a is not None else (t if t is not None and t >= 0 else None)
                       for a, t in zip(inner_after, target[1:])]
    if None in inner_after:
        return mixed(op, "reshapes rows to a shape not known while tracing")
    per_row_after = int(np.prod(inner_after)) if inner_after else 1
    if None in inner_before or kind.tag.per_example is None:
        # Rows of a size not known while tracing (a sequence of unknown length) cut into rows of a known size that
        # divides the last axis (Dense on a sequence: [b, T, d] -> [b * T, d]), or into single values: each new row
        # holds one example's values, a number of them per example that tracing does not know.
        if per_row_after == 1 or inner_before and inner_before[-1] is not None and \
                inner_before[-1] % per_row_after == 0:
            return Kind(ROWS, 0, Tag(kind.tag.root, None))
        return mixed(op, "reshapes rows whose size is not known while tracing")
    per_row_before = int(np.prod(inner_before)) if inner_before else 1
    if per_row_after == 0 or per_row_before == 0:
        return kind
    per_example = kind.tag.per_example * Fraction(per_row_before, per_row_after)
    return mixed(op, "reshapes so that one row holds values of several examples") if per_example.denominator != 1 \
        else Kind(ROWS, 0, Tag(kind.tag.root, per_example))


def _transpose(op, kinds) -> Kind:
    kind, perm = kinds[0], static(op.inputs[1])
    if (early := _rows_of(op, kind, "transposes")) is not None or perm is None:
        return early or mixed(op, "transposes axes not known while tracing")
    return kind.at([int(p) for p in np.ravel(perm)].index(kind.axis))


def _expand_dims(op, kinds) -> Kind:
    kind, axis, rank = kinds[0], static(op.inputs[1]), op.outputs[0].shape.rank
    if kind.what == COUNT and rank == 1:  # tf.expand_dims(tf.shape(x)[0], -1): a shape vector of the row count alone
        return Kind(SHAPE, 0, kind.tag)
    if (early := _rows_of(op, kind, "expands")) is not None or axis is None or rank is None:
        return early or mixed(op, "expands at an axis not known while tracing")
    return kind.at(kind.axis + (int(np.ravel(axis)[0]) % rank <= kind.axis))


def _squeeze(op, kinds) -> Kind:
    kind, rank = kinds[0], op.inputs[0].shape.rank
    if kind.what == INDEX:  # tf.where's coordinates of a 1-D condition, squeezed to a vector of positions
        return kind
    dims = [int(d) % rank for d in op.get_attr("squeeze_dims")] if rank is not None else None
    if (early := _rows_of(op, kind, "squeezes")) is not None or not dims or kind.axis in dims:
        return early or mixed(op, "squeezes axes not known while tracing")
    return kind.at(kind.axis - sum(d < kind.axis for d in dims))


def _concat(op, kinds) -> Kind:
    # Concat, the old op, takes the axis first; ConcatV2 last.
    values, axis_tensor, tensors = ((kinds[1:], op.inputs[0], op.inputs[1:]) if op.type == "Concat"
                                    else (kinds[:-1], op.inputs[-1], op.inputs[:-1]))
    whats = {k.what for k in values}
    if whats <= {REP, SHAPE, COUNT, AGG} and AGG in whats:
        return AGGREGATE  # sizes that grow with the slice (e.g. a reshape's target shape)
    if whats <= {REP, SHAPE, COUNT}:  # a shape vector put together: where its row count ends up
        before = 0
        for tensor, kind in zip(tensors, values):
            if kind.what in (SHAPE, COUNT):
                if sum(k.what != REP for k in values) == 1 and op.outputs[0].shape.rank == 1:
                    return Kind(SHAPE, before + (kind.axis if kind.what == SHAPE else 0), kind.tag)
                break
            if tensor.shape.rank == 1 and tensor.shape[0] is None:
                break
            before += tensor.shape[0] if tensor.shape.rank == 1 else 1
        return mixed(op, "concatenates shapes hetero_cs cannot follow")
    along = axes(axis_tensor, op.outputs[0].shape.rank)
    if along is None or whats != {ROWS} or any(k.axis != values[0].axis or (
            k.axis != along[0] and not same_rows(k.tag, values[0].tag)) for k in values):
        return mixed(op, "concatenates values of different kinds")
    if values[0].axis != along[0]:
        return values[0]
    if values[0].axis != 0 or any(k.tag.per_example is None for k in values):
        return mixed(op, "concatenates along the batch axis")
    # Each row still one example's, but one device's order interleaves the tensors' rows differently: sums and means
    # over them are alike, a prediction row by row is not (Tag.ordered). Tensors concatenated from rows of the same
    # tags (a generator's and the data's, their labels) line up.
    return Kind(ROWS, 0, Tag(("concat", tuple(k.tag for k in values)), sum(k.tag.per_example for k in values),
                             ordered=False))


def _pack(op, kinds) -> Kind:
    rank, counts = op.outputs[0].shape.rank, [i for i, k in enumerate(kinds) if k.what == COUNT]
    if all(k.what in (REP, COUNT) for k in kinds) and rank == 1 and len(counts) == 1:
        return Kind(SHAPE, counts[0], kinds[counts[0]].tag)
    if all(k.what in (REP, AGG, COUNT) for k in kinds):
        return AGGREGATE
    first = kinds[0]
    if any(k.what != ROWS or k.axis != first.axis or not same_rows(k.tag, first.tag) for k in kinds):
        return mixed(op, "stacks values of different kinds")
    return first.at(first.axis + (op.get_attr("axis") % rank <= first.axis))


def _unpack(op, kinds) -> list[Kind]:
    kind, count = kinds[0], len(op.outputs)
    if kind.what == SHAPE:
        return [Kind(COUNT, tag=kind.tag) if i == kind.axis else REPLICATED for i in range(count)]
    early = _rows_of(op, kind, "unstacks")
    axis = op.get_attr("axis") % op.inputs[0].shape.rank if op.inputs[0].shape.rank else 0
    if early is None and axis == kind.axis:
        early = mixed(op, "unstacks along the batch axis")
    return [early or kind.at(kind.axis - (axis < kind.axis))] * count


def _split(op, kinds) -> Kind:  # Split(axis, value), SplitV(value, size_splits, axis)
    kind, axis_tensor, value = ((kinds[1], op.inputs[0], op.inputs[1]) if op.type == "Split"
                                else (kinds[0], op.inputs[2], op.inputs[0]))
    early, along = _rows_of(op, kind, "splits"), axes(axis_tensor, value.shape.rank)
    return mixed(op, "splits along the batch axis") if early is None and (along is None or along[0] == kind.axis) \
        else early or kind


def _strided_slice(op, kinds) -> Kind:
    kind = kinds[0]
    if kind.what in (AGG, COUNT):
        return AGGREGATE
    begin, end, strides = (static(t) for t in op.inputs[1:4])
    if any(v is None for v in (begin, end, strides)) or any(k.what != REP for k in kinds[1:]):
        return mixed(op, "slices at positions computed while the step runs")
    mask = {name: op.get_attr(f"{name}_mask") for name in ("begin", "end", "ellipsis", "new_axis", "shrink_axis")}
    specs = len(np.ravel(begin))
    new = [bool(mask["new_axis"] & (1 << i)) for i in range(specs)]
    shrink = [bool(mask["shrink_axis"] & (1 << i)) and not new[i] for i in range(specs)]
    if kind.what == SHAPE:
        return _sliced_shape(op, kind, begin, end, strides, mask, specs)
    if kind.what != ROWS:
        return mixed(op, f"slices a {kind} value")
    if mask["ellipsis"]:
        rank, ellipsis = op.inputs[0].shape.rank, (mask["ellipsis"] & -mask["ellipsis"]).bit_length() - 1
        covered = None if rank is None else rank - sum(1 for i in range(specs) if i != ellipsis and not new[i])
        consumed = sum(1 for i in range(ellipsis) if not new[i])  # input axes the specs before the ellipsis take
        if covered is None or not consumed <= kind.axis < consumed + covered:
            return mixed(op, "slices the batch axis (an ellipsis covers other axes)")
        # Among the ellipsis' whole axes, the batch axis moves by the new and removed axes before it.
        return kind.at(kind.axis + sum(new[:ellipsis]) - sum(shrink[:ellipsis]))
    input_axis = output_axis = 0
    for i in range(specs):
        if new[i]:
            output_axis += 1
            continue
        if input_axis == kind.axis:
            whole = (mask["begin"] & (1 << i) or int(begin[i]) == 0) and mask["end"] & (1 << i) and \
                int(strides[i]) == 1
            if not whole or shrink[i]:
                return mixed(op, "picks examples by their position in the slice (one device's positions differ)")
            return kind.at(output_axis)
        output_axis += not shrink[i]
        input_axis += 1
    return kind.at(kind.axis + output_axis - input_axis)  # past the sliced axes: moved by new and removed ones


def _sliced_shape(op, kind, begin, end, strides, mask, specs) -> Kind:
    """A shape vector sliced: is the row count among the entries kept, and where."""
    length = op.inputs[0].shape[0]
    if mask["shrink_axis"] & 1:
        return Kind(COUNT, tag=kind.tag) if int(begin[0]) % max(length or 1, 1) == kind.axis else REPLICATED
    start, stop = 0 if mask["begin"] & 1 else int(begin[0]), None if mask["end"] & 1 else int(end[0])
    if specs != 1 or length is None:
        return mixed(op, "slices a shape hetero_cs cannot follow")
    positions = list(range(length))[start:stop:int(strides[0])]
    return Kind(SHAPE, positions.index(kind.axis), kind.tag) if kind.axis in positions else REPLICATED


def _slice(op, kinds) -> Kind:
    kind, size_kind = kinds[0], kinds[2]
    if kind.what in (AGG, COUNT):
        return AGGREGATE
    if kind.what == ROWS and kinds[1].what == REP and size_kind.what == SHAPE and size_kind.axis == kind.axis and \
            size_kind.tag.root == kind.tag.root and kind.tag.per_example is not None and \
            size_kind.tag.per_example == kind.tag.per_example:
        # A size whose batch entry is these rows' own count (a Pad's gradient: the padded input's shape) keeps every
        # row, so the slice starts at row 0; the other axes are cut alike for every example.
        return kind
    begin, size = static(op.inputs[1]), static(op.inputs[2])
    if kind.what not in (ROWS, SHAPE) or begin is None or size is None:
        return mixed(op, "slices at positions computed while the step runs")
    at = kind.axis if kind.what == ROWS else 0
    start, length = int(np.ravel(begin)[at]), int(np.ravel(size)[at])
    if kind.what == SHAPE:  # part of a shape vector: the row count among its entries or not
        inside = start <= kind.axis and (length < 0 or kind.axis < start + length)
        return Kind(SHAPE, kind.axis - start, kind.tag) if inside else REPLICATED
    return kind if start == 0 and length == -1 else mixed(op, "picks examples by their position in the slice")


def _pad(op, kinds) -> Kind:
    kind, paddings = kinds[0], static(op.inputs[1])
    if (early := _rows_of(op, kind, "pads")) is not None or paddings is None:
        return early or mixed(op, "pads by amounts not known while tracing")
    return mixed(op, "pads along the batch axis") if np.any(np.asarray(paddings)[kind.axis] != 0) else kind


def _tile(op, kinds) -> Kind:
    kind, multiples = kinds[0], entries(op.inputs[1])
    if kind.what == REP and kinds[1].what == SHAPE:
        return Kind(ROWS, kinds[1].axis, kinds[1].tag)
    if kind.what != ROWS or multiples is None or multiples[kind.axis] is None:
        return mixed(op, "tiles by multiples not known while tracing")
    return kind if multiples[kind.axis] == 1 else mixed(op, "tiles along the batch axis")


def _broadcast_to(op, kinds) -> Kind:
    kind, shape = kinds[:2]
    if kind.what == REP and shape.what == SHAPE:
        return Kind(ROWS, shape.axis, shape.tag)
    if kind.what == ROWS and op.outputs[0].shape.rank is not None and op.inputs[0].shape.rank is not None:
        return kind.at(kind.axis + op.outputs[0].shape.rank - op.inputs[0].shape.rank)
    return AGGREGATE if kind.what in (AGG, COUNT) else mixed(op, "broadcasts a value hetero_cs cannot follow")


def _shape(op, kinds) -> list[Kind]:
    return [Kind(SHAPE, k.axis, k.tag) if k.what == ROWS else REPLICATED if k.what in (REP, AGG, COUNT) else
            mixed(op, f"takes the shape of a {k} value") for k in kinds[:len(op.outputs)]]


SHAPE_RULES = {
    "Reshape": _reshape, "Transpose": _transpose, "ExpandDims": _expand_dims, "Squeeze": _squeeze,
    "ConcatV2": _concat, "Concat": _concat, "Pack": _pack, "Unpack": _unpack, "Split": _split, "SplitV": _split,
    "StridedSlice": _strided_slice, "Slice": _slice, "Pad": _pad, "PadV2": _pad, "MirrorPad": _pad, "Tile": _tile,
    "BroadcastTo": _broadcast_to, "Shape": _shape, "ShapeN": _shape,
}
