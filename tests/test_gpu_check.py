"""The GPU check's driver (scripts/gpu_check.py) on the CPU: its dry run must keep working."""
import os
import subprocess
import sys

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


def test_pytest_result_lines_are_read_with_and_without_xdist():
    plain = gpu_check.RESULT_LINE.search("tests/test_fla.py::test_gpu_x[a-b] PASSED                [ 10%]")
    parallel = gpu_check.RESULT_LINE.search("[gw1] [ 11%] FAILED tests/test_ops.py::test_y ")
    assert (plain.group(1), plain.group(2)) == ("tests/test_fla.py::test_gpu_x[a-b]", "PASSED")
    assert (parallel.group(3), parallel.group(4)) == ("FAILED", "tests/test_ops.py::test_y")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU's part")
def test_dry_run_trains_in_bfloat16_both_ways_and_reports(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--parts",
                           "training,benchmark", "--updates", "20", "--time-scale", "10", "--report-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (report,) = tmp_path.iterdir()
    text = report.read_text()
    assert report.name.endswith("_dry_run.md") and text.startswith("How to read this report")
    bf16_rows = [line for line in text.splitlines() if "| --bf16 | chunked |" in line]
    assert len(bf16_rows) == 2 and all("| yes |" in row for row in bf16_rows)
    assert any("| fairseq-train |" in row for row in bf16_rows)
    assert any("| python -m fairseq_cli.train |" in row for row in bf16_rows)
    assert text.count("skipped: needs CUDA") == 5  # four fp16/amp trainings and the benchmark
    assert "- training: passed" in text and "- benchmark: skipped" in text
    assert "nothing: there is no GPU here" in text


@pytest.mark.slow
def test_a_part_past_its_time_limit_is_stopped_and_reported(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--parts", "training",
                           "--time-scale", "0.1", "--report-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    (report,) = tmp_path.iterdir()
    assert "- training: stopped at its time limit (15 s)" in report.read_text(), report.read_text()[-2000:]
    assert proc.returncode == 0
