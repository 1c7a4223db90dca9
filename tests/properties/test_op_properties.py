"""The ops' invariants (op_invariants.py) over random calls of every registered rule (op_cases.py). The
examples below are cases that failed once, kept as they were drawn."""
import pytest
import torch
from hypothesis import example, given, note, settings

from conftest import examples
from op_cases import OpCase, op_cases
from op_invariants import OP_INVARIANTS
from reproduce import op_command


@pytest.mark.parametrize("invariant", OP_INVARIANTS, ids=lambda f: f.__name__)
@settings(max_examples=examples(20))
@given(case=op_cases())
# full forgets in a row across a chunk border, as decay=, in float32 (the chunked form's cumulative sums)
@example(case=OpCase("gated-delta", 1, 2, 70, 6, 5, 1, torch.float32, True, "chunked", "decay", "zeros in a row", 3.0, 1.0, 0))
# log-decays at float32's lowest (a mask's), which a cumulative sum must not spread to the chunk's others
@example(case=OpCase("gated-sum", 2, 1, 70, 40, 8, 1, torch.float32, False, "chunked", "log_decay", "the lowest float",
                     0.5, 1.0, 1))
# decays below sqrt(eps) in different channels of KDA, whose writes mix channels (decay.py's passes)
@example(case=OpCase("kda", 2, 2, 17, 4, 3, 1, torch.float64, True, "chunked", "decay", "small", 3.0, 1.0, 2))
# decays near 2e-9 (below sqrt(eps)) as decay= in float64: gradients within sqrt(eps), the exactness decay.py has
@example(case=OpCase("gated-delta", 1, 1, 33, 40, 1, 1, torch.float64, False, "auto", "decay", "none", 6.0, 1.0, 0))
def test_every_call_of_the_ops(invariant, case):
    note(f"reproduce: {op_command(invariant, case)}")
    invariant(case)
