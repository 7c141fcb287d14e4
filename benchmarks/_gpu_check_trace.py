"""TensorFlow profiler traces for ``benchmarks/gpu_check.py``: capture a few steps, read the XSpace back.

``profile_steps`` runs steps under ``tf.profiler.experimental`` with one ``Trace("gpu_check_step", step_num=k)``
marker per step and returns the parsed trace: for each marked step, its window on the profiler clock, the bytes of
the ``MemcpyH2D`` / ``MemcpyD2H`` events inside it (GPU planes only; CUPTI reports them) and, per replica, the
latest end of its device kernels (GPU) or of its backward-pass ops on the host plane (CPU-only machines), and the
start of its ``end_replica_step_<i>`` op (where the monitor reads the clock at the replica's end), measured from the
step's ``wall_clock_stamp`` op (the clock start the monitor uses) when the trace shows it, else from the marker's
start.

A kernel or op belongs to replica ``i`` when its TensorFlow op name has a ``replica_<i>/`` part, to replica 0 when
it has no such prefix (tf.distribute names replica 0's ops without one; the library blames an out-of-memory error the
same way). Kernels without an op name are given to the replica of their GPU plane. The XSpace proto ships with
TensorFlow (``tensorflow.tsl.profiler.protobuf.xplane_pb2``); nothing else is needed to read it.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import statistics
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

STEP_MARKER = "gpu_check_step"
_REPLICA = re.compile(r"(?:^|[/:])replica_(\d+)/")  # "replica_1/..." and "gradient_tape/replica_1/..."
_END_STAMP = re.compile(r"end_replica_step_(\d+)")
_SIZE = re.compile(r"(?:^|\s)(?:size|num_bytes):(\d+)")


@dataclasses.dataclass
class StepTrace:
    """One marked step as the profiler saw it (times in seconds from the step's reference point)."""

    step_num: int
    window_s: float  # the marker's duration: the step's wall time under the profiler
    reference: str  # "wall_clock_stamp" or "marker start"
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_copies: int = 0
    d2h_copies: int = 0
    replica_end_s: dict[int, float] = dataclasses.field(default_factory=dict)
    end_stamp_s: dict[int, float] = dataclasses.field(default_factory=dict)  # the monitor's own end op (host)


@dataclasses.dataclass
class TraceSummary:
    """What the parsed profile holds: planes, kinds of events, and the marked steps."""

    logdir: str
    planes: list[str]
    device_planes: list[str]
    kernel_events: int
    memcpy_events: int
    steps: list[StepTrace]
    source: str  # "GPU kernels" or "host ops (CPU)"

    def median_replica_end_s(self, replica_id: int, *, stamp: bool = False) -> float | None:
        """Median over steps of replica ``replica_id``'s last kernel/op end (``stamp``: its end_replica_step op's
        start, where the monitor reads the clock)."""
        ends = [(s.end_stamp_s if stamp else s.replica_end_s).get(replica_id) for s in self.steps]
        ends = [e for e in ends if e is not None]
        return statistics.median(ends) if ends else None

    def median_bytes(self) -> dict[str, float]:
        if not self.steps:
            return {}
        return {"h2d_bytes": statistics.median(s.h2d_bytes for s in self.steps),
                "d2h_bytes": statistics.median(s.d2h_bytes for s in self.steps),
                "h2d_copies": statistics.median(s.h2d_copies for s in self.steps),
                "d2h_copies": statistics.median(s.d2h_copies for s in self.steps)}


def profile_steps(run_step: Callable[[], Any], steps: int, *, on_step: Callable[[int], None] | None = None,
                  logdir: str | None = None) -> tuple[str, list[int]]:
    """Runs ``steps`` calls of ``run_step`` under the profiler, each inside a step marker; returns the logdir and the
    marker numbers. ``on_step(k)`` runs after step k (outside the marker), e.g. to read the monitor."""
    import tensorflow as tf

    logdir = logdir or tempfile.mkdtemp(prefix="gpu_check_trace_")
    tf.profiler.experimental.start(logdir)
    numbers = []
    try:
        for k in range(steps):
            with tf.profiler.experimental.Trace(STEP_MARKER, step_num=k, _r=1):
                run_step()
            numbers.append(k)
            if on_step is not None:
                on_step(k)
    finally:
        tf.profiler.experimental.stop()
    return logdir, numbers


def _xspace(logdir: str) -> Any:
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {logdir}: the profiler wrote no trace")
    space = xplane_pb2.XSpace()
    with open(files[-1], "rb") as handle:
        space.ParseFromString(handle.read())
    return space


def _stat(plane: Any, event: Any, wanted: str) -> str | int | None:
    """An event's stat named ``wanted`` (string, a reference to a name, or an integer), or None."""
    for stat in event.stats:
        if plane.stat_metadata[stat.metadata_id].name != wanted:
            continue
        kind = stat.WhichOneof("value")
        if kind == "ref_value":
            return plane.stat_metadata[stat.ref_value].name
        return getattr(stat, kind) if kind else None
    return None


def replica_of(op_name: str) -> int:
    match = _REPLICA.search(op_name or "")
    return int(match.group(1)) if match else 0


def _events(plane: Any, lines: Sequence[Any] | None = None):
    """(name, start_ps, end_ps, event) over a plane's lines, on the profiler clock (picoseconds)."""
    for line in (plane.lines if lines is None else lines):
        base_ps = line.timestamp_ns * 1000
        for event in line.events:
            start = base_ps + event.offset_ps
            yield plane.event_metadata[event.metadata_id].name, start, start + event.duration_ps, event


def _gpu_plane_index(name: str) -> int | None:
    match = re.match(r"^/device:GPU:(\d+)", name)
    return int(match.group(1)) if match else None


def read_trace(logdir: str, num_replicas: int) -> TraceSummary:
    """Parses the newest XSpace under ``logdir`` into per-step copies and per-replica end times."""
    space = _xspace(logdir)
    host = next((p for p in space.planes if p.name == "/host:CPU"), None)
    gpu_planes = [p for p in space.planes if _gpu_plane_index(p.name) is not None]
    markers, stamps, host_ops, end_stamps = [], [], [], []
    if host is not None:
        for name, start, end, event in _events(host):
            if name == STEP_MARKER:
                step_num = _stat(host, event, "step_num")
                markers.append((int(step_num) if step_num is not None else len(markers), start, end))
            elif name.startswith("wall_clock_stamp"):
                stamps.append(start)
            elif ":" in name and not gpu_planes:  # TF op events "<op name>:<op type>" (CPU-only)
                op = name.split(":", 1)[0]
                if op.startswith("gradient_tape/"):
                    host_ops.append((replica_of(op), end))
            stamp = _END_STAMP.search(name)
            if stamp:
                end_stamps.append((int(stamp.group(1)), start))
    kernels, copies = [], []  # (replica, end_ps) and (direction, bytes, start_ps)
    for plane in gpu_planes:
        stream_lines = [line for line in plane.lines if line.name.startswith("Stream")] or list(plane.lines)
        for name, start, end, event in _events(plane, stream_lines):
            if name.startswith("Memcpy"):
                details = str(_stat(plane, event, "memcpy_details") or "")
                size = _SIZE.search(details)
                direction = "h2d" if "H2D" in name or "HtoD" in name else "d2h" if "D2H" in name or "DtoH" in name \
                    else "other"
                copies.append((direction, int(size.group(1)) if size else 0, start))
            elif not name.startswith("Memset"):
                op = _stat(plane, event, "tf_op") or _stat(plane, event, "annotation")  # a raw trace: the latter
                replica = replica_of(str(op)) if op else min(_gpu_plane_index(plane.name), num_replicas - 1)
                kernels.append((replica, end))
    ends = kernels if gpu_planes else host_ops
    steps = []
    for step_num, start, end in sorted(markers, key=lambda m: m[1]):
        inside = [s for s in stamps if start <= s <= end]
        reference, ref_ps = ("wall_clock_stamp", min(inside)) if inside else ("marker start", start)
        step = StepTrace(step_num, (end - start) / 1e12, reference)
        for direction, size, at in copies:
            if start <= at <= end and direction in ("h2d", "d2h"):
                setattr(step, f"{direction}_bytes", getattr(step, f"{direction}_bytes") + size)
                setattr(step, f"{direction}_copies", getattr(step, f"{direction}_copies") + 1)
        for replica, at in ends:
            if start <= at <= end and replica < num_replicas:
                step.replica_end_s[replica] = max(step.replica_end_s.get(replica, 0.0), (at - ref_ps) / 1e12)
        for replica, at in end_stamps:
            if start <= at <= end and replica < num_replicas:
                step.end_stamp_s[replica] = (at - ref_ps) / 1e12
        steps.append(step)
    return TraceSummary(logdir=logdir, planes=[p.name for p in space.planes],
                        device_planes=[p.name for p in gpu_planes], kernel_events=len(kernels),
                        memcpy_events=len(copies), steps=steps,
                        source="GPU kernels" if gpu_planes else "host ops (CPU)")
