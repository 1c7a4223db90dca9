"""The gated rules (a decay a_t per head and step; Gated DeltaNet) against the reference loops."""
import pytest
import torch

from fairseq_fwp.ops import BackendUnavailableError, fast_weight_delta, fast_weight_sum
from fairseq_fwp.ops.chunked_gated import gated_chunked
from helpers import assert_all_close, make_decay, make_inputs, outputs_and_grads

RULES = ["sum", "delta"]


def test_the_reference_is_the_gated_formula():
    """Constant decay a: the gated sum rule's W_T = sum_t a^(T-t) v_t k_t^T; a = 1: the paper's rules."""
    q, k, v, beta, _ = make_inputs(1, 1, 6, 3, 2, with_state=False)
    a = 0.7
    _, W = fast_weight_sum(q, k, v, decay=torch.full((1, 1, 6), a, dtype=torch.float64), backend="reference")
    want = sum(a ** (5 - t) * torch.outer(v[0, 0, t], k[0, 0, t]) for t in range(6))
    torch.testing.assert_close(W[0, 0], want)
    ones = torch.ones(1, 1, 6, dtype=torch.float64)
    for op, args in ((fast_weight_sum, (q, k, v)), (fast_weight_delta, (q, k, v, beta))):
        gated, plain = op(*args, decay=ones, backend="reference"), op(*args, backend="reference")
        torch.testing.assert_close(gated[0], plain[0])


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_gradcheck_across_chunks(rule, chunk):
    q, k, v, beta, W0 = make_inputs(1, 2, 11, 3, 2)
    decay = make_decay(1, 2, 11)

    def fn(q, k, v, beta, W0, decay):
        return gated_chunked(q, k, v, beta if rule == "delta" else None, decay, W0, chunk_size=chunk)

    assert torch.autograd.gradcheck(fn, (q, k, v, beta, W0, decay))


@pytest.mark.parametrize("rule", RULES)
def test_strong_decays_stay_finite(rule):
    """Decays near zero over long chunks: only ratios exp(c_t - c_j) <= 1 are formed."""
    inputs = make_inputs(1, 2, 150, 8, 8)
    decay = make_decay(1, 2, 150, low=1e-4, seed=5)
    assert_all_close(outputs_and_grads(rule, inputs, "chunked", decay=decay),
            outputs_and_grads(rule, inputs, "reference", decay=decay), rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("rule", RULES)
def test_chaining_equals_one_call(rule):
    inputs = make_inputs(2, 1, 90, 6, 4)
    q, k, v, beta, W0 = inputs
    decay = make_decay(2, 1, 90)
    op = (lambda a, b, c, d, W, g: fast_weight_sum(a, b, c, W, decay=g)) if rule == "sum" else \
        (lambda a, b, c, d, W, g: fast_weight_delta(a, b, c, d, W, decay=g))
    whole, W_whole = op(q, k, v, beta, W0, decay)
    s = slice(0, 37), slice(37, 90)
    first, W1 = op(q[:, :, s[0]], k[:, :, s[0]], v[:, :, s[0]], beta[:, :, s[0]], W0, decay[:, :, s[0]])
    second, W2 = op(q[:, :, s[1]], k[:, :, s[1]], v[:, :, s[1]], beta[:, :, s[1]], W1, decay[:, :, s[1]])
    torch.testing.assert_close(torch.cat([first, second], 2), whole)
    torch.testing.assert_close(W2, W_whole)


def test_bad_decays_name_the_tensor_and_cuda_has_no_gated_rules():
    q, k, v, beta, _ = make_inputs(1, 2, 5, 3, 3)
    with pytest.raises(ValueError, match="^decay "):
        fast_weight_sum(q, k, v, decay=torch.ones(1, 2, 4, dtype=torch.float64))
    with pytest.raises(BackendUnavailableError, match="cuda.*gated"):
        fast_weight_delta(q, k, v, beta, decay=torch.ones(1, 2, 5, dtype=torch.float64), backend="cuda")
