"""examples/state_tracking: the tasks' states, and one short run of the runner through every row."""
import itertools

import pytest
import torch

from examples.state_tracking import __main__ as runner
from examples.state_tracking.model import StateTracker
from examples.state_tracking.rows import ROWS
from examples.state_tracking.tasks import PERMUTATIONS, TASKS


def test_the_states_are_parity_counts_and_compositions():
    g = torch.Generator().manual_seed(0)
    tokens, states = TASKS["parity"].batch(3, 17, g)
    assert torch.equal(states, tokens.cumsum(1) % 2)
    tokens, states = TASKS["mod3"].batch(3, 17, g)
    assert torch.equal(states, tokens.cumsum(1) % 3)
    tokens, states = TASKS["s3"].batch(4, 9, g)
    for row in range(4):
        state = (0, 1, 2)
        for t in range(9):
            p = PERMUTATIONS[tokens[row, t]]
            state = tuple(p[state[i]] for i in range(3))  # the new token acts after the earlier ones
            assert PERMUTATIONS[states[row, t]] == state
    assert len(set(itertools.permutations(range(3)))) == 6 == TASKS["s3"].classes


@pytest.mark.parametrize("row", ROWS)
def test_every_row_tracks_with_one_state_per_token(row):
    model = StateTracker(TASKS["s3"], ROWS[row])
    tokens, _ = TASKS["s3"].batch(2, 7, torch.Generator().manual_seed(1))
    assert model(tokens).shape == (2, 7, 6)


def test_a_short_run_reports_every_test_length():
    result = runner.train_and_test("parity", "DeltaProduct N=2 [-1,1]", seed=1, updates=3)
    assert set(result["accuracy"]) == set(TASKS["parity"].test_lengths)
    assert all(0 <= a <= 1 for a in result["accuracy"].values())
    assert result["updates"] == 3


@pytest.mark.slow  # its runs go to worker processes
def test_a_result_of_other_updates_is_run_again_and_one_of_as_many_is_kept(tmp_path):
    import json

    def run(updates):
        runner.main(["--out", str(tmp_path), "--tasks", "parity", "--rows", "sum", "--seeds", "1", "--workers", "1",
                     "--updates", str(updates)])
        return json.loads((tmp_path / "results.json").read_text())["parity | sum | 1"]

    first = run(3)
    assert first["updates"] == 3 and run(3) == first  # kept
    assert run(4)["updates"] == 4  # run again
