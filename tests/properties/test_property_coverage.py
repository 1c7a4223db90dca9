"""The harness covers what can be chosen: every registered update rule (each op invariant is a test per rule,
each model invariant a test per family of rules: test_op_properties.py, test_model_properties.py, which also
check what their examples reach), every feature map, every --fwp-* flag of both architectures and each of its
values; a rule and a map registered later join the draws."""
import pytest
from hypothesis import find, settings

from fairseq_fwp.modules.feature_maps import FEATURE_MAPS, FeatureMap, register_feature_map
from fairseq_fwp.ops import UPDATE_RULES
from fairseq_fwp.ops.rules.delta import DeltaRule
from fairseq_fwp.ops.rules import register_update_rule
from flag_combos import ARCHS, NOT_DRAWN, NOT_DRAWN_VALUES, drawn_values, families, fast_weight_maps, model_fields
from op_cases import backends_here, op_cases
from op_invariants import OP_INVARIANTS

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


def test_a_new_rule_and_map_join_the_draws_and_every_op_invariant_checks_the_rule(a_new_rule_and_map):
    assert "coverage-rule" in families()["delta"] and "coverage-map" in fast_weight_maps()
    case = find(op_cases("coverage-rule", backends_here("coverage-rule")), lambda c: c.T > 1, settings=SEARCH)
    for invariant in OP_INVARIANTS:
        invariant(case)


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
            left_out = {value for name, value in NOT_DRAWN_VALUES if name == dest}
            assert set(drawn[f"--{dest.replace('_', '-')}"]) == {str(m.value) for m in choices.values()} - left_out


def test_a_failures_command_lines_rerun_its_example(capsys):
    """The lines a failure prints (docs/DEVELOPERS.md) parse back into their examples and run them."""
    import shlex

    import reproduce
    from flag_combos import Combination
    from model_invariants import decoding_equals_the_full_forward
    from op_invariants import state_alone_is_the_sequences_final_state

    case = find(op_cases("delta", backends_here("delta")), lambda c: c.T > 1, settings=SEARCH)
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
    case = find(op_cases("sum", backends_here("sum")), lambda c: c.T > 1, settings=SEARCH)
    with pytest.raises(AssertionError, match=f"rejected {case.rule} at T = {case.T}"):
        reproduce.main(["rejects", "--case", repr(case)])
