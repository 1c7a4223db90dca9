"""Random inputs for the fast-weight op tests."""
import torch
import torch.nn.functional as F


def make_inputs(B, H, T, D, Dv, dtype=torch.float64, with_state=True, seed=0):
    """q, k, v, beta, W0 with requires_grad; keys are unit-norm so the delta rule is stable."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = F.normalize(torch.randn(B, H, T, D, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=g, dtype=dtype)
    beta = torch.rand(B, H, T, generator=g, dtype=dtype)
    W0 = torch.randn(B, H, Dv, D, generator=g, dtype=dtype) if with_state else None
    return [x.requires_grad_() if x is not None else None for x in (q, k, v, beta, W0)]


def run_op(rule, inputs, backend):
    """backend: a backend name, or a callable (q, k, v, beta, W0) -> (out, W)."""
    from fairseq_fwp.ops import fast_weight_delta, fast_weight_sum

    q, k, v, beta, W0 = inputs
    if callable(backend):
        return backend(q, k, v, beta, W0)
    if rule == "sum":
        return fast_weight_sum(q, k, v, W0, backend=backend)
    return fast_weight_delta(q, k, v, beta, W0, backend=backend)


def outputs_and_grads(rule, inputs, backend, seed=1):
    """Output, final state and fresh gradients of a random loss on both (to the inputs that need them)."""
    out, W = run_op(rule, inputs, backend)
    g = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)
    w_state = torch.randn(W.shape, generator=g, dtype=W.dtype).to(W.device)
    loss = (out * w_out).sum() + (W * w_state).sum()
    wrt = [x for x in inputs if x is not None and x.requires_grad and (rule == "delta" or x is not inputs[3])]
    grads = torch.autograd.grad(loss, wrt)
    return [out.detach(), W.detach()] + list(grads)


def make_decay(B, H, T, dtype=torch.float64, low=0.5, seed=3):
    """Decays a_t in (low, 1), with requires_grad."""
    g = torch.Generator().manual_seed(seed)
    return (low + (1 - low) * torch.rand(B, H, T, generator=g, dtype=dtype)).requires_grad_()


def gated_outputs_and_grads(rule, inputs, decay, backend, seed=1):
    """outputs_and_grads for the gated rules: the decay's gradient comes last."""
    from fairseq_fwp.ops import fast_weight_delta, fast_weight_sum

    q, k, v, beta, W0 = inputs
    if rule == "sum":
        out, W = fast_weight_sum(q, k, v, W0, decay=decay, backend=backend)
    else:
        out, W = fast_weight_delta(q, k, v, beta, W0, decay=decay, backend=backend)
    g = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)
    w_state = torch.randn(W.shape, generator=g, dtype=W.dtype).to(W.device)
    wrt = [x for x in inputs if x is not None and x.requires_grad and (rule == "delta" or x is not inputs[3])]
    grads = torch.autograd.grad((out * w_out).sum() + (W * w_state).sum(), wrt + [decay])
    return [out.detach(), W.detach()] + list(grads)
