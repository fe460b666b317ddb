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
    assert gpu_check.main(["--smoke", "--models", "mlp", "llama", "--steps", "1", "--out", str(tmp_path)]) == 0
    found = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    rows = {r["config"]: r for r in found if r["model"] == "mlp"}
    ours, none = rows["ours@50%"], rows["none"]
    assert ours["held"] and ours["allocated_peak_bytes"] <= ours["budget_bytes"]
    assert ours["allocated_peak_bytes"] == pytest.approx(ours["predicted_peak_bytes"], rel=0.05)
    assert none["allocated_peak_bytes"] > ours["allocated_peak_bytes"]
    assert "ours@50%" in capsys.readouterr().out
    # The features' rows (the first run of each on a GPU will be this code): every plan that exists held its budget
    # and was predicted to the byte on the CPU; both shapes of the shape plans were planned.
    llama = {r["config"]: r for r in found if r["model"] == "llama"}
    assert {"sac@50%", "chunk@min", "fake@50%", "shapes@50%:32", "shapes@50%:64"} <= set(llama)
    measured = [r for r in llama.values() if r["predicted_peak_bytes"]]
    assert measured and all(r["held"] for r in measured)
    assert all(r["allocated_peak_bytes"] == pytest.approx(r["predicted_peak_bytes"], rel=0.01) for r in measured)
