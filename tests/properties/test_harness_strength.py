"""The harness catches the bugs it claims to: each of these mutants (tests/mutation/mutants.py: a plausible bug
that went through an earlier form of the harness, or that it was built to find) is applied to a copy of the
repository, and the suite's run of the properties it breaks fails there on an assertion, as scripts/mutants.sh
counts a catch (tests/mutation/catches.py: a crash is not one). scripts/mutants.sh measures the whole set, the
fast lane included (docs/DEVELOPERS.md)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "mutation"))
from copies import apply, copy_of_the_repository, pytest_in  # noqa: E402
from mutants import MUTANTS  # noqa: E402
from run import judged  # noqa: E402

NAMED = ("chunked-delta-beta-gradient-through-chunk-starts",  # passed all 18 property tests of the first harness
         "reorder-skips-short-convolution-caches",  # passed them too: wrong tokens in beams with short convolutions
         "disjoint-supports-under-attention-normalisation",  # 4e-3 of the largest gradient in float32
         # an LM's prompt read in one call: the corners its generation invariant first missed
         "log-probability-chunk-targets-a-column-slice",  # an adaptive softmax, 256 tokens, several rows: crashed
         "temperature-divides-in-place",  # an adaptive softmax sampled the first new token at T squared
         "prompts-eos-ends-the-hypothesis-in-the-forced-positions",  # a prompt's </s>: the result hung on the batch
         "a-beam-of-the-vocabulary-starts-after-the-prompt")  # other hypotheses than forcing's, </s> inside them


@pytest.mark.slow
@pytest.mark.parametrize("mutant", [m for m in MUTANTS if m.name in NAMED], ids=lambda m: m.name)
def test_the_suites_property_run_fails_on_the_mutant(mutant, tmp_path):
    copy = copy_of_the_repository(str(tmp_path))
    apply(mutant, copy)
    run = pytest_in(copy, "tests/properties", "-k", mutant.harness, selection=mutant.harness, stop_at_catch=True)
    result = judged(mutant, [("harness", run.failures, 0.0)], harness_only=True)
    assert result["result"] == "harness", f"{result}\n{run.output[-3000:]}"


def test_every_mutant_still_applies():
    """Each mutant's original text is in its file exactly once: code that moved (a function to a module of its own)
    leaves no mutant stale until a run of scripts/mutants.sh finds it."""
    def count(path, text):
        with open(os.path.join(ROOT, path)) as file:
            return file.read().count(text)

    stale = [f"{mutant.name}: {path} holds its text {count(path, original)} times"
             for mutant in MUTANTS for path, original, _ in mutant.edits if count(path, original) != 1]
    assert not stale, stale
