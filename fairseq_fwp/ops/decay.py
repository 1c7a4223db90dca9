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
Below sqrt(eps) of the dtype it is recovered another way, in a number of
passes of the op that does not grow with the number of small steps where
the rule allows it:

- A step small in every channel (every small step of a decay per head):
  every output is an affine function of each step's decay a_t (a_t only
  scales W_{t-1}, or its key channels, before step t writes), so with the
  small decays of one step set to 1 and everything else kept, the
  log-domain gradient there is exactly dL/da_t. Two passes serve all such
  steps, every other one of each row at a time, because two of them in one
  pass are always separated by one of the other pass, which cuts any
  product of both to zero, or below sqrt(eps). Passes run side by side as
  copies of the rows (batch row and head: they never mix), in one call of
  the op.
- A step small in some channels only cuts nothing where the rule's writes
  mix channels (KDA: I - beta k k^T), so the same trick would need a pass
  per such step. For a rule that declares its write form
  (UpdateRule.write_form) those decays come from the histories of the
  columns they scale instead (decay_columns.py): one read of the op per
  channel that has them, and one gated sum backwards over it. A rule that
  declares none gets a pass per such step.
"""
import torch

from .decay_columns import column_gradients


def small(dtype):
    """Below this a decay's gradient is recovered from the op, not divided out of log a's."""
    return torch.finfo(dtype).eps ** 0.5


def run_with_decay(run, decay, tensors, columns=None):
    """run(log_decay, *tensors) -> an output or a tuple of outputs, called with log(decay).

    Gradients reach `decay` as the op with the decay as a plain multiplier gives them, zeros included.
    `tensors` are the op's q, k, v, beta and state (beta and state may be None); `columns`
    (decay_columns.ColumnReads, or None) reads the columns of a rule that declares its write form.
    """
    needs_exact = (torch.is_grad_enabled() and decay.requires_grad
                   and bool((decay.detach() < small(decay.dtype)).any()))
    if not needs_exact:
        return run(decay.log(), *tensors)
    return _ExactDecayGradient.apply(run, columns, decay, *tensors)


def _as_tuple(outputs):
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _partial_steps(below):
    """The small decays of steps small in some key channels only: none for a decay per head."""
    return below & ~below.all(-1, keepdim=True) if below.dim() == 4 else torch.zeros_like(below)


def _passes(below, each_partial_step):
    """The masks of small decays to set to 1, one pass of the op each: ``below`` is [B, H, T] (a decay per
    head) or [B, H, T, D] (per key channel). Steps small in every channel take two passes; with
    `each_partial_step`, each step small in some channels only takes one of its own."""
    per_channel = below.dim() == 4
    full = below.all(-1) if per_channel else below  # [B, H, T]: steps small in every channel
    rank = full.cumsum(2)  # each row's steps, counted in time order
    steps = [full & (rank % 2 == 1), full & (rank % 2 == 0)]
    if per_channel and each_partial_step:
        partial = below.any(-1) & ~full
        partial_rank = partial.cumsum(2)
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


VALUES = 2  # where v is in the op's tensors: the column histories need its gradient


class _ExactDecayGradient(torch.autograd.Function):
    """The op run on log(decay) with autograd, whose graph backward differentiates once, then the small decays'
    gradients as above."""

    @staticmethod
    def forward(ctx, run, columns, decay, *tensors):
        ctx.run, ctx.columns = run, columns
        ctx.below = decay < small(decay.dtype)
        ctx.by_columns = _partial_steps(ctx.below) if columns is not None else torch.zeros_like(ctx.below)
        needs = ctx.needs_input_grad[3:]
        wants = [need or (i == VALUES and bool(ctx.by_columns.any())) for i, need in enumerate(needs)]
        ctx.save_for_backward(decay, *tensors)
        with torch.enable_grad():  # the log-domain run's graph, which backward differentiates
            ctx.inputs = [None if x is None else x.detach().requires_grad_(want) for x, want in zip(tensors, wants)]
            ctx.log_decay = decay.detach().log().requires_grad_()
            ctx.outputs = _as_tuple(run(ctx.log_decay, *ctx.inputs))
        outputs = tuple(y.detach() for y in ctx.outputs)
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx, *grad_outputs):
        decay, *tensors = ctx.saved_tensors
        needs, below, by_columns, inputs = ctx.needs_input_grad[3:], ctx.below, ctx.by_columns, ctx.inputs
        grads = [torch.zeros_like(y) if g is None else g for y, g in zip(ctx.outputs, grad_outputs)]
        wrt = [i for i, x in enumerate(inputs) if x is not None and x.requires_grad]
        d_log, *d_wrt = torch.autograd.grad(ctx.outputs, [ctx.log_decay] + [inputs[i] for i in wrt], grads,
                                            allow_unused=True, retain_graph=True)  # as often as the caller's graph
        d_inputs = dict(zip(wrt, d_wrt))
        d_decay = torch.where(below, torch.zeros_like(d_log), d_log / decay.masked_fill(below, 1))
        passes = _passes(below, each_partial_step=ctx.columns is None)
        per_call = max(1, ROWS_PER_CALL // max(x.numel() for x in [decay, *tensors] if x is not None))
        with torch.enable_grad():
            for first in range(0, len(passes), per_call):
                chosen = torch.stack(passes[first:first + per_call])  # [K, B, ...]: K passes as K copies of the rows
                d_at_one = _at_one_gradients(ctx.run, ctx.log_decay.detach(), chosen, inputs, grads)
                d_decay = _merged(d_decay, chosen, d_at_one)
        if by_columns.any():
            d_out, d_final = grads if len(grads) == 2 else (None, *grads)  # (out, W), or W alone
            d_columns = column_gradients(ctx.columns, ctx.log_decay.detach(), by_columns, tensors, d_out, d_final,
                                         d_inputs[VALUES], per_call)
            d_decay = torch.where(by_columns, d_columns, d_decay)
        return (None, None, d_decay, *[d_inputs.get(i) if need else None for i, need in enumerate(needs)])
