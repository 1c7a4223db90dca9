"""The gated rules' decay a_t, carried as its logarithm, and exact gradients where a_t is (nearly) zero.

Every backend takes ``log_decay`` = log a_t; -inf (a = 0, a full forget) is a
legitimate value that every backend computes exactly. Gates produce the log
directly (modules/gates.py), so nothing is exponentiated only to be taken
back to a log: a gate that underflows float32's exp (log a < -104) still
forgets exactly instead of turning into 0 / 0.

A caller that passes ``decay`` itself gets log a = log(decay), and the
gradient d/da = (d/d log a) / a wherever a is not small. At a = 0 that
quotient is 0 / 0, and for small a it loses most digits (the log-domain
gradient a X comes out of sums of terms of size X, with their rounding
errors), although the true gradient is finite: <dL/d(a W_{t-1}), W_{t-1}>.
Below sqrt(eps) of the dtype it is recovered from the op itself, because
every output is an affine function of each single a_t (a_t only scales
W_{t-1} before step t writes): with a_t set to 1 and everything else kept,
the log-domain gradient at t is exactly dL/da_t. Two more passes of the op
suffice for all small decays, every other one of each row at a time: two
small decays of one pass are always separated by a small one of the other
pass, which cuts any product of both to zero, or below sqrt(eps).
"""
import torch


def small(dtype):
    """Below this a decay's gradient is recovered from the op, not divided out of log a's."""
    return torch.finfo(dtype).eps ** 0.5


def run_with_decay(run, decay, tensors):
    """run(log_decay, *tensors) -> an output or a tuple of outputs, called with log(decay).

    Gradients reach `decay` as the op with the decay as a plain multiplier gives them, zeros
    included. `tensors` may hold None.
    """
    needs_exact = (torch.is_grad_enabled() and decay.requires_grad
                   and bool((decay.detach() < small(decay.dtype)).any()))
    if not needs_exact:
        return run(decay.log(), *tensors)
    return _ExactDecayGradient.apply(run, decay, *tensors)


def _as_tuple(outputs):
    return outputs if isinstance(outputs, tuple) else (outputs,)


class _ExactDecayGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, decay, *tensors):
        ctx.run = run
        ctx.save_for_backward(decay, *tensors)
        with torch.no_grad():
            return run(decay.log(), *tensors)

    @staticmethod
    def backward(ctx, *grad_outputs):
        decay, *tensors = ctx.saved_tensors
        needs = ctx.needs_input_grad[2:]
        below = decay < small(decay.dtype)
        with torch.enable_grad():
            inputs = [None if x is None else x.detach().requires_grad_(need) for x, need in zip(tensors, needs)]
            log_decay = decay.detach().log().requires_grad_()
            outputs = _as_tuple(ctx.run(log_decay, *inputs))
            grads = [torch.zeros_like(y) if g is None else g for y, g in zip(outputs, grad_outputs)]
            wrt = [log_decay] + [x for x in inputs if x is not None and x.requires_grad]
            d_log, *d_inputs = torch.autograd.grad(outputs, wrt, grads, allow_unused=True)
            d_decay = torch.where(below, torch.zeros_like(d_log), d_log / decay.masked_fill(below, 1))
            rank = below.cumsum(2)  # the small decays of each row (and channel), counted in time order
            for parity in (1, 0):
                chosen = below & (rank % 2 == parity)
                if not chosen.any():
                    continue
                at_one = log_decay.detach().masked_fill(chosen, 0.0).requires_grad_()
                (d_at_one,) = torch.autograd.grad(
                    _as_tuple(ctx.run(at_one, *[None if x is None else x.detach() for x in inputs])), at_one, grads)
                d_decay = torch.where(chosen, d_at_one, d_decay)
        d_inputs = iter(d_inputs)
        return (None, d_decay, *[next(d_inputs) if x is not None and x.requires_grad else None for x in inputs])
