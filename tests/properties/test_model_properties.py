"""The models' invariants (model_invariants.py) over random --fwp-* combinations (flag_combos.py) of the
translation model and the LM: the first invariant on the combination as drawn, the others on what is taken
of it (flag_combos.taken: the flags its refusals name dropped). A combination whose backend cannot run on
this machine is refused at its first forward, naming the flag, and hypothesis draws another."""
import pytest
import torch
from hypothesis import HealthCheck, given, note, reject, settings
from hypothesis import strategies as st

import model_invariants as invariants
from conftest import examples
from flag_combos import combinations, taken
from reproduce import model_command

SEEDS = st.integers(0, 2**16)
# each invariant's own draws beside the combination and a seed
EXTRA = {invariants.decoding_equals_the_full_forward: st.sampled_from([None, 2, 5]),  # factors held for ... tokens
         invariants.the_fused_step_decodes_as_the_rules_own: st.sampled_from([torch.float32, torch.float64]),
         invariants.a_prompt_in_one_call_then_single_tokens_equals_the_full_forward: st.integers(1, 7),
         invariants.two_carried_segments_equal_one_long_one: st.integers(1, 8)}


@pytest.mark.parametrize("invariant", invariants.MODEL_INVARIANTS, ids=lambda f: f.__name__)
@settings(max_examples=examples(8), suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(data=st.data())
def test_every_combination_of_flags(invariant, data):
    combination = data.draw(combinations(), label="combination")
    if invariant is not invariants.refused_naming_a_flag_or_built:
        combination = taken(combination)
        note(f"taken: {combination.command()}")
    extra = [data.draw(EXTRA[invariant], label="draw")] if invariant in EXTRA else []
    seed = data.draw(SEEDS, label="seed")
    note(f"reproduce: {model_command(invariant, combination, seed, extra)}")
    try:
        invariant(combination, seed, *extra)
    except invariants.Refused:
        reject()
