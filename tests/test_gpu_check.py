"""benchmarks/gpu_check.py's CPU version: the same code path as on a GPU, with MemTracker as the meter."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_the_smoke_check_holds_the_budget_and_predicts_the_peak(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["--smoke", "--steps", "2", "--out", str(tmp_path)]) == 0
    rows = {r["config"]: r for r in json.loads((tmp_path / "gpu_check.json").read_text())["rows"]}
    ours, none = rows["ours@50%"], rows["none"]
    assert ours["held"] and ours["allocated_peak_bytes"] <= ours["budget_bytes"]
    assert ours["allocated_peak_bytes"] == pytest.approx(ours["predicted_peak_bytes"], rel=0.05)
    assert none["allocated_peak_bytes"] > ours["allocated_peak_bytes"]
    assert "ours@50%" in capsys.readouterr().out
