"""benchmarks/_gpu_check_trace.py reads a GPU trace right: a hand-built XSpace with what CUPTI writes.

No machine here has a GPU, so the GPU branch of the parser (memcpy sizes, kernels per replica) is checked on a
synthetic profile in TensorFlow's own XSpace proto; the CPU branch runs for real in ``benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("tensorflow.tsl.profiler.protobuf.xplane_pb2")

from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: E402

from benchmarks import _gpu_check_trace as trace  # noqa: E402

NS = 1000  # picoseconds per nanosecond


class _Plane:
    def __init__(self, space, name):
        self.plane = space.planes.add(name=name)
        self.names: dict[str, int] = {}
        self.stats: dict[str, int] = {}

    def _meta(self, name):
        if name not in self.names:
            self.names[name] = len(self.names) + 1
            self.plane.event_metadata[self.names[name]].name = name
        return self.names[name]

    def _stat_id(self, name):
        if name not in self.stats:
            self.stats[name] = len(self.stats) + 1
            self.plane.stat_metadata[self.stats[name]].name = name
        return self.stats[name]

    def line(self, name, timestamp_ns=0):
        return self.plane.lines.add(name=name, timestamp_ns=timestamp_ns)

    def event(self, line, name, start_ns, duration_ns, **stats):
        event = line.events.add(metadata_id=self._meta(name), offset_ps=start_ns * NS, duration_ps=duration_ns * NS)
        for key, value in stats.items():
            stat = event.stats.add(metadata_id=self._stat_id(key))
            if isinstance(value, int):
                stat.int64_value = value
            else:  # strings as references to a stat metadata name, as TensorFlow writes them
                stat.ref_value = self._stat_id(value)
        return event


def _space(tmp_path):
    space = xplane_pb2.XSpace()
    host = _Plane(space, "/host:CPU")
    python = host.line("python", timestamp_ns=1_000_000)
    ops = host.line("tf_Compute", timestamp_ns=1_000_000)
    gpu = _Plane(space, "/device:GPU:0")
    stream = gpu.line("Stream #7(Compute)", timestamp_ns=1_000_000)
    for k in range(2):
        t0 = k * 100_000  # each step 100 us apart, 50 us long
        host.event(python, trace.STEP_MARKER, t0, 50_000, step_num=k)
        host.event(ops, "wall_clock_stamp:PyFuncStateless", t0 + 1_000, 100)
        host.event(ops, "adam/end_replica_step_0:PyFuncStateless", t0 + 31_000, 100)
        host.event(ops, "replica_1/adam/end_replica_step_1:PyFuncStateless", t0 + 21_000, 100)
        gpu.event(stream, "MemcpyH2D", t0 + 2_000, 500, memcpy_details="kind_src:pageable kind_dst:device size:4096 "
                                                                         "dest:0 async:1")
        gpu.event(stream, "MemcpyH2D", t0 + 2_600, 500, memcpy_details="size:1024 dest:1 async:1")
        gpu.event(stream, "MemcpyD2H", t0 + 40_000, 500, memcpy_details="kind_src:device size:2048 dest:0 async:1")
        gpu.event(stream, "volta_sgemm_128x64_nn", t0 + 5_000, 25_000,
                  tf_op="gradient_tape/gpu_check_mlp/dense/MatMul:MatMul")
        gpu.event(stream, "volta_sgemm_64x64_nn", t0 + 5_000, 15_000,
                  annotation="__inference_train_step_9::gradient_tape/replica_1/gpu_check_mlp/dense/MatMul:MatMul")
    gpu.event(stream, "volta_sgemm_late", 60_000, 1_000, tf_op="replica_1/x:MatMul")  # between the two markers
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    (folder / "host.xplane.pb").write_bytes(space.SerializeToString())
    return tmp_path


def test_memcpy_bytes_and_kernel_ends_per_replica_from_a_gpu_trace(tmp_path):
    summary = trace.read_trace(str(_space(tmp_path)), num_replicas=2)
    assert summary.device_planes == ["/device:GPU:0"] and summary.source == "GPU kernels"
    assert [s.step_num for s in summary.steps] == [0, 1]
    assert summary.memcpy_events == 6 and summary.kernel_events == 5
    assert summary.median_bytes() == {"h2d_bytes": 5120, "d2h_bytes": 2048, "h2d_copies": 2, "d2h_copies": 1}
    step = summary.steps[0]
    assert step.reference == "wall_clock_stamp" and step.window_s == pytest.approx(50e-6)
    # Replica 0's kernel (no replica prefix) ends at 30 us, replica 1's at 20 us: 29 and 19 us after the stamp.
    assert summary.median_replica_end_s(0) == pytest.approx(29e-6)
    assert summary.median_replica_end_s(1) == pytest.approx(19e-6)
    assert summary.median_replica_end_s(1, stamp=True) == pytest.approx(20e-6)
    assert summary.median_replica_end_s(0, stamp=True) == pytest.approx(30e-6)


def test_replica_of_reads_the_prefixes_tf_distribute_writes():
    assert trace.replica_of("gradient_tape/replica_2/dense/MatMul") == 2
    assert trace.replica_of("replica_1/dense/MatMul") == 1
    assert trace.replica_of("fn::replica_3/dense/MatMul") == 3
    assert trace.replica_of("gradient_tape/dense/MatMul") == 0
    assert trace.replica_of("my_replica_1/x") == 0
