"""What ``hetero-cs launch`` checks and hands each worker: ports, ``TF_CONFIG``, ``--emulate`` entries, GPUs.

No TensorFlow is imported here.
"""

import contextlib
import json
import socket
from collections.abc import Sequence

from hetero_cs.devices.catalog import get_device_spec
from hetero_cs.devices.logical import MAX_EMULATED_REPLICAS_PER_WORKER
from hetero_cs.errors import ConfigError
from hetero_cs.supervisor import checked_int

MAX_WORKERS = 256
"""Most worker processes one launch starts on this machine (each is a TensorFlow process)."""

_EXAMPLE_NAMES = ("A10", "T4", "P100")


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that were free on ``host`` a moment ago (bound to port 0, then released).

    Another process may take one before a worker binds it; the worker then fails to start and the launch fails
    with its error (rerun it).
    """
    with contextlib.ExitStack() as held:  # every socket stays bound until all ports are read: they differ
        sockets = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


def tf_config(ports: Sequence[int], index: int, host: str = "127.0.0.1") -> str:
    """The ``TF_CONFIG`` JSON of worker ``index`` in a cluster of one worker per port."""
    return json.dumps({"cluster": {"worker": [f"{host}:{port}" for port in ports]},
                       "task": {"type": "worker", "index": int(index)}})


def parse_emulate(text: str | None, num_workers: int) -> list[str] | None:
    """``"A10,T4"`` -> ``["A10", "T4"]``: one entry per worker, each a catalog device or several joined by ``+``.

    ``"A10+T4,P100+T4"`` gives each of 2 workers two local replicas (worker 0 emulates an A10 and a T4, worker 1 a
    P100 and a T4). Every worker needs the same number of replicas (MultiWorkerMirroredStrategy's rule).

    Raises:
        ConfigError: The list does not name one entry per worker, has an empty name, or gives the workers different
            numbers of replicas.
        UnknownEmulatedDeviceError: A name is not in the catalog.
    """
    return None if text is None else check_emulate([name.strip() for name in text.split(",")], num_workers,
                                                    written=text)


def check_emulate(names: Sequence[str], num_workers: int, *, written: str | None = None) -> list[str]:
    """``names`` as a list of per-worker entries (``"A10"`` or ``"A10+T4"``), checked (see :func:`parse_emulate`)."""
    shown = repr(written) if written is not None else repr(names)
    examples = [_EXAMPLE_NAMES[i % 3] for i in range(max(num_workers, 1))]
    if isinstance(names, str) or not all(isinstance(name, str) for name in names):
        raise ConfigError(f"emulate must be a list of catalog names (str), one per worker. Received: {names!r}. "
                          f"Example: emulate={examples!r}.")
    groups = [[part.strip() for part in name.split("+")] for name in names]
    if any(not part for group in groups for part in group):
        raise ConfigError(f"--emulate has an empty name in {shown}: name one catalog device per worker, "
                          f"comma-separated, e.g. --emulate {','.join(examples)} (or several per "
                          f"worker joined by +, e.g. --emulate A10+T4,P100+T4).")
    if len(groups) != num_workers:
        raise ConfigError(
            f"--emulate names the devices of each worker, one comma-separated entry per worker: got {shown} "
            f"({len(groups)} entr{'ies' if len(groups) != 1 else 'y'}) for --workers {num_workers}. Give exactly "
            f"{num_workers}, e.g. --emulate {','.join(examples)}; several replicas per worker are "
            f"joined by +, e.g. A10+T4.")
    sizes = sorted({len(group) for group in groups})
    if len(sizes) > 1:
        raise ConfigError(
            f"--emulate gives the workers different numbers of replicas: {shown} has "
            f"{[len(group) for group in groups]} per worker. MultiWorkerMirroredStrategy needs the same number of "
            f"replicas on every worker; give each worker {sizes[-1]} (e.g. add a device to the others) or split a "
            f"worker's devices over more workers.")
    if sizes[-1] > MAX_EMULATED_REPLICAS_PER_WORKER:
        raise ConfigError(
            f"--emulate gives each worker {sizes[-1]} emulated replicas in {shown}; at most "
            f"{MAX_EMULATED_REPLICAS_PER_WORKER} per worker are supported (more stalled in testing: their emulated "
            f"waits block beside the CPU collectives). Use more --workers with fewer devices each.")
    for part in [part for group in groups for part in group]:
        get_device_spec(part)  # an UnknownEmulatedDeviceError for a name the catalog does not know
    return ["+".join(group) for group in groups]


def check_workers(num_workers) -> int:
    """``num_workers`` if it is an int in [1, MAX_WORKERS], else ConfigError."""
    return checked_int(num_workers, "--workers", 1, MAX_WORKERS, "processes on this machine")


def worker_gpus(gpus: Sequence, num_workers: int) -> list[list] | None:
    """Each worker's own GPUs (``gpus`` in CUDA's order, cut into ``num_workers`` equal runs; the last
    ``len(gpus) % num_workers`` are left unused), or None without GPUs.

    Raises:
        ConfigError: Fewer GPUs than workers.
    """
    if not gpus:
        return None
    if len(gpus) < num_workers:
        raise ConfigError(f"--workers {num_workers} needs a GPU per worker, and this machine shows {len(gpus)}: "
                          f"{[str(g) for g in gpus]}. Use --workers {len(gpus)} or fewer, or set "
                          f"CUDA_VISIBLE_DEVICES='' to run every worker on the CPU.")
    per = len(gpus) // num_workers
    return [list(gpus[i * per:(i + 1) * per]) for i in range(num_workers)]
