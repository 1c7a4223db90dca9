"""decay= with decays below sqrt(eps) in some key channels of a step (ops/decay_columns.py): exact gradients from
the histories of the columns they scale, at a cost that does not grow with the number of such steps."""
import pytest
import torch
import torch.nn.functional as F

from fairseq_fwp.ops import chunked_channels, fast_weight, fast_weight_state, update_rule
from fairseq_fwp.ops.memory import FunctionalMemory
from fairseq_fwp.ops.protocol import run_step
from helpers import relative_errors

RULES = ("gla", "kda", "kda-product")  # the per-channel rules that declare their write form
# T past the chunked form's chunks (16 steps in float32, 8 in float64) and the backwards sum's (32)
B, H, T, D, Dv, N = 2, 2, 40, 5, 3, 2


def make(rule, dtype, with_state, seed=0):
    """q, k, v, beta, the decay a and W0 in `dtype`, needing gradients. Channel 0 forgets fast: below sqrt(eps)
    at every step, exactly 0 at some, on both sides of chunk borders; channel 2 is small at a few steps, two of
    them in a row; steps 20 and 27 are small in every channel (0, and below sqrt(eps))."""
    g = torch.Generator().manual_seed(seed)
    writes = (N,) if update_rule(rule).substeps else ()
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k = F.normalize(torch.randn(B, H, T, *writes, D, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, T, *writes, Dv, generator=g, dtype=torch.float64)
    beta = None if rule == "gla" else torch.rand(B, H, T, *writes, generator=g, dtype=torch.float64)
    a = 0.8 + 0.2 * torch.rand(B, H, T, D, generator=g, dtype=torch.float64)
    tiny = torch.finfo(dtype).eps ** 0.5
    a[..., 0] = tiny * torch.rand(B, H, T, generator=g, dtype=torch.float64)
    a[..., [3, 7, 8, 15, 16, 31, 32], 0] = 0.0
    a[..., 11, 0] = 1e-30  # below the chunked form's full-forget threshold: a forget there, still a gradient
    a[..., [5, 6, 16, 32], 2] = torch.tensor([0.0, tiny / 2, tiny / 7, 0.0], dtype=torch.float64)
    a[..., 20, :] = 0.0
    a[..., 27, :] = tiny / 5
    W0 = torch.randn(B, H, Dv, D, generator=g, dtype=torch.float64) if with_state else None
    return [None if x is None else x.to(dtype).requires_grad_() for x in (q, k, v, beta, a, W0)]


def plain_multiplier_steps(rule, q, k, v, beta, a, W0):
    """The rule's own steps on a FunctionalMemory, the decay a plain multiplier: the oracle (as the op
    properties' plain_multiplier_steps)."""
    memory = FunctionalMemory(q.new_zeros(B, H, Dv, D) if W0 is None else W0)
    at = lambda x, t: None if x is None else x[:, :, t]  # noqa: E731
    outs = [run_step(update_rule(rule), memory, q[:, :, t], k[:, :, t], v[:, :, t], at(beta, t), a[:, :, t])
            for t in range(T)]
    return torch.stack(outs, 2), memory.fast_weight


def results(run, inputs, final_state_only):
    """{"out", "state", "d<name>"}: the outputs and fresh gradients of a random loss on them."""
    out, W = run(*inputs)
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(y.shape, generator=g, dtype=torch.float64) for y in (out, W)]
    loss = (W.double() * weights[1]).sum() + (0 if final_state_only else (out.double() * weights[0]).sum())
    names = [n for n, x in zip(("dq", "dk", "dv", "dbeta", "ddecay", "dstate"), inputs) if x is not None]
    grads = torch.autograd.grad(loss, [x for x in inputs if x is not None], allow_unused=True)
    grads = [torch.zeros_like(x) if d is None else d for x, d in zip([x for x in inputs if x is not None], grads)]
    return {"out": out.detach(), "state": W.detach(), **dict(zip(names, grads))}


def op(rule, final_state_only):
    if final_state_only:  # only the final state is read: no outputs' gradient
        return lambda q, k, v, beta, a, W0: (q, fast_weight_state(rule, k, v, beta, W0, decay=a, backend="chunked"))
    return lambda q, k, v, beta, a, W0: fast_weight(rule, q, k, v, beta, W0, decay=a, backend="chunked")


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("final_state_only", [False, True])
def test_small_decays_get_the_gradients_of_a_plain_multiplier(rule, dtype, with_state, final_state_only):
    inputs = make(rule, dtype, with_state)
    got = results(op(rule, final_state_only), inputs, final_state_only)
    wide = [None if x is None else x.detach().double().requires_grad_() for x in inputs]
    want = results(lambda *x: (lambda out, W: (x[0] if final_state_only else out, W))(
        *plain_multiplier_steps(rule, *x)), wide, final_state_only)
    errors = relative_errors(got, want)
    assert max(errors.values()) < (2e-6 if dtype == torch.float32 else 1e-12), errors


@pytest.mark.parametrize("rule", ["gla", "kda"])
def test_a_fast_forgetting_channel_costs_one_more_run_however_long_the_sequence(rule, monkeypatch):
    """One channel below sqrt(eps) at every step of 64: decay= runs the op's kernel on twice the rows that
    log_decay= does (the forward, and one read of the channel's columns), not on a copy per step."""
    rows = []
    kernel = chunked_channels.channel_chunked
    monkeypatch.setattr(chunked_channels, "channel_chunked",
                        lambda q, *args, **kwargs: rows.append(q.shape[0]) or kernel(q, *args, **kwargs))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 4, generator=g) for _ in range(3))
    beta = None if rule == "gla" else torch.rand(1, 2, 64, generator=g)
    log_decay = torch.full((1, 2, 64, 4), -0.1).index_fill(-1, torch.tensor([0]), -12.0)  # a = 6e-6
    runs = {}
    for form, gate in (("log_decay", log_decay), ("decay", log_decay.exp())):
        rows.clear()
        gate.requires_grad_()
        out, W = fast_weight(rule, q, k, v, beta, **{form: gate}, backend="chunked")
        torch.autograd.grad((out.sum() + W.sum()), gate)
        runs[form] = sum(rows)
    assert runs["decay"] <= 2 * runs["log_decay"], runs
