"""100,000-token streams through a fast-weight layer with its state carried (examples/reliability)."""
import pytest
import torch

pytest.importorskip("fairseq")

from examples.reliability.long_streams import INPUTS, run  # noqa: E402

TOKENS, SEGMENT = 100_000, 1_000


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_delta_rule_stays_finite_and_bounded(inputs, dtype):
    r = run("delta", inputs, dtype, TOKENS, SEGMENT)
    assert r["finite"]
    assert r["W@100000"] < 1.5 * r["W@10000"]  # saturates: sum-normalised keys make each write a contraction
    assert r["max|out|"] < 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sum_rule_grows_and_attention_normalisation_bounds_its_output(dtype):
    plain = run("sum", "random", dtype, TOKENS, SEGMENT)
    normalised = run("sum+attn-norm", "random", dtype, TOKENS, SEGMENT)
    assert plain["finite"] and normalised["finite"]
    assert plain["W@100000"] > 5 * plain["W@10000"]  # W = sum of all writes grows with the stream
    assert normalised["max|out|"] < 10 < plain["max|out|"]  # a weighted average of values
    assert normalised["max z"] > 1000  # the normaliser grows without bound
