"""What-if planning from catalog figures (pure), and `hetero-cs plan --devices` (in-process, no TensorFlow)."""

import json
import subprocess
import sys

import pytest

from hetero_cs import ConfigError, UnknownEmulatedDeviceError
from hetero_cs.devices.catalog import get_device_spec
from hetero_cs.devices.emulation import emulated_step_time_s
from hetero_cs.devices.what_if import DEFAULT_WORKLOAD, format_what_if, mix, what_if
from hetero_cs.devices.workload import Workload


def test_the_mix_adds_and_drops_cards():
    assert mix(["A10", "T4", "T4"], add=["V100"], drop=["t4"]) == ["A10", "T4", "V100"]
    with pytest.raises(ConfigError, match=r"--drop P100: no such card in the mix \['A10'\]"):
        mix(["A10"], drop=["P100"])
    with pytest.raises(ConfigError, match="empty"):
        mix(["A10"], drop=["A10"])


def test_a_what_if_plan_is_consistent_with_the_catalog_models():
    result = what_if(["A10", "T4", "P100"], 256)
    assert sum(result["per_replica_batch_sizes"]) == 256
    # Predicted from the catalog, not emulated (regression: the JSON said "emulated": true).
    assert result["predicted_from"] == "catalog" and "emulated" not in result
    assert result["compute_rates"] == ["tf32", "fp32", "fp32"] and result["peak_tflops"] == [62.5, 8.1, 9.3]
    assert all(m <= cap for m, cap in zip(result["micro_batch_sizes"], result["memory_caps"]))
    assert result["examples_per_s"] == pytest.approx(256 / result["predicted_step_s"])
    # The fastest card alone: the A10 (the highest peak of the three), on the whole batch in micro-batches.
    assert result["fastest_card"] == "A10"
    assert result["speedup_vs_fastest"] == pytest.approx(result["fastest_card_step_s"] / result["predicted_step_s"])
    assert 1.0 < result["speedup_vs_fastest"] and 1.0 < result["speedup_vs_even"]
    json.dumps(result)  # JSON-ready
    assert "PREDICTED" in format_what_if(result)


def test_a_card_that_only_slows_the_step_is_left_out():
    # One example of this workload takes a CPU far longer than the whole batch on an A10: the CPU sits idle.
    heavy = Workload(flops_per_example=5e10, parameter_bytes=4_000_000)
    result = what_if(["A10", "CPU"], 16, heavy)
    assert result["idle"] == [1] and result["per_replica_batch_sizes"] == [16, 0]
    assert result["speedup_vs_fastest"] == pytest.approx(1.0)
    single = emulated_step_time_s(get_device_spec("A10"), 16, heavy)
    assert result["predicted_step_s"] == pytest.approx(single)


def test_a_batch_larger_than_the_cards_hold_is_micro_batched_and_so_is_the_even_split_it_is_compared_with():
    result = what_if(["T4", "T4"], 1024)
    assert result["sub_steps"] >= 1024 // sum(result["memory_caps"])
    # Two alike cards: the even split, micro-batched as the memory needs, is as fast as the plan.
    assert result["speedup_vs_even"] == pytest.approx(1.0, abs=0.02)
    # A card that holds no example: no even split to compare with.
    small = what_if(["A10", "T4@1MB"], 64)
    assert small["idle"] == [1] and small["speedup_vs_even"] is None
    assert "n/a (a card holds no example)" in format_what_if(small)


def test_bad_input_is_a_clear_error():
    with pytest.raises(UnknownEmulatedDeviceError):
        what_if(["A10", "GTX9000"], 64)
    with pytest.raises(ConfigError, match="global_batch_size must be an integer >= 1"):
        what_if(["A10"], 0)


def test_the_command_line_answers_without_a_profile(capsys):
    from hetero_cs.cli import main

    assert main(["plan", "--devices", "A10,T4,P100", "--drop", "P100", "--global-batch-size", "256", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["devices"] == ["A10", "T4"]
    assert {"speedup_vs_even", "speedup_vs_fastest", "per_replica_batch_sizes"} <= set(result)
    assert result == what_if(["A10", "T4"], 256, DEFAULT_WORKLOAD)
    assert main(["plan", "--devices", "A10,T4", "--global-batch-size", "64"]) == 0
    assert "What-if plan" in capsys.readouterr().out
    assert main(["plan", "--devices", "A10"]) == 2
    assert "needs --global-batch-size" in capsys.readouterr().err
    assert main(["plan", "--global-batch-size", "8"]) == 2
    assert "exactly one of --profile FILE" in capsys.readouterr().err


def test_tf32_off_predicts_float32_at_the_fp32_rate_of_the_cards_with_tf32(capsys):
    from hetero_cs.cli import main

    assert main(["plan", "--devices", "A10,T4", "--global-batch-size", "256", "--tf32", "off", "--json"]) == 0
    off = json.loads(capsys.readouterr().out)
    on = what_if(["A10", "T4"], 256)
    assert off["compute_rates"] == ["fp32", "fp32"] and on["compute_rates"] == ["tf32", "fp32"]
    # The A10 at its fp32 rate gets a smaller share of the batch than at its TF32 rate; the T4 has no TF32.
    assert off["per_replica_batch_sizes"][0] < on["per_replica_batch_sizes"][0]
    assert off["speedup_vs_fastest"] > on["speedup_vs_fastest"]
    assert main(["plan", "--profile", "p.json", "--tf32", "off"]) == 2
    assert "--tf32" in capsys.readouterr().err


def test_the_what_if_needs_no_tensorflow():
    code = ("import contextlib, io, sys\nfrom hetero_cs.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    main(['plan', '--devices', 'A10,T4', '--global-batch-size', '64', '--json'])\n"
            "print('tensorflow' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", (done.stdout, done.stderr)


def test_the_sub_steps_times_add_up_to_the_predicted_step():
    result = what_if(["A10@1GB", "T4", "P100"], 256)  # the A10's memory binds: micro-batches, overlapped
    assert result["sub_steps"] == len(result["sub_step_batch_sizes"]) == len(result["sub_step_busy_s"]) >= 2
    # Each card runs its micro-batches back to back within a call; a call lasts its slowest card's sum.
    assert result["overlapped"] and sum(result["call_sub_steps"]) == result["sub_steps"]
    step, start = 0.0, 0
    for n in result["call_sub_steps"]:
        rows = result["sub_step_busy_s"][start:start + n]
        step += max(sum(row[i] for row in rows) for i in range(3))
        start += n
    assert step == pytest.approx(result["predicted_step_s"])
    # A one-card batch larger than its memory runs as sub-steps with a barrier each: a sub-step lasts its slowest card.
    alone = what_if(["A10@1GB"], 256)
    assert not alone["overlapped"] and alone["call_sub_steps"] is None
    assert sum(max(row) for row in alone["sub_step_busy_s"]) == pytest.approx(alone["predicted_step_s"])
    assert [sum(cut[i] for cut in result["sub_step_batch_sizes"]) for i in range(3)] == \
        result["per_replica_batch_sizes"]
    assert result["predicted_busy_s"] == pytest.approx([sum(row[i] for row in result["sub_step_busy_s"])
                                                        for i in range(3)])


def test_plot_draws_the_plan_into_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from hetero_cs.cli import main

    path = tmp_path / "plan.png"
    assert main(["plan", "--devices", "A10,T4,P100,CPU", "--global-batch-size", "256", "--plot", str(path)]) == 0
    assert f"plot: {path}" in capsys.readouterr().out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert [p.name for p in tmp_path.iterdir()] == ["plan.png"]  # written atomically: no temporary left
    (tmp_path / "folder.png").mkdir()
    assert main(["plan", "--devices", "A10", "--global-batch-size", "8", "--plot", str(tmp_path / "folder.png")]) == 2
    assert "is a folder" in capsys.readouterr().err
    many = tmp_path / "many.png"  # thousands of sub-steps are drawn in groups, at once
    assert main(["plan", "--devices", "A10,T4", "--global-batch-size", "1000000", "--plot", str(many)]) == 0
    assert many.stat().st_size > 10_000


@pytest.mark.parametrize("argv,match", [
    (["--devices", "A10", "--global-batch-size", "8", "--plot", "plan.svg"], "name ending in .png"),
    (["--devices", "A10", "--global-batch-size", "8", "--plot", "no/such/folder/plan.png"], "does not exist"),
    (["--profile", "p.json", "--plot", "plan.png"], "--plot go with --devices"),
    (["--devices", "A10", "--global-batch-size", "8", "--multiple-of", "8"], "go with --profile"),
])
def test_plot_bad_arguments_are_clear_errors_before_any_work(argv, match, capsys, tmp_path, monkeypatch):
    from hetero_cs.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["plan", *argv]) == 2
    assert match in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch, tmp_path):
    from hetero_cs.devices.what_if_plot import check_plot_path

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match="pip install matplotlib"):
        check_plot_path(tmp_path / "plan.png")
