"""DeltaProduct (N delta-rule writes per token; the gated form decays once per token) and beta in (0, 2)
(negative eigenvalues): every backend that runs it against the float64 recurrence written out here."""
import pytest
import torch
import torch.nn.functional as F

from fairseq_fwp.ops import Memory, fast_weight_delta, fast_weight_delta_product, fast_weight_step_
from helpers import loss_weights, relative_errors

# (B, H, T, N, D, Dv): one token, T N not a multiple of the chunk (32 at D <= 32), D != Dv both ways.
SHAPES = [(1, 1, 1, 2, 4, 4), (2, 3, 7, 2, 5, 3), (1, 2, 23, 3, 6, 10)]


def product_inputs(B, H, T, N, D, Dv, with_state=True, gated=False, seed=0, dtype=torch.float64):
    """q, k (unit norm), v, beta in (0, 2), W0, and a log-decay, all leaves needing gradients."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = F.normalize(torch.randn(B, H, T, N, D, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, H, T, N, Dv, generator=g, dtype=dtype)
    beta = 2 * torch.rand(B, H, T, N, generator=g, dtype=dtype)
    W0 = torch.randn(B, H, Dv, D, generator=g, dtype=dtype) if with_state else None
    log_a = torch.log(0.5 + 0.5 * torch.rand(B, H, T, generator=g, dtype=dtype)) if gated else None
    return [None if x is None else x.requires_grad_() for x in (q, k, v, beta, W0, log_a)]


def recurrence(q, k, v, beta, W0, log_a):
    """The product of Householder steps, token by token (Siems et al., 2025): the decay once, then N writes
    W <- W + beta_i (v_i - W k_i) k_i^T, then the read W q."""
    B, H, T, N, D = k.shape
    W = q.new_zeros(B, H, v.shape[-1], D) if W0 is None else W0
    outs = []
    for t in range(T):
        if log_a is not None:
            W = W * log_a[:, :, t].exp()[..., None, None]
        for i in range(N):
            k_i = k[:, :, t, i]
            vbar = (W @ k_i.unsqueeze(-1)).squeeze(-1)
            W = W + (beta[:, :, t, i, None] * (v[:, :, t, i] - vbar)).unsqueeze(-1) * k_i.unsqueeze(-2)
        outs.append((W @ q[:, :, t].unsqueeze(-1)).squeeze(-1))
    return torch.stack(outs, 2), W


def outputs_and_grads(run, inputs):
    out, W = run(*inputs)
    weights = loss_weights((out, W), torch.Generator().manual_seed(1))
    loss = (out * weights[0]).sum() + (W * weights[1]).sum()
    names = ["dq", "dk", "dv", "dbeta", "dstate", "dlog_decay"]
    wrt = {n: x for n, x in zip(names, inputs) if x is not None}
    return {"out": out.detach(), "state": W.detach(), **dict(zip(wrt, torch.autograd.grad(loss, list(wrt.values()))))}


@pytest.mark.parametrize("backend", ["reference", "chunked", "auto"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_deltaproduct_matches_the_float64_recurrence(backend, shape, with_state, gated):
    inputs = product_inputs(*shape, with_state=with_state, gated=gated)

    def op(q, k, v, beta, W0, log_a):
        return fast_weight_delta_product(q, k, v, beta, W0, log_decay=log_a, backend=backend)

    got, want = outputs_and_grads(op, inputs), outputs_and_grads(recurrence, inputs)
    # relative to the largest value, and to 1e-6 where that is exactly zero (a decay before an empty memory)
    errors = {n: ((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-6)).item() for n in want}
    assert max(errors.values()) < 1e-10, errors


def test_deltaproduct_in_float32_and_with_full_forgets():
    """float32 against the float64 recurrence, with a decay of exactly zero (log a = -inf) mid-sequence."""
    inputs = product_inputs(2, 2, 40, 2, 16, 12, gated=True, dtype=torch.float32)
    with torch.no_grad():
        inputs[5][:, :, 17] = float("-inf")
    wide = [x.detach().double().requires_grad_() for x in inputs]
    got = outputs_and_grads(lambda *x: fast_weight_delta_product(*x[:5], log_decay=x[5]), inputs)
    want = outputs_and_grads(recurrence, wide)
    want["dlog_decay"] = torch.nan_to_num(want["dlog_decay"])  # d/d(log a) = a d/da: 0 at a = 0
    errors = relative_errors(got, want)
    assert all(torch.isfinite(x).all() for x in got.values()) and max(errors.values()) < 1e-5, errors


def test_one_write_per_token_is_the_delta_rule():
    q, k, v, beta, W0, _ = product_inputs(2, 2, 9, 1, 5, 4)
    product = fast_weight_delta_product(q, k, v, beta / 2, W0)
    delta = fast_weight_delta(q, k[:, :, :, 0], v[:, :, :, 0], beta[..., 0] / 2, W0)
    torch.testing.assert_close(product[0], delta[0])
    torch.testing.assert_close(product[1], delta[1])


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("start", ["empty", "W"])
def test_decoding_steps_equal_the_sequence_op_through_factors_and_reorders(gated, start):
    """Token by token from an empty memory (factors first, then W: D = Dv = 8 switches after 4 tokens) or
    from a given W, with a beam reorder after every step."""
    q, k, v, beta, W0, log_a = (None if x is None else x.detach() for x in product_inputs(3, 2, 9, 3, 8, 8,
                                                                                          gated=gated))
    order = torch.tensor([2, 0, 0])
    memory = Memory(fast_weight=None if start == "empty" else W0.clone())
    W_ref = torch.zeros_like(W0) if start == "empty" else W0.clone()
    for t in range(9):
        step = slice(t, t + 1)
        gate = None if log_a is None else log_a[:, :, step]
        want, W_ref = recurrence(q[:, :, step], k[:, :, step], v[:, :, step], beta[:, :, step], W_ref, gate)
        got = fast_weight_step_(memory, q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], rule="gated-delta-product"
                                if gated else "delta-product", log_decay=None if gate is None else gate[:, :, 0])
        torch.testing.assert_close(got, want[:, :, 0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(memory.materialized(), W_ref, rtol=1e-12, atol=1e-12)
        memory.reorder_(order)
        q, k, v, beta, W_ref = (x[order] for x in (q, k, v, beta, W_ref))
        log_a = None if log_a is None else log_a[order]


def test_bad_shapes_name_the_tensor():
    q, k, v, beta, _, _ = product_inputs(1, 2, 5, 2, 4, 3)
    with pytest.raises(ValueError, match="^beta has shape"):
        fast_weight_delta_product(q, k, v, beta[..., 0])
    with pytest.raises(ValueError, match="^k must have a writes-per-token axis"):
        fast_weight_delta_product(q, k[:, :, :, 0], v, beta)
