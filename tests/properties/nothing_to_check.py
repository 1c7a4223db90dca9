"""An example on which an invariant has nothing to check (a refusal, no fast-weight layer, no tokens): the
invariant raises NothingToCheck, the property tests reject the example (hypothesis's statistics count it as
filtered, and the tests' reach counts it out), and reproduce.py says so."""


class NothingToCheck(Exception):
    pass


def require(condition, why):
    """Raises NothingToCheck(why) unless `condition`."""
    if not condition:
        raise NothingToCheck(why)
