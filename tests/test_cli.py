"""The lightning-remat command line: clear errors, and a real run in-process and as the installed script."""

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from lightning_remat.integrations.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "factories.py"

FACTORIES = '''
import torch
from torch import nn

def tiny():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)])
    x = torch.randn(128, 32)
    return model, (lambda m: m(x).square().mean()), torch.optim.Adam(model.parameters())

def broken():
    raise RuntimeError("the dataset is not there")

def wrong():
    return 42

NOT_A_FUNCTION = 3
'''


@pytest.fixture()
def factories(tmp_path):
    path = tmp_path / "factories.py"
    path.write_text(FACTORIES)
    return path


def _error(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return code, captured.err


def test_missing_file(capsys, tmp_path):
    code, err = _error(capsys, ["plan", str(tmp_path / "nope.py") + ":make"])
    assert code == 2 and "file not found" in err and "nope.py" in err


def test_target_without_factory_name(capsys, factories):
    code, err = _error(capsys, ["plan", str(factories)])
    assert code == 2 and "FILE.py:FACTORY" in err


def test_missing_factory_lists_the_functions(capsys, factories):
    code, err = _error(capsys, ["plan", f"{factories}:gpt3"])
    assert code == 2 and "'gpt3'" in err and "tiny" in err and "broken" in err


def test_factory_that_raises(capsys, factories):
    code, err = _error(capsys, ["plan", f"{factories}:broken", "--json"])
    assert code == 2 and "broken() raised RuntimeError: the dataset is not there" in err


def test_factory_returning_something_else(capsys, factories):
    code, err = _error(capsys, ["plan", f"{factories}:wrong"])
    assert code == 2 and "returned a int" in err and "(model, step)" in err


@pytest.mark.parametrize("budget", ["ten gigs", "-5GB", "0", "150%", "12XB"])
def test_bad_budget(capsys, factories, budget):
    code, err = _error(capsys, ["plan", f"{factories}:tiny", f"--budget={budget}"])
    assert code == 2 and "Invalid memory budget" in err and "Accepted" in err


def test_json_run_in_process(capsys, factories, tmp_path):
    out = tmp_path / "report"
    code = main(["plan", f"{factories}:tiny", "--budget", "min", "--cost", "flops", "--json", "--out", str(out),
                 "--points", "5"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(captured.out)  # JSON only on stdout
    plan, breakdown = result["plan"], result["breakdown"]
    assert plan["checkpointed"] and plan["predicted_peak_bytes"] < plan["baseline_peak_bytes"]
    assert breakdown["optimizer_state_counted_ahead"] and breakdown["optimizer_state_bytes"] >= 2 * breakdown["parameter_bytes"]
    assert breakdown["peak_bytes"] == plan["baseline_peak_bytes"]
    assert [m["name"] for m in breakdown["top_modules"]] == ["0", "1", "2", "3"]
    # The split at the forward/backward peak: its parts, which add up to the figure named for it.
    assert "Total" not in breakdown["at_peak"]
    assert sum(breakdown["at_peak"].values()) == breakdown["forward_backward_peak_bytes"] <= breakdown["peak_bytes"]
    pareto = result["pareto"]
    assert len(pareto) == 5 and pareto[0]["predicted_peak_bytes"] == plan["predicted_peak_bytes"]
    assert pareto[-1]["predicted_overhead"] == 0.0
    for name in ("memory_timeline", "pareto"):
        height, width, _ = matplotlib.image.imread(result["files"][name]).shape
        assert width >= 500 and height >= 300
    assert json.loads((out / "plan.json").read_text())["checkpointed"] == plan["checkpointed"]


def test_budget_too_small_is_exit_1_with_the_smallest_peak(capsys, factories):
    code = main(["plan", f"{factories}:tiny", "--budget", "100kB", "--json", "--no-plots", "--cost", "flops"])
    result = json.loads(capsys.readouterr().out)
    assert code == 1 and result["plan"] is None
    assert result["smallest_peak_bytes"] > 100_000 and "smallest reachable peak" in result["error"]


def test_lightning_module_factory_and_a_percentage_budget(capsys):
    # A percentage is of the device's total memory (the host's RAM here): far above this tiny step.
    code = main(["plan", f"{EXAMPLES}:lightning_mlp", "--budget", "50%", "--json", "--no-plots", "--cost", "flops"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(captured.out)
    assert result["plan"]["checkpointed"] == []
    # configure_optimizers() gave AdamW, whose state counts.
    assert result["breakdown"]["optimizer_state_bytes"] >= 2 * result["breakdown"]["parameter_bytes"] > 0


def test_installed_script_prints_tables(factories, tmp_path):
    script = Path(sys.executable).with_name("lightning-remat")
    assert script.exists(), script
    run = subprocess.run([str(script), "plan", f"{factories}:tiny", "--budget", "min", "--cost", "flops",
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                         env={"COLUMNS": "120", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr
    assert "Recompute plan:" in run.stdout and "optimizer state" in run.stdout and "predicted peak" in run.stdout
    assert (tmp_path / "out" / "memory_timeline.png").stat().st_size > 10_000
    bad = subprocess.run([str(script), "plan", str(tmp_path / "missing.py") + ":f"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "file not found" in bad.stderr and "Traceback" not in bad.stderr


def test_help_is_whole_with_examples_factory_forms_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert "lightning-remat plan examples/factories.py:gpt2 --budget 200MB" in out  # the examples
    assert "(model, step, optimizer)" in out and "(lightning_module, batch)" in out  # the factory forms
    assert "Exit codes: 0 success; 1 the budget cannot be met" in out and "2 bad input" in out


PROFILING_FAILS = '''
import torch
from torch import nn

def failing():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    def step(m):
        raise RuntimeError("the step broke\\n  on its second line")
    return model, step
'''


@pytest.mark.parametrize("argv", [["--device", "banana"], ["--fake", "--gpu", "banana"], ["--points", "0"],
                                  ["--budget", "ten gigs"], ["--world-size", "2"], ["--candidates", "NoSuchBlock"],
                                  ["--device-memory", "lots"]])
def test_bad_input_is_exit_2_in_one_line(capsys, factories, argv):
    code, err = _error(capsys, ["plan", f"{factories}:tiny", "--no-plots", *argv])
    assert code == 2, err
    assert err.startswith("lightning-remat: error: ") and err.count("\n") == 1, repr(err)


def test_a_step_that_fails_while_profiling_is_exit_1_in_one_line(capsys, tmp_path):
    path = tmp_path / "failing.py"
    path.write_text(PROFILING_FAILS)
    code, err = _error(capsys, ["plan", f"{path}:failing", "--no-plots"])
    assert code == 1
    assert err == (f"lightning-remat: error: profiling {path}:failing failed: RuntimeError: the step broke on its "
                   f"second line (at {path}:8 in step)\n")  # the line of the user's step that raised


def test_tables_show_a_decimal_budget_in_decimal_next_to_its_bytes(capsys, factories):
    code = main(["plan", f"{factories}:tiny", "--budget", "5MB", "--no-plots", "--cost", "flops", "--points", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "(budget 5.00 MB = 5000000 bytes, baseline" in " ".join(captured.out.split())  # was 4.77 MiB


def test_budget_too_small_in_tables_is_one_error_line_on_stderr(capsys, factories):
    code = main(["plan", f"{factories}:tiny", "--budget", "100kB", "--no-plots", "--cost", "flops"])
    captured = capsys.readouterr()
    assert code == 1 and "Budgets from the least reachable peak" in captured.out
    assert captured.err.startswith("lightning-remat: error: No recompute plan fits a budget of 97.66 KiB")
    assert captured.err.count("\n") == 1 and "smallest reachable peak" in captured.err
