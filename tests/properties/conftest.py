"""The property harness's hypothesis profiles (docs/DEVELOPERS.md: the property harness):

- "suite", in every run of the test suite: derandomized (the same examples in every run, so that CI
  is repeatable), a fixed number of examples per property, no example database;
- "long", for `bash scripts/properties.sh --minutes N`: random examples, many of them, every failure kept
  in hypothesis's example database (.hypothesis/) and printed with the blob that replays it;
- "mutants", for the runs against a mutant (tests/mutation): the suite's examples, and a failure is not
  shrunk (minutes on a model) but reported as found.
"""
import os
import zlib

from hypothesis import HealthCheck, Phase, seed, settings

settings.register_profile("suite", derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("mutants", settings.get_profile("suite"),
                          phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.register_profile("long", deadline=None, print_blob=True,
                          max_examples=int(os.environ.get("FWP_PROPERTIES_EXAMPLES", "200")),
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = os.environ.get("FWP_PROPERTIES", "suite")
settings.load_profile(PROFILE)


def examples(n):
    """A property's number of examples: n in the suite's profile; the long profile's own (as many as
    its time allows) otherwise."""
    return settings.get_profile("long").max_examples if PROFILE == "long" else n


def own_examples(test_id):
    """A decorator that gives one parametrization of a property test (`test_id`: its invariant, rule or family,
    map) examples of its own in the derandomized profiles ("suite", "mutants"): a seed of its id. Without it
    hypothesis derives the seed from the source of the inner test function, which every parametrization shares,
    so that each family drew the same flags (the decoding invariant: short convolutions in no example that
    checked something, and a reorder that skipped their caches passed). The long profile draws new examples
    anyway."""
    if not settings.default.derandomize:
        return lambda test: test
    return seed(zlib.crc32(test_id.encode()))


def assert_reached(checked, what, *corners, minimum=3):
    """What a property reached: at least `minimum` examples that checked what it states (the others were
    rejected: refusals, nothing to compare), and each corner (a predicate of an example) held in one of them."""
    assert len(checked) >= minimum, f"{what}: {len(checked)} examples checked something, fewer than {minimum}"
    for corner in corners:
        assert any(corner(example) for example in checked), f"{what}: no example checked reached {corner.__doc__}"
