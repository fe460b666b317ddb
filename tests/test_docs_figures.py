"""README's and docs' figures against what the examples printed (docs/figures.json), without re-running them.

``benchmarks/figures.py`` re-runs the examples and rewrites the recorded figures; this checks the
quoted sentences on every test run, so a figure that drifts fails here instead of in a user's hands.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the docs' figure tooling lives beside the scripts that record
from doc_figures import check_quotes, figures_key, load_figures, record_figures  # noqa: E402
FIGURES = ROOT / "docs" / "figures.json"


def test_readme_and_docs_quote_what_the_examples_printed():
    data = load_figures(FIGURES)
    assert len(data["quotes"]) >= 5 and {q["file"] for q in data["quotes"]} >= {"README.md"}
    assert check_quotes(ROOT, data) == []


def test_every_recorded_command_is_a_script_that_records_its_figures():
    for command in load_figures(FIGURES)["figures"]:
        script = ROOT / command.split()[0]
        assert script.exists(), command
        assert "record_figures" in script.read_text() and "--figures" in script.read_text(), command


def test_a_drifted_figure_a_changed_sentence_and_an_unknown_name_are_reported(tmp_path):
    (tmp_path / "README.md").write_text("takes a step from 340.17 MiB to\n210.08 MiB measured (38% saved)")
    data = {"figures": {"examples/train_gpt.py": {"values": {"before": 340.1663, "after": 207.0648, "saved": 39.13}}},
            "quotes": [{"file": "README.md", "command": "examples/train_gpt.py",
                        "text": "from {before} MiB to {after} MiB measured ({saved}% saved)"}]}
    problems = check_quotes(tmp_path, data)
    # 210.08 is 1.5% off 207.06 (beyond 0.5%); 38 is not 39.13 rounded.
    assert len(problems) == 2 and "after is 210.08" in problems[0] and "saved is 38" in problems[1]
    data["quotes"][0]["tolerance"] = {"after": 0.02, "saved": 0.05}
    assert check_quotes(tmp_path, data) == []
    data["quotes"][0]["text"] = "from {before} MiB down to {after} MiB"
    assert "not found" in check_quotes(tmp_path, data)[0]
    data["quotes"][0]["text"] = "from {before} MiB to {peak} MiB"
    assert "peak is not a figure" in check_quotes(tmp_path, data)[0]


def test_rounding_as_written_is_within_tolerance():
    # 66.96 GiB written as 67.0: within half a unit of the last digit written.
    from doc_figures import _within

    assert _within("67.0", 66.9618, 0.0) and not _within("67.1", 66.9618, 0.0)
    assert _within("2,588,712", 2588712, 0.0) and _within("15", 15.148, 0.0) and not _within("15.3", 15.148, 0.005)


def test_the_batch_size_example_records_what_it_prints(tmp_path):
    """The example's figures come from the run that prints them: the printed line and the JSON agree."""
    out = tmp_path / "figures.json"
    run = subprocess.run([sys.executable, "examples/batch_size.py", "--figures", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    values = load_figures(out)["figures"]["examples/batch_size.py"]["values"]
    line = run.stdout.strip().splitlines()[-1]
    assert (f"batch {values['batch_without']} without recomputation, {values['batch']} with it "
            f"({values['ratio']:.2f}x) at {values['overhead_pct']:.1f}% recompute FLOPs") in line
    assert f"measured peak {values['measured_mib']:.2f} MiB" in line


def test_recording_keeps_the_other_commands_and_the_quotes(tmp_path):
    path = tmp_path / "figures.json"
    path.write_text(json.dumps({"figures": {"a.py": {"values": {"x": 1}}}, "quotes": [{"file": "README.md"}]}))
    record_figures(path, figures_key("b.py", ["--batch", "4", "--figures", str(path)]), {"y": 2})
    data = load_figures(path)
    assert data["figures"] == {"a.py": {"values": {"x": 1}}, "b.py --batch 4": {"values": {"y": 2}}}
    assert data["quotes"] == [{"file": "README.md"}]


@pytest.mark.parametrize("command", ["examples/train_gpt.py", "examples/batch_size.py", "examples/plan_llama7b.py"])
def test_examples_answer_help_with_the_figures_flag(command):
    run = subprocess.run([sys.executable, command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--figures" in run.stdout
