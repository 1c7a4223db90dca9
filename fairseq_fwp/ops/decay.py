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
every output is an affine function of each step's decay a_t (a_t only
scales W_{t-1}, or its key channels, before step t writes): with the small
decays of one step set to 1 and everything else kept, the log-domain
gradient there is exactly dL/da_t. One pass of the op can do this for one
step of each row (batch row and head: they never mix), and passes run side
by side as copies of the rows, in one call of the op. Steps where every
channel is small (every small step of a decay per head) are cheaper: two
passes serve them all, every other one of each row at a time, because two
of them in one pass are always separated by one of the other pass, which
cuts any product of both to zero, or below sqrt(eps). A step small in some
channels only cuts nothing where the rule's writes mix channels (KDA,
GDN-2: I - beta k k^T), so each such step of a row gets a pass of its own.
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


def _passes(below):
    """The masks of small decays to set to 1, one pass of the op each: ``below`` is [B, H, T] (a decay per
    head) or [B, H, T, D] (per key channel)."""
    per_channel = below.dim() == 4
    full = below.all(-1) if per_channel else below  # [B, H, T]: steps small in every channel
    partial = below.any(-1) & ~full if per_channel else torch.zeros_like(below)
    rank, partial_rank = full.cumsum(2), partial.cumsum(2)  # each row's steps, counted in time order
    steps = [full & (rank % 2 == 1), full & (rank % 2 == 0)]
    steps += [partial & (partial_rank == n) for n in range(1, int(partial_rank.max()) + 1)]
    return [below & (step.unsqueeze(-1) if per_channel else step) for step in steps if step.any()]


ROWS_PER_CALL = 2**24  # numbers of the largest input: passes run side by side, as copies of the rows, up to this


def _at_one_gradients(run, log_decay, chosen, inputs, grads):
    """The log-domain gradients of K passes at once, the rows repeated K times (they never mix): pass k sets the
    decays of chosen[k] to 1. Returns [K, *log_decay.shape]."""
    K = len(chosen)
    repeated = lambda x: None if x is None else x.detach().repeat(K, *[1] * (x.dim() - 1))  # noqa: E731
    at_one = log_decay.expand(K, *log_decay.shape).masked_fill(chosen, 0.0).flatten(0, 1).requires_grad_()
    outputs = _as_tuple(run(at_one, *map(repeated, inputs)))
    (d_at_one,) = torch.autograd.grad(outputs, at_one, [repeated(g) for g in grads])
    return d_at_one.view(K, *log_decay.shape)


def _merged(d_decay, chosen, d_at_one):
    """d_decay with each pass's gradients where it chose (the passes choose disjoint decays)."""
    return torch.where(chosen.any(0), torch.where(chosen, d_at_one, 0.0).sum(0), d_decay)


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
            passes = _passes(below)
            per_call = max(1, ROWS_PER_CALL // max(x.numel() for x in [decay, *tensors] if x is not None))
            for first in range(0, len(passes), per_call):
                chosen = torch.stack(passes[first:first + per_call])  # [K, B, ...]: K passes as K copies of the rows
                d_at_one = _at_one_gradients(ctx.run, log_decay.detach(), chosen, inputs, grads)
                d_decay = _merged(d_decay, chosen, d_at_one)
        d_inputs = iter(d_inputs)
        return (None, d_decay, *[next(d_inputs) if x is not None and x.requires_grad else None for x in inputs])
