"""The ops' invariants (op_invariants.py) over random calls (op_cases.py), each invariant on each registered rule
(a new rule joins by being registered). An example that checks nothing (a refusal, no tokens to decode) is
rejected, not counted, and each test fails unless enough of its examples checked what it states. The examples
kept below are cases that failed once, kept as they were drawn."""
import pytest
import torch
from hypothesis import event, example, given, note, reject, settings

from conftest import assert_reached, examples, own_examples
from op_cases import OpCase, backends_here, op_cases
from nothing_to_check import NothingToCheck
from op_invariants import OP_INVARIANTS, named_backend_agrees_with_the_reference
from reproduce import op_command

from fairseq_fwp.ops import UPDATE_RULES

KEPT = {
    # full forgets in a row across a chunk border, as decay=, in float32 (the chunked form's cumulative sums)
    "gated-delta": [OpCase("gated-delta", 1, 2, 70, 6, 5, 1, torch.float32, True, "chunked", "decay", "zeros in a row",
                           3.0, 1.0, 0),
                    # decays near 2e-9 (below sqrt(eps)) as decay= in float64: gradients within sqrt(eps), the
                    # exactness decay.py has
                    OpCase("gated-delta", 1, 1, 33, 40, 1, 1, torch.float64, False, "auto", "decay", "none", 6.0,
                           1.0, 0)],
    # log-decays at float32's lowest (a mask's), which a cumulative sum must not spread to the chunk's others
    "gated-sum": [OpCase("gated-sum", 2, 1, 70, 40, 8, 1, torch.float32, False, "chunked", "log_decay",
                         "the lowest float", 0.5, 1.0, 1)],
    # decays below sqrt(eps) in different channels of KDA, whose writes mix channels (decay.py's passes)
    "kda": [OpCase("kda", 2, 2, 17, 4, 3, 1, torch.float64, True, "chunked", "decay", "small", 3.0, 1.0, 2)],
}


@pytest.mark.parametrize("rule", sorted(UPDATE_RULES))
@pytest.mark.parametrize("invariant", OP_INVARIANTS, ids=lambda f: f.__name__)
def test_every_call_of_the_ops(invariant, rule):
    # the reference is named_backend_agrees_with_the_reference's oracle, not one of its comparisons
    backends = backends_here(rule, with_reference=invariant is not named_backend_agrees_with_the_reference)
    checked = []

    @own_examples(f"{invariant.__name__}-{rule}")
    @settings(max_examples=examples(6))
    @given(case=op_cases(rule, backends))
    def holds(case):
        note(f"reproduce: {op_command(invariant, case)}")
        try:
            invariant(case)
        except NothingToCheck as why:
            event(f"nothing to check: {why}")
            reject()
        checked.append(case)

    for case in KEPT.get(rule, ()):
        holds = example(case=case)(holds)
    holds()
    assert_reached(checked, f"{invariant.__name__} on {rule}", lambda case: case.T > 1)
