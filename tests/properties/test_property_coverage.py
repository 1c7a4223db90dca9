"""The harness covers what can be chosen: every registered update rule and feature map (drawn from the
registries when a case is drawn, a new registration included), every --fwp-* flag of both architectures
and each of its values."""
import pytest
from hypothesis import find, settings

from fairseq_fwp.modules.feature_maps import FEATURE_MAPS, FeatureMap, register_feature_map
from fairseq_fwp.ops import UPDATE_RULES
from fairseq_fwp.ops.rules.delta import DeltaRule
from fairseq_fwp.ops.rules import register_update_rule
from flag_combos import ARCHS, NOT_DRAWN, drawn_values, model_fields
from op_cases import op_cases

SEARCH = settings(max_examples=2000, database=None)


@pytest.fixture
def a_new_rule_and_map():
    """A rule and a feature map registered for the test only."""
    @register_update_rule("coverage-rule")
    class CoverageRule(DeltaRule):
        def step(self, memory, q, k, v, beta, decay):
            return super().step(memory, q, k, v, beta, decay)

    @register_feature_map("coverage-map")
    class CoverageMap(FeatureMap):
        def __init__(self, head_dim):
            super().__init__()
            self.out_dim = head_dim

        def forward(self, x):
            return x.sigmoid()

    yield
    del UPDATE_RULES["coverage-rule"], FEATURE_MAPS["coverage-map"]


def test_every_registered_rule_is_drawn_by_the_op_cases_a_new_one_too(a_new_rule_and_map):
    drawn = set()  # one search until every rule has been drawn (a search per rule drew each rule's ~15 times over)
    find(op_cases(), lambda case: drawn.add(case.rule) or drawn >= set(UPDATE_RULES), settings=SEARCH)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_flag_and_each_of_its_values_is_drawn_a_new_rule_and_map_too(arch, a_new_rule_and_map):
    """combinations() draws each flag of drawn_values() from its values there: those must be every --fwp-*
    flag of the architecture (values_of raises for one without values) and, for a flag of choices, each
    choice, registered names included."""
    drawn = drawn_values(arch)
    fields = model_fields(arch)
    assert set(drawn) == {f"--{dest.replace('_', '-')}" for dest in fields if dest not in NOT_DRAWN}
    assert "coverage-rule" in drawn["--fwp-update-rule"] and "coverage-map" in drawn["--fwp-feature-map"]
    for dest, field in fields.items():
        choices = getattr(field.type, "__members__", None)
        if choices is not None and dest not in NOT_DRAWN:
            assert set(drawn[f"--{dest.replace('_', '-')}"]) == {str(m.value) for m in choices.values()}, dest


def test_a_failures_command_lines_rerun_its_example(capsys):
    """The lines a failure prints (docs/DEVELOPERS.md) parse back into their examples and run them."""
    import shlex

    import reproduce
    from flag_combos import Combination
    from model_invariants import decoding_equals_the_full_forward
    from op_invariants import state_alone_is_the_sequences_final_state

    case = find(op_cases(), lambda c: c.rule == "delta" and c.T > 1, settings=SEARCH)
    lines = [reproduce.op_command(state_alone_is_the_sequences_final_state, case),
             reproduce.model_command(decoding_equals_the_full_forward,
                                     Combination("lm", ("--fwp-update-rule", "delta")), 7, [2])]
    for line in lines:
        program, script, *argv = shlex.split(line)
        assert (program, script) == (".venv/bin/python", "tests/properties/reproduce.py")
        reproduce.main(argv)
    assert capsys.readouterr().out.count("passes on this example") == 2


def test_a_reproduction_raises_what_the_invariant_raises(monkeypatch):
    import reproduce

    def rejects(case):
        raise AssertionError(f"rejected {case.rule} at T = {case.T}")

    monkeypatch.setitem(reproduce.INVARIANTS, "rejects", rejects)
    case = find(op_cases(), lambda c: c.T > 1, settings=SEARCH)
    with pytest.raises(AssertionError, match=f"rejected {case.rule} at T = {case.T}"):
        reproduce.main(["rejects", "--case", repr(case)])
