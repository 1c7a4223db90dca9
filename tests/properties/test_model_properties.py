"""The models' invariants (model_invariants.py) over random --fwp-* combinations (flag_combos.py) of the
translation model and the LM, each invariant on each family of registered rules (flag_combos.family: a new
rule joins its family by being registered) with a fast-weight feature map: the first invariant on the
combination as drawn, the others on what is taken of it (flag_combos.taken: the flags its refusals name
dropped, but the family's own). An example that checks nothing (no fast-weight layer where the invariant is
about one, a combination that cannot keep its family's flags) is rejected, not counted, and each test fails
unless enough of its examples checked what it states."""
import pytest
import torch
from hypothesis import HealthCheck, event, given, note, reject, settings
from hypothesis import strategies as st

import model_invariants as invariants
from conftest import assert_reached, examples, own_examples
from flag_combos import ARCHS, FAMILY_FLAGS, combinations, families, fast_weight_maps, taken
from nothing_to_check import NothingToCheck
from reproduce import model_command

SEEDS = st.integers(0, 2**16)
# each invariant's own draws beside the combination and a seed
EXTRA = {invariants.decoding_equals_the_full_forward: (st.sampled_from([None, 2, 5]),),  # factors held for ... tokens
         invariants.the_fused_step_decodes_as_the_rules_own: (st.sampled_from([torch.float32, torch.float64]),),
         invariants.a_prompt_in_one_call_then_single_tokens_equals_the_full_forward: (st.integers(1, 7),),
         invariants.two_carried_segments_equal_one_long_one: (st.integers(1, 8),),
         invariants.a_prompt_read_in_one_call_generates_what_forcing_does: (  # its search: a test's own (BY_SEARCH)
             st.sampled_from(invariants.SPECIALS), st.sampled_from(invariants.TEMPERATURES),
             st.integers(0, 1)),  # adaptive softmax: 1
         invariants.a_session_generates_what_the_whole_history_does: (
             st.sampled_from([1, 3]), st.integers(0, 4),  # beam, the reply's limit
             st.integers(0, 3), st.integers(0, 1),  # --min-len, an input past the limit: 1
             st.sampled_from(invariants.TURN_ONLY_OPTIONS))}
# the architectures an invariant is about, where not both
ONLY = {invariants.a_left_padded_source_computes_what_it_computes_alone: ("translation",),
        invariants.a_prompt_read_in_one_call_generates_what_forcing_does: ("lm",),
        invariants.a_session_generates_what_the_whole_history_does: ("lm",)}


# the invariants drawn on each feature map of each family (the others draw the map): the backends' numerics
# differ by map (DPFP's disjoint supports)
BY_MAP = (invariants.the_backend_gives_the_references_outputs_and_gradients,)
# ... and on each of its variants, its first draw: a few examples per test meet every search (seeded sampling
# checks the draws of the prompt positions it skips only where no prompt holds </s>), and the glue every way it
# is run
BY_VARIANT = {invariants.a_prompt_read_in_one_call_generates_what_forcing_does: tuple(invariants.SEARCHES),
              invariants.the_fused_glue_computes_its_composition: invariants.GLUE_VARIANTS}
# examples of a variant, where not 2: a beam of the vocabulary's size against forcing tells the loop's first step
# from a later one in about one draw of four
EXAMPLES = {"beam of the vocabulary": 5}
# ... and of an invariant, where not 3: the weights' reach a translation model whose cross-attention normalises in
# about one draw of three
INVARIANT_EXAMPLES = {invariants.attention_weights_reproduce_the_output: 8}
CASES = [(invariant, family, variant) for invariant in invariants.MODEL_INVARIANTS for family in sorted(families())
         for variant in (fast_weight_maps() if invariant in BY_MAP else BY_VARIANT.get(invariant, (None,)))]


@pytest.mark.parametrize("invariant, family, variant", CASES,
                         ids=[f"{i.__name__}-{f}" + (f"-{v}" if v else "") for i, f, v in CASES])
def test_every_combination_of_flags(invariant, family, variant):
    checked = []
    feature_map = variant if invariant in BY_MAP else None
    given_draws = [variant] if invariant in BY_VARIANT else []

    @own_examples(f"{invariant.__name__}-{family}-{variant}")
    @settings(max_examples=examples(EXAMPLES.get(variant, 2) if variant else INVARIANT_EXAMPLES.get(invariant, 3)),
              suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
    @given(data=st.data())
    def holds(data):
        combination = data.draw(combinations(ONLY.get(invariant, tuple(sorted(ARCHS))), family, feature_map),
                                label="combination")
        if invariant is not invariants.refused_naming_a_flag_or_built:
            combination = taken(combination, keep=FAMILY_FLAGS, draw=data.draw)
            if combination is None:
                event("nothing to check: refused for the family's own flags")
                reject()
            note(f"taken: {combination.command()}")
        extra = given_draws + [data.draw(strategy, label="draw") for strategy in EXTRA.get(invariant, ())]
        seed = data.draw(SEEDS, label="seed")
        note(f"reproduce: {model_command(invariant, combination, seed, extra)}")
        try:
            invariant(combination, seed, *extra)
        except NothingToCheck as why:
            event(f"nothing to check: {why}")
            reject()
        checked.append(combination)

    holds()
    assert_reached(checked, f"{invariant.__name__} on the {family} rules" + (f" with {variant}" if variant else ""),
                   minimum=2)
