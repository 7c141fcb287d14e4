"""Probes of idle cards off the step's path: the central-storage strategy's ``Balancer(idle_prober=...)``.

Now and then a card the plan leaves idle is timed on one example, so that the re-planner learns when it became fast
again (:mod:`hetero_cs.planning.balancer_plans`). Here that probe is a step of its own, beside training: calibration's
probe step (:class:`calibration.probe.DeviceProbe`: the central variables read onto the card, forward, loss, backward,
the gradients back on the parameter device, no update) on the first example of the global batch calibration read,
under Keras' ``StatelessScope``, so it changes no variable (BatchNormalization statistics, seed state and metrics
stay as training left them), on a thread of its own. A training step neither waits for the probed card nor changes
its set of active replicas: a probe traces no train step again and costs a step only what the host shares with it.
Its time reaches the balancer (``record_probe``) when it ends, a few steps later for a slow card.

A card's probe step is traced once, in the thread that runs ``fit``, while it serves a step's plan (no step or trace
runs in that thread then): tracing calls the model's layers, whose Python state (the list ``add_loss`` fills) a trace
in another thread could disturb. Where nothing says it is between two steps (a custom loop, which cuts its batch
inside its own step; fit with ``steps_per_execution`` above 1 or micro-batches, which take another step), a card
whose probe step is not traced yet is probed in the step, as before.

One probe runs at a time per card: a probe still running when the next is due is not started again. A probe that
fails (the card ran out of memory, or is lost) is logged; the card stays idle until the next probe. The probes' threads
are joined at exit: a probe still running when the program ends (a card thousands of times slower) delays the exit
until it ends.
"""

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import tensorflow as tf

from calibration.probe import DeviceProbe
from hetero_cs.devices.device_errors import first_line
from hetero_cs.engine.step import replica_state

logger = logging.getLogger("hetero_cs.engine.central_storage")  # the messages users filter on


class IdleProbes:
    """Runs the balancer's probes of idle replicas beside training.

    Args:
        strategy: The central-storage strategy (its devices, emulator and balancer).
    """

    def __init__(self, strategy):
        self._strategy = strategy
        self._model = self._sample = None
        self._probes: dict = {}  # replica id -> its DeviceProbe, traced
        self._running: set[int] = set()
        self._warm: set[int] = set()  # replicas whose probe step ran once (its first run sets it up: not timed)
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __deepcopy__(self, memo):  # a copied strategy probes once it calibrated its own model
        return IdleProbes(memo.get(id(self._strategy), self._strategy))

    def use(self, model, batch) -> None:
        """Probe ``model``'s training step on the first example of ``batch``, a global batch ``(x, y[, w])``."""
        self._model = model
        self._sample = tuple(None if part is None else tf.nest.map_structure(lambda t: t[:1], part) for part in batch)
        self._probes, self._warm = {}, set()

    @property
    def running(self) -> bool:
        """Whether a probe runs now."""
        return bool(self._running)

    def start(self, replicas: Sequence[int]) -> bool:
        """The balancer's ``idle_prober``: starts a probe of each replica in ``replicas`` that runs none; False (the
        step probes them) without a model, or when a probe step is not traced yet and cannot be here."""
        if self._model is None:
            return False
        untraced = [i for i in replicas if i not in self._probes]
        if untraced and not replica_state.this_threads_value("between_steps"):  # (StepPerSet sets it)
            return False
        try:
            for i in untraced:
                self._probes[i] = self._traced_probe(i)
        except Exception as exc:  # noqa: BLE001 - any failure to build the probe: the step probes the cards
            logger.warning("hetero_cs: idle cards cannot be probed beside training (%s: %s); each probe gives them "
                           "one example in a training step instead.", type(exc).__name__, first_line(exc))
            self._model = None
            return False
        with self._lock:
            todo = [i for i in replicas if i not in self._running]
            self._running.update(todo)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._strategy.num_replicas_in_sync, "hetero_cs_idle_probe")
        for i in todo:
            self._executor.submit(self._run, i)
        return True

    def _traced_probe(self, replica_id: int):
        strategy = self._strategy
        probe = DeviceProbe(self._model, self._sample, device=strategy._compute_devices[replica_id],  # noqa: SLF001
                            parameter_device=strategy._parameter_device, replica_id=replica_id,  # noqa: SLF001
                            emulator=strategy._emulator, stateless=True)  # noqa: SLF001
        probe.trace(1)  # here; it runs in the probes' thread
        return probe

    def _run(self, replica_id: int) -> None:
        try:
            probe = self._probes[replica_id]
            if replica_id not in self._warm:  # its first run sets the function up: not timed
                probe.run_step(1)
                self._warm.add(replica_id)
            self._strategy._balancer.record_probe(replica_id, 1, probe.run_step(1))  # noqa: SLF001
        except Exception as exc:  # noqa: BLE001 - a probe that fails says the card is not back; training goes on
            logger.warning("hetero_cs: the probe of idle replica %d failed (%s: %s); it stays idle until its next "
                           "probe.", replica_id, type(exc).__name__, first_line(exc))
        finally:
            with self._lock:
                self._running.discard(replica_id)

    def wait(self) -> None:
        """Waits for the probes running now to end."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
