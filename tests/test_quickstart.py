"""The quickstart, end to end with tiny budgets: every part runs, both plots and the summary are written."""
import os

import pytest

from examples.recipes.commands import python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_the_quickstart_prints_capacity_cost_and_the_pipeline_table(tmp_path):
    out = tmp_path / "quickstart"
    run = python(os.path.join(ROOT, "examples", "quickstart", "quickstart.py"), "--out", out, "--mt-updates", 10,
                 "--lm-updates", 10, "--capacity-steps", 100, "--cost-length", 48)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for plot in ("capacity.png", "cost.png"):
        with open(out / plot, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    summary = (out / "summary.md").read_text()
    assert summary in run.stdout  # what it prints is what it keeps
    assert "setting 1, largest S solved: softmax" in summary and "setting 2, largest S solved" in summary
    for decoder in ("softmax", "linear-delta", "dpfp-delta"):
        assert f"{decoder}: " in summary and "ms/token at position 16" in summary
    table = [line for line in summary.splitlines() if line.startswith("| translation") or line.startswith("| language")]
    assert len(table) == 6 and all("too short to tell" in line for line in table)
    assert "Done in" in run.stdout and "small_real_data" in run.stdout  # where things are, what to run next
