"""Private touches of Keras' trainer and layers: fit's callbacks and errors, layer walks for emulation.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches.
"""

import inspect
import logging
import time
import weakref

import keras
import tensorflow as tf

from hetero_cs.devices.device_errors import is_out_of_memory
from hetero_cs.engine.step import idle_replicas
from hetero_cs.engine.step.input_slicing import BatchCount, empty_input_error, is_unbatched_marker
from hetero_cs.engine._compat import replica_xla, symbols
from hetero_cs.engine._compat.context import global_batch_size_of, is_hetero_strategy, is_multi_worker_strategy
from hetero_cs.engine._compat.context import is_ours, refuse_a_model_from_outside_the_scope, strategy_of
from hetero_cs.engine._compat.layers import all_sublayers
from hetero_cs.engine._compat.multi_worker import run_entry_point
from hetero_cs.engine._compat.replica_pass import keras_train_step, keras_trainer
from hetero_cs.engine._compat.symbols import patch
from hetero_cs.errors import ConfigError, DeviceFaultError, HeteroCSError, StepOOMError
from hetero_cs.planning.micro_batches import capacity_of

logger = logging.getLogger("hetero_cs.engine.central_storage")


def patch_entry_points() -> None:
    # fit, evaluate and predict are the entry points that know both the model and the data. Under our strategies
    # each binds its arguments once and runs the strategy's version: under the central-storage strategy fit gets a
    # callback that calibrates on the first global batch (auto_balance) and reports per-replica step times, the
    # straggler wait and the plan in the logs, and the three mark their inputs and steps (training or inference) and
    # raise the library's errors for TensorFlow's; the multi-worker strategy's is multi_worker.run_entry_point. Other
    # strategies are untouched.
    for name in ("fit", "evaluate", "predict"):
        patch(keras_trainer(), name)(_entry_point)


def _entry_point(original, self, *args, **kwargs):
    strategy, verb = strategy_of(self), original.__name__
    if verb == "fit":
        refuse_a_model_from_outside_the_scope(self, strategy)
    if not is_ours(strategy):
        return original(self, *args, **kwargs)
    if verb == "fit":
        note_per_example_randomness(self)
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    bound.apply_defaults()
    run = run_entry_point if is_multi_worker_strategy(strategy) else _fit if verb == "fit" else _evaluate_or_predict
    return run(original, self, strategy, bound)


def _fit(original, self, strategy, bound):
    """``fit`` under the central-storage strategy (see :func:`patch_entry_points`)."""
    examples, batch_size = _examples_and_batch_size(bound.arguments, steps="steps_per_epoch")
    split = bound.arguments.get("validation_split") or 0.0
    if examples is not None and 0.0 < split < 1.0:  # an epoch of arrays ends on a batch of N % B examples
        examples = int(examples * (1.0 - split))  # Keras keeps the first part for training (floored)
    idle_replicas.anticipate_last_batch(strategy, examples, batch_size, training=True)
    callbacks, counted = bound.arguments.get("callbacks"), BatchCount("fit")
    bound.arguments["callbacks"] = [*strategy._fit_callbacks(self, callbacks, bound.arguments), counted]  # noqa: SLF001
    # fit distributes its training data first and validation data later (hetero_cs.engine.step.input_roles).
    distributed = isinstance(bound.arguments.get("x"), tf.distribute.DistributedDataset)
    try:
        with strategy._input_roles.fitting(training_input_pending=not distributed):  # noqa: SLF001
            history = original(*bound.args, **bound.kwargs)
        counted.check(counted.epochs > 0 and bound.arguments.get("steps_per_epoch") != 0)
        return history
    except StopIteration as exc:
        # Keras lets the distributed iterator's StopIteration escape when the dataset has no batch at all.
        raise empty_input_error("fit") from exc
    except tf.errors.OpError as exc:
        replica_error = strategy._replica_step_error(exc, replica_scopes=(self.name,))  # noqa: SLF001
        if replica_error is None:
            raise
        raise replica_error from exc
    except (DeviceFaultError, StepOOMError) as exc:  # a DeviceFaultError is a RuntimeError: before the clause below
        _raise_with_tensorflow_cause(exc)
    finally:  # fit may raise mid-epoch: the log records held while its progress bar drew are passed on
        for callback in bound.arguments["callbacks"]:
            getattr(callback, "release_held_logs", lambda: None)()


def _raise_with_tensorflow_cause(exc):
    """Raises ``exc`` (a StepOOMError or DeviceFaultError) chained to TensorFlow's error again: Keras' traceback
    filtering re-raises errors from inside fit, evaluate and predict "from None"."""
    if exc.__cause__ is None and exc.last_error is not None:
        raise exc from exc.last_error
    raise exc


def _next_batch(iterator):
    """The next element of a distributed iterator, read eagerly; StopIteration at its end, as Keras' loops expect."""
    try:
        return iterator.get_next()
    except tf.errors.OutOfRangeError:
        raise StopIteration from None


_randomness_noted: "weakref.WeakSet" = weakref.WeakSet()  # models whose random layers were named once


def note_per_example_randomness(model) -> None:
    """Says once per model (INFO) which of its layers draw random values per example (Dropout, noise, random
    augmentation: every layer that holds a Keras SeedGenerator). Each replica draws its own values for its slice, so
    training matches one device in distribution, not value for value."""
    if model in _randomness_noted:
        return
    _randomness_noted.add(model)
    random = [layer.name for layer in all_sublayers(model) if layer is not model and any(
        isinstance(value, keras.random.SeedGenerator) for value in vars(layer).values())]
    if random:
        logger.info("hetero_cs: layers that draw random values per example (%s): each replica draws its own for its "
                    "slice, so training matches one device in distribution, not value for value (switch them off to "
                    "compare runs).", ", ".join(random))


def patch_make_train_function() -> None:
    # Keras' train function reads the next batch inside its tf.function (iterator.get_next()), so a step that
    # fails cannot run again on the same batch, and its plan is decided inside the step. Under our strategy with
    # steps_per_execution == 1 the train function is wrapped: the batch is read eagerly from the distributed iterator,
    # then the step runs through Keras' own path for batches given as a Python iterable (`function([data])` ->
    # one_step_on_data(data), a reduce_retracing tf.function): fit's step is served its plan first and runs the
    # function traced for the plan's set of active replicas (idle_replicas.StepPerSet: one Keras train function per
    # set), and a retry re-runs the same batch, re-cut by a new plan, without retracing. Other strategies and other
    # steps_per_execution take Keras' path unchanged (train_on_batch runs as fit: _compat.on_batch).

    # Where one train function runs every set (steps_per_execution above 1, micro-batches), it is traced again, right
    # before a step, when plans have used a set of idle replicas since it was traced (idle_replicas): the step then
    # has a branch in which those replicas do no work. Private: Keras keeps the traced step in model.train_function
    # and calls it anew for every step; make_train_function(force=True) builds a new one.
    @patch(keras_trainer(), "make_train_function")
    def make_train_function(keras_make, self, force=False):
        result = _made_without_whole_step_xla(keras_make, self, force)
        strategy, function = strategy_of(self), self.train_function
        if not is_hetero_strategy(strategy) or function is None or getattr(function, "_hetero_wrapped", False):
            return result
        active_sets = strategy._active_sets  # noqa: SLF001
        active_sets.mark_traced_function(function, active_sets.version(training=True))
        micro, recovery = strategy._micro_batching, getattr(strategy, "_step_recovery", None)  # noqa: SLF001
        micro.forget_findings()  # this model's step is traced at its first call
        current = [function]
        # XLA per replica compiles the weighted step only: a model compiled with jit_compile=True runs its card
        # alone's weighted step (a check of two attributes per step, not of the layers).
        set_steps = idle_replicas.StepPerSet(strategy, lambda: _made_step(keras_make, self, train_function),
                                             whole_allowed=lambda: not replica_xla.requested(self)) \
            if strategy.num_replicas_in_sync > 1 else None  # the central-storage strategy (is_hetero_strategy)

        def trace_again_if_needed():
            idle_sets_new = active_sets.traced_with.get(current[0], 0) < active_sets.version(training=True)
            # A step traced before micro-batching was armed does not read its host state: traced again once.
            micro_new = micro.armed and not getattr(current[0], "_hetero_micro", False)
            if idle_sets_new or micro_new:
                logger.info("hetero_cs: tracing the train step again: %s.", "plans now leave replicas idle (active "
                            f"sets {list(active_sets.for_trace(training=True))})" if idle_sets_new
                            else "global batches now run as micro-batches")
                known = active_sets.version(training=True)
                strategy._balancer.step_traced_again()  # noqa: SLF001 - a guard trial's next steps pay for the trace
                current[0] = _made_step(keras_make, self, train_function)
                micro.forget_findings()  # found again while the new step is traced
                current[0]._hetero_micro = micro.armed
                active_sets.mark_traced_function(current[0], known)

        def per_set() -> bool:
            # A step traced per set of active replicas (idle_replicas.StepPerSet) reads no micro-batching state.
            return set_steps is not None and not micro.armed and not self.run_eagerly

        def train_function(iterator):
            if strategy._resume_skip > 0 and isinstance(iterator, tf.distribute.DistributedIterator):  # noqa: SLF001
                return skip_applied_batches(self, strategy, iterator)
            in_hand = self.steps_per_execution == 1 and isinstance(iterator, tf.distribute.DistributedIterator)
            if not (in_hand and per_set()):
                trace_again_if_needed()
            recovering = recovery is not None and in_hand and recovery.armed()
            micro_batching = in_hand and micro.may_apply()
            plan = None  # the one-step plan a micro-batching step was served, to time it for a guard trial
            if not (recovering or micro_batching or (in_hand and per_set())):
                return current[0](iterator)
            data = _next_batch(iterator)  # eager: the batch stays in hand for a retry, its sub-steps, its plan
            try:

                def run(batch):
                    return set_steps(batch, global_batch_size_of(batch)) if per_set() else train_function([batch])

                def one_step(batch):
                    # The model's name scopes its forward ops, which run in the replicas only (blame by op name). A
                    # retry whose new plan idles a replica runs that set's step.
                    return recovery.run(run, batch, replica_scopes=(self.name,), model=self) if recovering \
                        else run(batch)

                if micro_batching:
                    # The plan's, or the guard's pick while it tries an overlapped plan side by side (timed here).
                    plan = micro.plan_to_run(global_batch_size_of(data), overlapped=not self.run_eagerly)
                    started = time.perf_counter()
                    if plan.num_sub_steps > 1:
                        micro.arm()  # the next call traces the step again, reading the sub-step state
                        outputs = micro.run(self, one_step, data, plan)
                        micro.observe_run(plan, time.perf_counter() - started)
                        return outputs
                try:
                    outputs = one_step(data)
                    if plan is not None:
                        micro.last_run_as_planned = True
                        micro.observe_run(plan, time.perf_counter() - started)
                    return outputs
                except (DeviceFaultError, StepOOMError) as exc:
                    # A card was set aside, or lost memory, and the cards cannot hold the batch in one step any more:
                    # sub-steps, where allowed (the failed step changed nothing). Caps the failure just set count (a
                    # step of fixed shares or an even split had none before it).
                    if not (in_hand and micro.may_apply()):
                        raise
                    plan = micro.plan_after_failure(global_batch_size_of(data), overlapped=not self.run_eagerly)
                    if plan.num_sub_steps == 1 or recovery is None or (
                            isinstance(exc, DeviceFaultError) and not recovery.failover.exclusions):
                        raise
                    logger.info("hetero_cs: the memory caps %s no longer hold a global batch of %d examples in one "
                                "step; it runs as %d sub-steps.", self._distribute_strategy.balancer.max_batch_sizes,
                                plan.global_batch_size, plan.num_sub_steps)
                    micro.arm()
                    return micro.run(self, one_step, data, plan)
            except StopIteration as exc:
                # Raised inside a step whose batch was read (a planner's, a retry's): a bug, not the end of the data,
                # which Keras' loop would take it for (ending the epoch, or fit as "the dataset is empty").
                raise RuntimeError("hetero_cs: a StopIteration was raised inside a training step whose batch was "
                                   "already read; it is not the end of the data, so training stops here instead of "
                                   "ending the epoch early. This is a bug in hetero_cs or in the model's train_step: "
                                   "please report it with the traceback.") from exc

        train_function._hetero_wrapped = True
        self.train_function = train_function
        return result


def _made_step(keras_make, model, wrapper, attribute="train_function"):
    """A new, untraced Keras step function of ``model`` (Keras keeps ``wrapper`` as ``model.<attribute>``)."""
    _made_without_whole_step_xla(keras_make, model, force=True)
    made = getattr(model, attribute)
    setattr(model, attribute, wrapper)
    return made


def reduced_step_outputs(outputs, strategy):
    """A train step's per-replica outputs reduced as Keras' own train function reduces them (its logs)."""
    # Private: Keras' train function reduces the replicas' outputs with reduce_per_replica(..., reduction="auto")
    # (keras.src.backend.tensorflow.trainer); an overlapped micro-batched call runs Keras' train_step in a function
    # of its own and must return the same logs.
    keras_module = symbols.require("keras.src.backend.tensorflow.trainer")
    return keras_module.reduce_per_replica(outputs, strategy, reduction="auto")


def skip_applied_batches(model, strategy, iterator) -> dict:
    """Reads and drops the next ``steps_per_execution`` batches: a resumed epoch's batches that were applied before
    the restart (hetero_cs.engine.faults.backup). Returns the logs of the metrics as restored (empty before they exist)."""
    for _ in range(model.steps_per_execution):
        _next_batch(iterator)
        strategy._resume_skip -= 1  # noqa: SLF001
    try:
        return model.get_metrics_result()
    except (ValueError, AttributeError, TypeError):  # compiled metrics not built before the first real step
        return {}


def set_initial_epoch(model, epoch: int | None) -> None:
    """Makes the next ``fit`` start at ``epoch`` (None: as fit's own ``initial_epoch`` says). Private: Keras' fit
    reads ``model._initial_epoch`` after ``on_train_begin``, as its own BackupAndRestore sets it."""
    model._initial_epoch = epoch


def patch_inference_functions() -> None:
    # An evaluation or prediction batch larger than what the training memory caps hold runs as sub-steps within
    # them (hetero_cs.engine.memory.micro_batches.MicroBatching.run_inference), and one that runs out of memory lowers the
    # cap and runs again (hetero_cs.engine.memory.oom_recovery.StepRecovery.run); a step traced before
    # micro-batching was armed is traced again first. Private: Keras keeps the traced steps in model.test_function and
    # model.predict_function and builds them with make_test_function / make_predict_function(force=True).
    for maker in ("make_test_function", "make_predict_function"):
        patch(keras_trainer(), maker)(_make_inference_function)


def _made_without_whole_step_xla(keras_make, model, force=False):
    """Keras' ``make_*_function`` (``keras_make``) run on ``model``, building under our strategies a step that XLA
    does not compile whole.

    With ``jit_compile=True`` Keras wraps its whole distributed step (``strategy.run`` and the reduction of its
    outputs) in one ``tf.function(jit_compile=True)``. XLA cannot compile ours: the per-replica cut and timing run on
    the host, through Python (``tf.numpy_function``), and under central storage the replicas read the variables on
    the parameter device. Keras' train_step compiles each replica's forward and backward pass instead
    (hetero_cs.engine._compat.replica_xla). Private: Trainer._jit_compile is what the ``jit_compile`` property reads while
    Keras builds the step; it is restored right after, so ``model.jit_compile`` stays what the user compiled with.
    """
    ours = is_ours(strategy_of(model))
    if ours:
        replica_xla.check_setting(model)  # jit_compile="yes" would ask XLA for the whole step
    if not ours or getattr(model, "_jit_compile", None) is not True:
        return keras_make(model, force=force)
    if keras_make.__name__ == "make_train_function":
        replica_xla.warn_at_fit(model, keras_train_step())  # XLA per replica, or a warning saying why not
    model._jit_compile = False  # noqa: SLF001
    try:
        return keras_make(model, force=force)
    finally:
        model._jit_compile = True  # noqa: SLF001


def _make_inference_function(keras_make, self, force=False):
    """Keras' ``make_test_function`` or ``make_predict_function`` (``keras_make``), its step wrapped under our
    strategy (see :func:`patch_inference_functions`)."""
    predicting = keras_make.__name__ == "make_predict_function"
    attribute = "predict_function" if predicting else "test_function"
    result = _made_without_whole_step_xla(keras_make, self, force)
    strategy, function = strategy_of(self), getattr(self, attribute)
    if not is_hetero_strategy(strategy) or function is None or getattr(function, "_hetero_wrapped", False):
        return result
    micro, recovery = strategy._micro_batching, getattr(strategy, "_step_recovery", None)  # noqa: SLF001
    function._hetero_micro = micro.armed
    current = [function]

    def wrapped(data, nested=False):
        if micro.armed and not getattr(current[0], "_hetero_micro", False):
            current[0] = _made_step(keras_make, self, wrapped, attribute)
            current[0]._hetero_micro = True
        step = current[0]
        recovering = not nested and recovery is not None and recovery.memory_recovery and recovery.armed()
        if self.steps_per_execution != 1 or not (micro.may_apply() or recovering):
            return step(data)
        # Keras' predict loop reads the batch itself and passes [element]; evaluate's passes the iterator.
        element = (data[0] if isinstance(data, (list, tuple)) and len(data) == 1 else None) if predicting else \
            _next_batch(data) if isinstance(data, tf.distribute.DistributedIterator) else None
        if element is None:
            return step(data)

        def attempt(element):
            size, capacity = global_batch_size_of(element), capacity_of(strategy.balancer.max_batch_sizes)
            if nested or not micro.may_apply() or size is None or capacity is None or size <= capacity:
                return step([element])
            micro.arm()  # the next call traces the step again, reading the sub-step state
            return micro.run_inference(lambda batch: wrapped([batch], nested=True), element, predicting=predicting)

        # An out-of-memory step lowers the cap and runs the batch again (hetero_cs.engine.memory.oom_recovery).
        return recovery.run(attempt, element, replica_scopes=(self.name,), model=self, training=False) if recovering \
            else attempt(element)

    wrapped._hetero_wrapped = True
    setattr(self, attribute, wrapped)
    return result


def _evaluate_or_predict(original, self, strategy, bound):
    """``evaluate`` or ``predict`` under the central-storage strategy (see :func:`patch_entry_points`). A bad batch,
    found in the input pipeline, raises the library's own error, not TensorFlow's around it (as fit does)."""
    predicting = original.__name__ == "predict"
    # A step function traced before plans used a set of idle replicas is traced again, with a branch for it
    # (hetero_cs.engine.step.idle_replicas). Private: Keras keeps its traced step functions in these attributes and
    # traces them again when they are None.
    attribute = "predict_function" if predicting else "test_function"
    active_sets = strategy._active_sets  # noqa: SLF001
    idle_replicas.anticipate_last_batch(strategy, *_examples_and_batch_size(bound.arguments))
    active_sets.refresh(self, attribute, training=False)
    known = active_sets.version(training=False)
    # An evaluate of an empty dataset of unknown size runs no batch (predict fails below without one); fit's
    # validation pass hands on fit's own callback list and is left alone.
    counted, callbacks = BatchCount("evaluate"), bound.arguments.get("callbacks")
    counting = not predicting and not isinstance(callbacks, keras.callbacks.CallbackList)
    if counting:
        bound.arguments["callbacks"] = [*(callbacks or []), counted]
    try:
        with strategy._input_roles.inferring(predicting=predicting):  # noqa: SLF001 - its inputs and steps infer
            result = original(*bound.args, **bound.kwargs)
        counted.check(counting and bound.arguments.get("steps") != 0)
        return result
    except (StopIteration, UnboundLocalError) as exc:
        # An input with no batch: the model's build reads none (StopIteration), or Keras' predict loop ends before
        # its first output exists ("batch_outputs" is unbound); fit's InputError, likewise.
        if isinstance(exc, UnboundLocalError) and "batch_outputs" not in str(exc):
            raise
        raise empty_input_error(original.__name__) from exc
    except tf.errors.OpError as exc:
        error = strategy._input_error_raised(exc)  # noqa: SLF001 - None: the step's own error
        if error is None and is_out_of_memory(exc):
            # Out of memory, not recovered (recovery off, or not armed): the library's error naming the replica.
            error = strategy._replica_step_error(  # noqa: SLF001
                exc, replica_scopes=(self.name,), kind="prediction" if predicting else "evaluation")
        if error is None:
            raise
        raise error from exc
    except StepOOMError as exc:
        _raise_with_tensorflow_cause(exc)
    finally:
        active_sets.mark_traced_function(getattr(self, attribute, None), known)


def _examples_and_batch_size(arguments, *, steps: str = "steps") -> tuple[int | None, int | None]:
    """``(N, B)`` of a fit, evaluate or predict call on arrays (``arguments``: its bound arguments; Keras' default
    batch size 32), else ``(None, None)`` (a dataset, or a number of ``steps``)."""
    x = arguments.get("x")
    arrays = arguments.get(steps) is None and not isinstance(x, (tf.data.Dataset, tf.distribute.DistributedDataset))
    shape = getattr(next(iter(tf.nest.flatten(x)), None), "shape", None) if arrays else None  # the first leaf's
    unknown = shape is None or len(shape) == 0 or shape[0] is None
    return (None, None) if unknown else (int(shape[0]), int(arguments.get("batch_size") or 32))


def patch_symbolic_build() -> None:
    # Under any tf.distribute strategy, Keras' fit/evaluate/predict build the model and its metrics symbolically
    # from a first batch, which they read by opening an iterator over the data and discarding it. That extra
    # iteration moves a dataset that reshuffles on each iteration (Dataset.shuffle, a shuffling PyDataset), so
    # training would see other batches than on one device. The build only needs shapes and dtypes: under our
    # strategies it takes them from the user dataset's element spec instead, and reads nothing. Under the
    # multi-worker strategy this also avoids the original's strategy.reduce("MEAN", batch) over the cluster
    # (keras-team/keras#20585).
    @patch(keras_trainer(), "_maybe_symbolic_build")
    def _maybe_symbolic_build(original, self, iterator=None, data_batch=None):
        # Private: TFEpochIterator keeps the distributed dataset it iterates in _distributed_dataset.
        distributed = getattr(iterator, "_distributed_dataset", None)
        spec = getattr(distributed, "source_element_spec", None)
        if not is_ours(strategy_of(self)):
            return original(self, iterator=iterator, data_batch=data_batch)
        if data_batch is not None or spec is None:
            return _built_or_explained(self, lambda: original(self, iterator=iterator, data_batch=data_batch))
        source = distributed.source_dataset
        if source is not None and int(source.cardinality()) == 0:
            raise StopIteration  # what the original's read raises on a dataset known to be empty (fit: InputError)
        shapes = tf.nest.map_structure(lambda leaf: None if is_unbatched_marker(leaf) else leaf, spec)
        with strategy_of(self).scope():
            _built_or_explained(self, lambda: self._symbolic_build(data_batch=shapes))  # noqa: SLF001 - as the original


def _built_or_explained(model, build):
    """``build()``, Keras' symbolic build of ``model`` from its first batch's shapes; a ConfigError that says why
    when Keras cannot build it that way (a model with only ``train_step``, or a batch whose leading axis is not the
    examples, as the metric-learning example's stack of anchors and positives)."""
    try:
        return build()
    except (ValueError, RuntimeError) as exc:
        if isinstance(exc, HeteroCSError) or "Mixing different tf.distribute.Strategy" in str(exc):
            raise  # ours, or an optimizer made outside the scope (fit's own ConfigError says so)
        raise ConfigError(
            f"Keras could not build {type(model).__name__} from its first batch's shapes, which it does before the "
            f"first step under any tf.distribute strategy (one device builds a model at its first step): {exc} "
            "Build the model before fit, evaluate or predict (call it once on a batch, or set model.built = True "
            "once its sub-models are built), and give it batches whose leading axis holds the examples: a strategy "
            "cuts every input component along it.") from exc

