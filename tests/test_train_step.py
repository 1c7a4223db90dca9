"""examples/speed/train_step.py, the GPU training-step benchmark, at its tiny shape on the CPU."""
import os
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "speed"))

import train_step  # noqa: E402


@pytest.mark.parametrize("row", list(train_step.ROWS))
def test_every_row_trains_at_the_tiny_shape(row):
    result = train_step.run_row(row, "tiny", 64, steps=3, device=torch.device("cpu"))
    losses = result["losses"]  # the same batch three more times (with dropout): the model learns it
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    tokens = train_step.SHAPES["tiny"][6]
    assert 3 * tokens / result["tokens_per_s"] >= result["step_s"] > 0  # the 3 later steps' time, their median
    expected = ["softmax attention"] if row.endswith("softmax") else ["chunked"]  # auto on the CPU
    assert result["backends"] == expected


@pytest.mark.slow  # a new process, stopped after 10 s
def test_a_row_past_its_time_limit_is_stopped_there():
    """A row that would run for minutes (100,000 steps) is stopped at its limit, its lengths reported so."""
    start = time.time()
    results = dict(train_step.run_in_child("linear-delta", "tiny", [64, 256], 100_000, "cpu", limit=10))
    assert 10 <= time.time() - start < 120  # not its 100,000 steps (minutes); room for a busy machine's start
    assert results == {64: {"stopped": "stopped at its time limit (10 s)"},
                       256: {"stopped": "stopped at its time limit (10 s)"}}


@pytest.mark.slow  # a new process
def test_a_child_runs_each_length_and_profiles_a_step():
    results = list(train_step.run_in_child("linear-delta", "tiny", [32, 64], 1, "cpu", limit=120, profile_ops=3))
    assert [length for length, _ in results] == [32, 64]
    for _, result in results:
        assert result["backends"] == ["chunked"]
        profile = result["profile"]
        assert len(profile["ops"]) == 3 and profile["device_ms"] > 0
        shares = [share for _, _, _, share in profile["ops"]]
        assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1
