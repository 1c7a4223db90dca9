"""The ops' regression timer (examples/speed/ops_against_checkout.py) runs and compares two checkouts."""
import os

import pytest

from examples.recipes.commands import python

pytestmark = pytest.mark.slow  # times the ops in subprocesses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "speed", "ops_against_checkout.py")


def test_a_checkout_against_itself_prints_one_ratio_per_rule():
    proc = python(SCRIPT, ROOT, "--rounds", "1", "--T", "64", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| sum ") or line.startswith("| delta ")]
    assert len(rows) == 2 and all(row.endswith("x |") for row in rows)


def test_a_directory_without_the_package_is_refused(tmp_path):
    proc = python(SCRIPT, tmp_path, cwd=ROOT)
    assert proc.returncode == 2 and "has no fairseq_fwp/" in proc.stderr
