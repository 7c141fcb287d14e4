"""Resume is exact at any crash point: a supervised script killed (SIGKILL) at 20+ random points ends as if never.

Each run of crash_point_script.py dies where the draw says: a step applied before its backup, a backup's file half
written, a batch being skipped after a restart, or the restart reading its backup; the next run resumes from the
backups, until one run finishes. The final weights and optimizer iterations must equal an uninterrupted run's (no
batch applied twice or lost: 0 replays), and each death must cost at most the backup interval in steps.
"""

import json
import os
import pathlib
import random
import subprocess
import sys

import numpy as np
import pytest

from test_supervised_restart import EPOCHS, NUM_BATCHES, reference

SCRIPT = pathlib.Path(__file__).with_name("crash_point_script.py")
KINDS = ("step", "write", "skip", "restart")


def run(tmp_path, restart, kind, count, interval):
    env = dict(os.environ, HETERO_CS_BACKUP_DIR=str(tmp_path / "backups"), HETERO_CS_RESTART=str(restart),
               HETERO_CS_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), kind, str(count), str(interval)], env=env,
                          capture_output=True, text=True, timeout=300)


def resumed_step(tmp_path):
    record = tmp_path / "backups" / "fit_0.json"
    return json.loads(record.read_text())["step"] if record.exists() else 0


def assert_uninterrupted(tmp_path):
    ref, _ = reference()
    with np.load(tmp_path / "weights.npz") as got:
        assert int(got["iterations"]) == int(ref.optimizer.iterations) == EPOCHS * NUM_BATCHES  # 0 replays
        for i, want in enumerate(ref.get_weights()):
            np.testing.assert_allclose(got[f"arr_{i}"], want, atol=1e-5)


def applied_steps(tmp_path):
    path = tmp_path / "steps"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


@pytest.mark.slow  # about 30 TensorFlow processes, 2-3 minutes
@pytest.mark.parametrize("interval", [1, 3])
def test_a_script_killed_at_random_points_ends_as_an_uninterrupted_run(tmp_path, interval):
    draw = random.Random(43 + interval)
    kills, kinds, restart, finished = 0, set(), 0, 0
    while kills < 12:
        kind = KINDS[kills % len(KINDS)] if kills < len(KINDS) else draw.choice(KINDS)
        count = draw.randint(1, {"step": 8, "write": 8, "skip": 3, "restart": 1}[kind])
        before = len(applied_steps(tmp_path))
        done = run(tmp_path, restart, kind, count, interval)
        if done.returncode == 0:  # that point was not reached: the run finished; start again from nothing
            assert_uninterrupted(tmp_path)
            finished += 1
            for path in [*(tmp_path / "backups").iterdir(), tmp_path / "weights.npz", tmp_path / "steps"]:
                path.unlink(missing_ok=True)
            restart = 0
            continue
        assert done.returncode == -9 and f"crash point: {kind} {count}" in done.stderr, done.stderr[-3000:]
        applied = applied_steps(tmp_path)[before:]
        redone = max(applied) - resumed_step(tmp_path) if applied else 0
        assert 0 <= redone <= interval, (kind, count, resumed_step(tmp_path), applied)  # the redo bound
        kills, restart = kills + 1, restart + 1
        kinds.add(kind)
    done = run(tmp_path, restart, "none", 0, interval)
    assert done.returncode == 0, done.stderr[-3000:]
    assert kinds == set(KINDS)
    assert_uninterrupted(tmp_path)
