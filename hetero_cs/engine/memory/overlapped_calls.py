"""Overlapped micro-batched steps: each card runs its micro-batches back to back, in one traced call.

With an overlapped plan (:func:`hetero_cs.planning.plan_overlapped_micro_batches`) the sub-steps of a micro-batched
step (:mod:`hetero_cs.engine.memory.micro_batches`) are traced into one call (or a few, ``MicroBatchPlan.calls``;
:class:`~hetero_cs.engine.step.sub_steps.SubStepTrace`), and within a call each card runs its micro-batches back to
back: its next one waits for its previous one only, the host sums each sub-step's gradients while the cards go on,
and the update branch of each sub-step is fixed while tracing. A card's micro-batches are timed as one chain (each
one on emulated cards) and reported to the balancer as one step (:meth:`OverlappedCalls._report_micro_batch_times`).
"""

import logging
import time
import weakref

import numpy as np
import tensorflow as tf

from hetero_cs.engine import _compat
from hetero_cs.engine.step.input_slicing import is_unbatched_marker
from hetero_cs.engine.step.model_state import restore, saved_state
from hetero_cs.engine.step.sub_steps import SubStepTrace, tracing_sub_step
from hetero_cs.planning.micro_batches import MicroBatchPlan, capacity_of, plan_micro_batches

logger = logging.getLogger("hetero_cs.engine.central_storage")

#: How many traced overlapped calls (shapes of calls: each sub-step's active replicas) a strategy keeps; a step made
#: of more distinct calls than this would trace some again at every step.
_MAX_TRACED_CALLS = 64


class OverlappedCalls:
    """The overlapped path of :class:`~hetero_cs.engine.memory.micro_batches.MicroBatching` (a base class of it, in
    its own module for size): it traces and runs the calls, and falls back on the subclass's sub-steps with a barrier
    each (``_run_sub_steps``) when a call fails."""

    def _run_overlapped(self, model, step, data, plan: MicroBatchPlan):
        """Runs ``plan``'s sub-steps in traced calls of up to ``SUB_STEPS_PER_CALL``, each card's micro-batches back
        to back within a call.

        A call traces Keras' train step once per sub-step into one graph (:class:`SubStepTrace`): sub-step ``j``
        cuts ``plan``'s ``j``-th slice sizes, runs only its active replicas, weighs every loss by ``b_ij / B``, and
        adds its summed gradient to the host's sums, except the step's last, which applies them. A card's next
        micro-batch waits for its previous one only, so no card waits for another between its micro-batches, and
        the host adds each sub-step's gradients while the cards go on; a call ends at a barrier.

        When anything in a call fails (out of memory, a failing card, any error), everything the step changed is put
        back (the non-trained and metric variables, the optimizer's iteration count, the gradient sums), and the
        batch runs again as sub-steps with a barrier each, one call per sub-step, where out-of-memory recovery and
        failover handle each sub-step (:meth:`_run_sub_steps`); an error there is raised as it is.
        """
        B = plan.global_batch_size
        calls = self._overlapped_calls(model, plan)
        if not self._checked:
            function, arguments = calls[0]
            function.get_concrete_function(*arguments(data))  # found while tracing
            self._checked = True
            refusal = self._refusal()
            if refusal is not None:
                return self._one_step_instead(step, data, plan, refusal)
        self._log_plan(plan)
        iterations = _compat.iteration_counter(getattr(model, "optimizer", None))  # None without an optimizer
        saved = saved_state(model, extra=() if iterations is None else (iterations,))
        with self._lock:
            self._micro_times = []
        started = time.perf_counter()
        warm = all(getattr(function, "_hetero_ran", False) for function, _ in calls)  # each traced and run once
        try:
            for function, arguments in calls:
                outputs = function(*arguments(data))  # returns once the call ran
                function._hetero_ran = True
        except BaseException as exc:  # every failure is undone, then the barrier path decides (an Exception's)
            self._zero()
            restore(saved)
            if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: as they are
                raise
            self.fallbacks += 1
            self.last_run_as_planned = False
            logger.info("hetero_cs: the overlapped micro-batched step failed (%s: %s); running this batch of %d "
                        "examples as sub-steps with a barrier each.", type(exc).__name__,
                        str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "", B)
            # Even one sub-step runs through the sub-step loop: one that runs out of memory again, beyond what the
            # lowered caps hold, is cut finer there instead of failing the step.
            return self._run_sub_steps(model, step, data, plan_micro_batches(
                B, self.plan_for_sub_step, capacity=capacity_of(self._strategy.balancer.max_batch_sizes),
                sub_step_overhead_s=self._overhead_s(self._overheads)))
        predicted = plan.predicted_makespan_s
        if warm and predicted is not None:  # a call's first run traces: its time is not the host's
            with self._lock:
                self._step_overheads.append(max(0.0, (time.perf_counter() - started - predicted) / len(calls)
                                                + plan.sub_step_overhead_s))
        self.overlapped_steps += 1
        self.micro_batched_steps += 1
        self._report_micro_batch_times(plan)  # the monitor's step; a card that drifted is planned again
        # Each card's micro-batches fitted: a lowered memory cap may grow back, as after any step that fitted.
        recovery = getattr(self._strategy, "_step_recovery", None)
        for change in self._strategy.balancer.record_step_success(plan.micro_batch_sizes):
            if recovery is not None:
                recovery._note(change)  # noqa: SLF001 - logged and written back as the recovery's own changes
        return outputs

    def _record_micro_batches(self, replica_id: int, examples: int, seconds: float, count: int) -> None:
        """Called from TensorFlow threads during an overlapped call: ``count`` micro-batches of ``replica_id`` ran
        ``examples`` examples in ``seconds`` (see :class:`SubStepTrace`)."""
        with self._lock:
            self._micro_times.append((int(replica_id), int(examples), float(seconds), int(count)))

    def _report_micro_batch_times(self, plan: MicroBatchPlan) -> None:
        """Hands the step's per-card times (kept by :meth:`_record_micro_batches`) to the balancer as one step."""
        with self._lock:
            reports, self._micro_times = self._micro_times, []
        if not reports:
            return
        R = self._strategy.balancer.num_replicas
        # Per replica: examples, seconds and micro-batches summed over its reports (in the order they came).
        sizes, times, counts = ([sum((report[k] for report in reports if report[0] == i), zero) for i in range(R)]
                                for k, zero in ((1, 0), (2, 0.0), (3, 0)))
        if sizes != list(plan.per_replica_batch_sizes):  # a report missing (a sampled step): nothing to pair
            return
        self._strategy.balancer.record_micro_batched_step(sizes, times, counts)

    def _overlapped_calls(self, model, plan: MicroBatchPlan) -> list:
        """``(traced call, its arguments given the batch: its rows, its cut [k, R], B)`` per call of ``plan``'s
        step."""
        calls = self._call_cache.get((plan, id(model)))
        if calls is not None:
            return calls
        calls, start, last = [], 0, len(plan.calls) - 1
        B = tf.constant(plan.global_batch_size, tf.int32)
        for index, part in enumerate(plan.calls):
            end = start + sum(p.global_batch_size for p in part)
            cuts = tf.constant(np.asarray([p.per_replica_batch_sizes for p in part], np.int64))

            def arguments(data, a=start, b=end, cuts=cuts):  # a step of one call takes the whole batch as it is
                return data if last == 0 else rows_of(data, a, b), cuts, B

            calls.append((self._overlapped_function(model, part, applies=index == last), arguments))
            start = end
        if len(self._call_cache) > 64:
            self._call_cache.clear()
        self._call_cache[(plan, id(model))] = calls
        return calls

    def _overlapped_function(self, model, sub_step_plans, *, applies: bool):
        """The traced overlapped call for ``model`` and these sub-steps' shape (how many, each one's active replicas,
        whether the call applies the sums); called as ``function(rows, cuts, B)``."""
        R = self._strategy.balancer.num_replicas
        # Each sub-step's active replicas (None: every replica).
        actives = tuple(None if all(b > 0 for b in p.per_replica_batch_sizes)
                        else tuple(i for i, b in enumerate(p.per_replica_batch_sizes) if b > 0) for p in sub_step_plans)
        key = (id(model), actives, applies)
        with self._lock:
            found = self._overlapped_functions.get(key)
            if found is not None and found[0]() is model:
                self._overlapped_functions.move_to_end(key)
                return found[1]
        strategy = self._strategy
        K = len(actives)
        # Each card's micro-batches in this call: which sub-steps it is active in (fixed by the traced shape).
        active_in = {i: [j for j in range(K) if actives[j] is None or i in actives[j]] for i in range(R)}
        last_of = {i: js[-1] for i, js in active_in.items() if js}
        counts = {i: len(js) for i, js in active_in.items() if js}
        record = self._record_micro_batches if strategy._timing_enabled else None  # noqa: SLF001

        def overlapped_call(data, cuts, global_batch_size):
            ends, stamps, chain_starts = {}, {}, {}  # per replica, shared by the call's sub-steps
            with tf.device(strategy._parameter_device):  # noqa: SLF001 - host scalars, read by the host's clock
                chain_sizes = {i: tf.reduce_sum(tf.reshape(cuts, [K, R])[:, i]) for i in last_of}
            start = tf.constant(0, tf.int64)
            for j in range(K):
                size = tf.reduce_sum(cuts[j])
                rows = rows_of(data, start, start + size)
                start = start + size
                with tracing_sub_step(SubStepTrace(j, K, global_batch_size, tf.reshape(cuts[j], [R]), actives[j], ends,
                                                   stamps, applies=applies, last_of=last_of, counts=counts,
                                                   chain_sizes=chain_sizes, chain_starts=chain_starts, record=record)):
                    outputs = _compat.reduced_step_outputs(strategy.run(model.train_step, args=(rows,)), strategy)
            return outputs  # the last sub-step's (K >= 1)

        function = tf.function(overlapped_call, autograph=False, reduce_retracing=True)
        with self._lock:
            while len(self._overlapped_functions) >= _MAX_TRACED_CALLS:  # the least recently used goes
                self._overlapped_functions.popitem(last=False)
            self._overlapped_functions[key] = (weakref.ref(model), function)
        return function



def rows_of(data, start: int, end: int):
    """Examples ``[start, end)`` of a distributed element holding whole global batches (None leaves kept)."""

    def cut(leaf):
        parts = _compat.components(leaf)
        whole = parts is not None and len(parts) == 1 and not is_unbatched_marker(parts[0])  # a whole global batch
        return _compat.per_replica([parts[0][start:end]]) if whole else leaf

    return tf.nest.map_structure(cut, data, expand_composites=False)
