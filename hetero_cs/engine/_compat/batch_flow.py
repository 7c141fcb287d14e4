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

import dataclasses
import functools
from typing import Any

import tensorflow as tf

from hetero_cs.engine._compat.batch_kinds import COUNT, LIST, MIXED, REP, REPLICATED as _REP, ROWS, Kind, Tag
from hetero_cs.engine._compat.batch_kinds import captured, join, mixed
from hetero_cs.engine._compat.batch_rules import rule


@dataclasses.dataclass(frozen=True)
class _Scope:
    """A graph being read with its inputs' kinds (the graph is kept alive, so its id stays its own)."""

    key: Any
    graph: Any = None
    inputs: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)


_TOP = _Scope(None)
_NESTED = {**dict.fromkeys(("PartitionedCall", "StatefulPartitionedCall"), "_call"),
           **dict.fromkeys(("While", "StatelessWhile"), "_while"),
           **dict.fromkeys(("If", "StatelessIf", "Case", "StatelessCase"), "_cond")}  # ops whose graphs are read


class BatchFlow:
    """The batch-flow analysis of one replica step: seeds (what the strategy knows) and the kinds derived from them.

    Args:
        replica_id: The replica's, which names its batch (the tag of its rows).
    """

    def __init__(self, replica_id: int = 0):
        self.batch = Tag(("batch", replica_id))
        self._seeds: dict = {}  # tensor ref -> Kind
        self._memo: dict = {}  # (scope key, tensor ref) -> Kind
        self._scopes: list = []

    # -- seeds ------------------------------------------------------------------------------------------------------
    def seed(self, tensors, kind) -> None:
        """``tensors`` have ``kind`` (a Kind, or a function of the tensor that gives it)."""
        for tensor in tf.nest.flatten(tensors, expand_composites=True):
            if isinstance(tensor, tf.Tensor):
                self._seeds[tensor.ref()] = kind(tensor) if callable(kind) else kind

    def seed_rows(self, tensors) -> None:
        """``tensors`` hold this replica's examples along their first axis (its slice of the batch)."""
        self.seed(tensors, lambda t: Kind(ROWS, 0, self.batch) if t.shape.rank is None or t.shape.rank >= 1 else _REP)

    def seed_replicated(self, tensors) -> None:
        """``tensors`` are the same on every replica and equal to one device's values (e.g. all-reduced sums)."""
        self.seed(tensors, _REP)

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
        scope, stack = scope or _TOP, [tensor]
        while stack:
            current = stack[-1]
            key = (scope.key, current.ref())
            known = self._memo.get(key) or self._known(current, scope)  # read already, or without its inputs
            if known is not None:
                self._memo[key] = known
                stack.pop()
                continue
            pending = [t for t in current.op.inputs if (scope.key, t.ref()) not in self._memo]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            kinds, nested = [self._memo[(scope.key, t.ref())] for t in current.op.inputs], _NESTED.get(current.op.type)
            outputs = rule(current.op, kinds) if nested is None else getattr(self, nested)(current.op, kinds)
            for output, kind in zip(current.op.outputs, outputs):
                self._memo[(scope.key, output.ref())] = kind
        return self._memo[(scope.key, tensor.ref())]

    def _known(self, tensor, scope) -> Kind | None:
        known = scope.inputs.get(tensor.ref()) or self._seeds.get(tensor.ref())  # a given kind (a Kind is never falsy)
        if known is not None:
            return known
        op = tensor.op
        if op.type == "Placeholder":  # a function graph's input: follow its capture to the outer graph
            outer = captured(tensor)
            return self.kind(outer) if outer is not None else Kind(
                MIXED, reason=f"an input {tensor.name!r} of a function hetero_cs cannot trace back to the step")
        # A variable's handle (variables live once, read alike by every replica), or a constant.
        if tensor.dtype == tf.resource or op.type == "Const" or not op.inputs and op.type in ("VarHandleOp", "NoOp"):
            return _REP
        return Kind(LIST) if op.type == "EmptyTensorList" else None

    # -- nested graphs ----------------------------------------------------------------------------------------------
    def _run_graph(self, graph, input_kinds: list[Kind]) -> list[Kind]:
        scope = _Scope((id(graph), tuple(input_kinds)), graph,
                       {inner.ref(): kind for inner, kind in zip(graph.inputs, input_kinds)})
        self._scopes.append(scope)  # keeps the graph alive while its id is in a memo key
        return [self.kind(output, scope) for output in graph.outputs]

    def _call(self, op, kinds) -> list[Kind]:
        try:
            graph = op.graph._get_function(op.get_attr("f").name).graph  # noqa: SLF001 - the callee's FuncGraph
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
        if cond is not None and self._run_graph(cond, current)[0].what != REP:  # the loop's predicate
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
        # Each output's kinds over the branches, joined.
        return [functools.reduce(join, branches) for branches in zip(*(self._run_graph(g, kinds[1:]) for g in graphs))]


def flow_of(step) -> BatchFlow:
    """The replica step's batch-flow analysis (made empty when its wrapper made none: nothing is then proven)."""
    if step.flow is None:
        object.__setattr__(step, "flow", BatchFlow(step.replica_id))
    return step.flow


def seed_replica_step(step, *row_groups) -> None:
    """Tells ``step``'s batch-flow analysis what the strategy knows: each group's tensors are this replica's slice
    (one row per example), ``b_i`` is its number of examples and ``B`` is the same on every replica."""
    flow = flow_of(step)
    flow.seed_rows(row_groups)  # every tensor of every group
    # b_i, this replica's number of examples, and B (a Python number or None is no tensor of the graph: not seeded).
    flow.seed(step.batch_size, Kind(COUNT, tag=flow.batch))
    flow.seed_replicated(step.global_batch_size)
