"""The gated rules (a decay a_t per head and step; Gated DeltaNet) against the reference loops."""
import pytest
import torch

from fairseq_fwp.ops import BackendUnavailableError, fast_weight_delta, fast_weight_delta_state, fast_weight_sum
from fairseq_fwp.ops import fast_weight_sum_state
from fairseq_fwp.ops.chunked_gated import gated_chunked
from helpers import (assert_all_close, make_decay, make_inputs, outputs_and_grads, recurrence, relative_errors,
                       with_full_forgets)

RULES = ["sum", "delta"]
# (B, H, T, D, Dv): T = 1, T < C, T not a multiple of C (C = 32 for D <= 32, else 64), D != Dv both ways.
SHAPES = [(2, 3, 1, 4, 4), (1, 1, 7, 5, 3), (1, 2, 70, 6, 10), (2, 1, 65, 40, 8), (1, 1, 130, 64, 48)]


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
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_reference_float64(rule, shape, with_state):
    inputs = make_inputs(*shape, with_state=with_state)
    decay = make_decay(*shape[:3])
    want = outputs_and_grads(rule, inputs, "reference", decay=decay)
    got = outputs_and_grads(rule, inputs, "chunked", decay=decay)
    assert_all_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("rule", RULES)
def test_chunked_matches_reference_float32(rule):
    inputs = make_inputs(2, 2, 100, 16, 12, dtype=torch.float32)
    decay = make_decay(2, 2, 100, dtype=torch.float32)
    assert_all_close(outputs_and_grads(rule, inputs, "chunked", decay=decay),
            outputs_and_grads(rule, inputs, "reference", decay=decay), rtol=1e-4, atol=1e-4)


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


@pytest.mark.parametrize("backend", ["reference", "chunked"])
@pytest.mark.parametrize("rule", RULES)
def test_state_only_ops(backend, rule):
    inputs = make_inputs(1, 2, 40, 6, 5)
    q, k, v, beta, W0 = inputs
    decay = make_decay(1, 2, 40)
    if rule == "sum":
        W = fast_weight_sum_state(k, v, W0, decay=decay, backend=backend)
        _, want = fast_weight_sum(q, k, v, W0, decay=decay, backend="reference")
    else:
        W = fast_weight_delta_state(k, v, beta, W0, decay=decay, backend=backend)
        _, want = fast_weight_delta(q, k, v, beta, W0, decay=decay, backend="reference")
    torch.testing.assert_close(W, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(torch.autograd.grad(W.sum(), decay)[0], torch.autograd.grad(want.sum(), decay)[0],
                               rtol=1e-9, atol=1e-9)


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


FORGETS = ["one zero", "zeros in a row", "subnormal"]


@pytest.mark.parametrize("backend", ["reference", "chunked", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("pattern", FORGETS)
@pytest.mark.parametrize("given", ["decay", "log_decay"])
def test_full_forgets_match_the_float64_recurrence(backend, dtype, rule, pattern, given):
    """A decay of exactly zero (a full forget), several in a row, or below float32's smallest normal:
    outputs, final state and every gradient (to the decay, or to its log) as the step-by-step loops
    give them in float64 with the decay as a plain multiplier."""
    inputs = make_inputs(1, 2, 70, 6, 5, dtype=dtype)
    decay = with_full_forgets(make_decay(1, 2, 70, dtype=dtype), pattern)
    gate = {"decay": decay} if given == "decay" else {"log_decay": decay.detach().log().requires_grad_()}
    got = outputs_and_grads(rule, inputs, backend, **gate)
    wide = [x.detach().double().requires_grad_() for x in inputs]
    wide_decay = decay.detach().double().requires_grad_()
    want = outputs_and_grads(rule, wide, recurrence(rule), decay=wide_decay)
    if given == "log_decay":  # d/d(log a) = a d/da; zero where a = 0
        want["ddecay"] = want["ddecay"] * wide_decay.detach()
    assert all(torch.isfinite(x).all() for x in got.values())
    errors = relative_errors(got, want)
    assert max(errors.values()) < (1e-5 if dtype == torch.float32 else 1e-10), errors


# Very negative but finite log-decays, as a mask writes them (a is 0, or nearly, in every dtype): the
# chunked form must not lose the other decays of the chunk to a cumulative sum that holds them.
EXTREME_LOG_DECAYS = [-30.0, -90.0, -1e3, -1e4, -1e6, -1e9, "finfo.min"]


@pytest.mark.parametrize("backend", ["reference", "chunked", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("value", EXTREME_LOG_DECAYS)
def test_very_negative_log_decays_match_the_float64_recurrence(backend, dtype, rule, value):
    inputs = make_inputs(1, 2, 70, 6, 5, dtype=dtype)
    log_a = make_decay(1, 2, 70, dtype=dtype).detach().log()
    extreme = torch.finfo(dtype).min if value == "finfo.min" else value
    log_a[..., [5, 40, 41, 69]] = extreme
    log_a.requires_grad_()
    got = outputs_and_grads(rule, inputs, backend, log_decay=log_a)
    wide = [x.detach().double().requires_grad_() for x in inputs]
    wide_decay = log_a.detach().double().exp().requires_grad_()
    want = outputs_and_grads(rule, wide, recurrence(rule), decay=wide_decay)
    want["ddecay"] = want["ddecay"] * wide_decay.detach()  # d/d(log a) = a d/da
    assert all(torch.isfinite(x).all() for x in got.values())
    errors = relative_errors(got, want)
    assert max(errors.values()) < (1e-6 if dtype == torch.float32 else 1e-12), errors
