"""`hetero-cs launch` on a machine with GPUs: each worker its own card by UUID, and a relaunch without a failed one.

NVML and the CUDA driver are faked from a real H200's records (tests/unit/fake_gpus.py); the workers are small
scripts that print what they were given and fail the way the test needs.
"""

import io
import sys
import textwrap

import pytest

from fake_gpus import A10, H200, install
from hetero_cs import ConfigError
from hetero_cs.launch import Launch


def worker(tmp_path, body, state):
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(f"""
        import json, os, sys
        task = json.loads(os.environ['TF_CONFIG'])['task']['index']
        restart = int(os.environ['HETERO_CS_RESTART'])
        print('gpus', restart, task, os.environ['CUDA_VISIBLE_DEVICES'], flush=True)

        def fault(uuid, **change):  # what the driver shows after the card failed
            state = json.load(open({str(state)!r}))
            state.setdefault(uuid, {{}}).update(change)
            open({str(state)!r} + '.tmp', 'w').write(json.dumps(state))
            os.replace({str(state)!r} + '.tmp', {str(state)!r})
    """) + textwrap.dedent(body))
    return [sys.executable, str(path)]


def seen(output):
    return sorted(line.split("gpus ", 1)[1] for line in output.getvalue().splitlines() if "] gpus " in line)


def test_regression_each_worker_gets_its_own_gpu_by_uuid(monkeypatch, tmp_path):
    # Every worker was given every GPU, so "relaunch without worker i" did not remove its card.
    install(monkeypatch, [H200, A10], tmp_path / "state.json")
    output = io.StringIO()
    assert Launch(worker(tmp_path, "", tmp_path / "state.json"), num_workers=2, output=output).run() == 0
    assert seen(output) == [f"0 0 {H200.uuid}", f"0 1 {A10.uuid}"]


def test_a_worker_whose_card_nvml_shows_failed_is_relaunched_without_it(monkeypatch, tmp_path):
    state = tmp_path / "state.json"
    install(monkeypatch, [H200, A10], state)
    output = io.StringIO()
    body = f"""
        if restart == 0 and task == 1:
            fault({A10.uuid!r}, ecc=3)
            sys.stderr.write('CUDA_ERROR_ECC_UNCORRECTABLE on /device:GPU:0\\n'); sys.stderr.flush(); os.abort()
    """
    assert Launch(worker(tmp_path, body, state), num_workers=2, output=output, max_restarts=1).run() == 0
    assert seen(output) == [f"0 0 {H200.uuid}", f"0 1 {A10.uuid}", f"1 0 {H200.uuid}"]
    assert (f"relaunching 1 worker(s) without worker 1 (its GPU NVIDIA A10 {A10.uuid} (PCI 00000000:00:05.0): its "
            f"uncorrected ECC error count grew from 0 to 3)") in output.getvalue()


def test_a_program_error_on_a_healthy_card_is_not_a_lost_card(monkeypatch, tmp_path):
    install(monkeypatch, [H200, A10], tmp_path / "state.json")
    output = io.StringIO()
    body = """
        if task == 1:
            sys.stderr.write('CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access on /device:GPU:0\\n')
            sys.exit(1)
    """
    assert Launch(worker(tmp_path, body, tmp_path / "state.json"), num_workers=2, output=output,
                  max_restarts=1).run() == 1
    assert "worker 1 failed with status 1 and no card of it failed: not relaunching" in output.getvalue()


def test_fewer_gpus_than_workers_is_refused_with_the_fix(monkeypatch, tmp_path):
    install(monkeypatch, [H200], tmp_path / "state.json")
    with pytest.raises(ConfigError, match=r"--workers 2 needs a GPU per worker, and this machine shows 1.*"
                                          r"--workers 1 or fewer, or set CUDA_VISIBLE_DEVICES=''"):
        Launch([sys.executable, "-c", "pass"], num_workers=2)
