"""The GPU check's driver (scripts/gpu_check.py) on the CPU: its dry run must keep working."""
import os
import re
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_check  # noqa: E402


def test_losses_are_read_from_the_training_log():
    log = ("| train_inner | epoch 001:      1 / 9 loss=5.881, nll_loss=5.1, ppl=58.95\n"
           "| train_inner | epoch 001:      2 / 9 loss=nan, nll_loss=nan, ppl=nan\n"
           "| valid | epoch 001 | valid on 'valid' subset | loss 5.501 | ppl 45.27\n")
    values = gpu_check.losses(log)
    assert values[0] == 5.881 and len(values) == 2 and values[1] != values[1]  # nan


def test_the_times_of_the_first_and_the_later_updates_are_read_from_the_training_log():
    log = ("| train_inner | epoch 001:  1 / 9 loss=5.8, ups=0, num_updates=1, lr=1e-05, train_wall=41, wall=44\n"
           "| train_inner | epoch 001:  2 / 9 loss=5.7, ups=20, num_updates=2, lr=2e-05, train_wall=0, wall=44\n"
           "| train_inner | epoch 001:  3 / 9 loss=5.6, ups=25, num_updates=3, lr=3e-05, train_wall=0, wall=44\n"
           "| train_inner | epoch 001:  4 / 9 loss=5.5, ups=40, num_updates=4, lr=4e-05, train_wall=0, wall=44\n")
    assert gpu_check.update_times(log) == (44.0, 1 / 25)


def test_a_table_row_is_told_from_its_header():
    assert gpu_check.first_row_line("intro\n\n| a | b |\n|---|---|\n") is None
    assert gpu_check.first_row_line("intro\n\n| a | b |\n|---|---|\n| 1 | 2 |\n") == 4


CUT_SHORT = """
import time

def test_passes():
    pass

def test_fails():
    assert 1 + 1 == 3, "one and one make three"

def test_never_ends():
    time.sleep(600)
"""


def test_a_failure_is_in_the_report_as_soon_as_pytest_reports_it(tmp_path):
    """The plugin writes each outcome as it comes: a run stopped at its time limit, as the GPU check stops
    a part, still says which test failed and why."""
    (tmp_path / "test_cut_short.py").write_text(CUT_SHORT)
    section = tmp_path / "section.md"
    env = dict(os.environ, GPU_CHECK_SECTION=str(section), GPU_CHECK_HEADER="The header.",
               PYTHONPATH=os.path.join(ROOT, "scripts"))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "gpu_check_plugin", "-p", "no:cacheprovider",
                             "test_cut_short.py"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (section.exists() and "| 1 | 1 |" in section.read_text()):
        time.sleep(0.2)  # until one test has passed and one failed: the third never ends
    proc.kill()
    proc.wait()
    text = section.read_text()
    assert text.startswith("The header.\n")
    assert "| test_cut_short.py | 1 | 1 | 0 |" in text
    assert "- `test_cut_short.py::test_fails` (call): AssertionError: one and one make three" in text
    assert "pytest exit status" not in text  # it never finished


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU's part")
def test_dry_run_runs_every_part_and_reports(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--updates", "20",
                           "--train-step-rows", "fairseq-softmax,linear-delta", "--time-scale", "10",
                           "--report-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (report,) = tmp_path.iterdir()
    text = report.read_text()
    assert report.name.endswith("_dry_run.md") and text.startswith("How to read this report")
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert sections == ["## What ran on the GPU", "## GPU tests", "## Op benchmark", "## fairseq-train in half precision",
                        "## Training steps, GPT-2 small", "## Profile of one training step, T = 2048", "## Outcome"]
    assert re.search(r"\| test_fla\.py \| 0 \| 0 \| [1-9]\d* \|", text)  # its GPU tests only, skipped here
    assert re.search(r"\| 64 \| linear-delta \| [\d,]+ \| [\d.]+x \|", text)
    bf16_rows = [line for line in text.splitlines() if "| --bf16 | chunked |" in line]
    assert len(bf16_rows) == 2 and all("| yes |" in row for row in bf16_rows)
    assert any("| fairseq-train |" in row for row in bf16_rows)
    assert any("| python -m fairseq_cli.train |" in row for row in bf16_rows)
    assert text.count("skipped: needs CUDA") == 5  # four fp16/amp trainings and the benchmark
    for row in ("fairseq-softmax", "linear-delta"):  # the profile part's rows, each with its costliest ops
        assert re.search(rf"### Profile: {row}, T = 64: one step, [\d.]+ ms of CPU time.*\n\n\| op \| calls \| ms \| "
                         rf"share \|\n\|---\|---\|---\|---\|\n(\| `.+` \| \d+ \| [\d.]+ \| [\d.]+% \|\n){{25}}", text)
    for part in ("tests: skipped", "train-step: passed", "benchmark: skipped", "training: passed", "profile: passed"):
        assert f"- {part} (" in text
    assert "nothing: there is no GPU here" in text


@pytest.mark.slow
def test_a_part_past_its_time_limit_is_stopped_and_reported(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--parts", "training",
                           "--time-scale", "0.2", "--report-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    (report,) = tmp_path.iterdir()
    assert "- training: stopped at its time limit (11 s)" in report.read_text(), report.read_text()[-2000:]
    assert proc.returncode == 0
