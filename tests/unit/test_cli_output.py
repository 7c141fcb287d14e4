"""The command line's own output is clean: TensorFlow's C++ start-up lines only with --verbose (a subprocess)."""

import os
import subprocess
import sys

NOISE = ("cuInit", "oneDNN", "absl::InitializeLog", "cpu_feature_guard", "Could not find cuda drivers")


def test_devices_prints_its_table_without_tensorflows_start_up_lines():
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}  # as a user's shell has it
    done = subprocess.run([sys.executable, "-m", "hetero_cs.cli", "devices"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "device" in done.stdout and "type" in done.stdout  # the table
    assert not [word for word in NOISE if word in done.stdout + done.stderr], done.stderr
