"""100,000-token streams through a fast-weight layer with its state carried (examples/reliability/long_streams.py)."""
import json
import os

import pytest

from examples.recipes.commands import python

pytest.importorskip("fairseq")
pytestmark = pytest.mark.slow  # the example in a subprocess: 100,000 tokens per case

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def results():
    """{(rule, inputs, dtype): the case's numbers}, from one run of the example."""
    proc = python(os.path.join(ROOT, "examples", "reliability", "long_streams.py"), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    return {(r["rule"], r["inputs"], r["dtype"]): r for r in rows}


@pytest.mark.parametrize("inputs", ["random", "repeated", "repeated+beta~1+10x values"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_delta_rule_stays_finite_and_bounded(results, inputs, dtype):
    r = results["delta", inputs, dtype]
    assert r["finite"]
    assert r["W@100000"] < 1.5 * r["W@10000"]  # saturates: sum-normalised keys make each write a contraction
    assert r["max|out|"] < 20


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_sum_rule_grows_and_attention_normalisation_bounds_its_output(results, dtype):
    plain, normalised = results["sum", "random", dtype], results["sum+attn-norm", "random", dtype]
    assert plain["finite"] and normalised["finite"]
    assert plain["W@100000"] > 5 * plain["W@10000"]  # W = sum of all writes grows with the stream
    assert normalised["max|out|"] < 10 < plain["max|out|"]  # a weighted average of values
    assert normalised["max z"] > 1000  # the normaliser grows without bound
