"""Batch-first memory under fairseq's time-first shapes.

fairseq hands an attention layer ``[T, B, C]``; fla's kernels read ``[B, T, H, D]``, contiguous. The causal
layer keeps fairseq's shapes (``[T, B, C]``, and ``[B, H, T, D]`` for heads) but holds them in batch-first
memory: ``to_batch_first`` lays its input out once, in the dtype its projections compute in, and every
projection (``project``) and elementwise op after it keeps that order. Per-head views of a projection are
then fla's layout as they lie (fla.py's transposes are views; fla copies nothing), and the output
projection reads fla's output in place. The one copy back to time-first memory is in the backward pass,
where the output projection's GEMM reads the gradient fairseq gives.

The fused glue (this layout, project_all's shared input, the feature maps' fused normalisations) computes what
its composition computes: the modules called one by one on ``[T, B, C]``, each feature map's own forward, then
normalize_features. That composition runs instead where the fused forms would hide something (``fused()``): a
hook that could see a projection (its own, or a global module hook) sees its call, on fairseq's ``[T, B, C]``;
forward-mode AD and torch.func's transforms, which the fused autograd Functions define no rules for; and inside
``unfused()``, the reference the tests compare the layer with. The fused Functions are differentiable twice
(a gradient penalty, meta-learning).
"""
import contextlib
import contextvars

import torch
from torch.nn.modules import module as torch_modules

from ..ops.protocol import transformed

_UNFUSED = contextvars.ContextVar("fairseq_fwp_unfused", default=False)


@contextlib.contextmanager
def unfused():
    """Within it the layers run the composition of their parts, not the fused glue (the glue's reference)."""
    token = _UNFUSED.set(True)
    try:
        yield
    finally:
        _UNFUSED.reset(token)


def fused():
    """Whether the fused glue may run: not inside unfused(), and no forward-mode AD or torch.func transform."""
    return not (_UNFUSED.get() or transformed())


def observed(module):
    """Whether a hook could see a call of `module` (or of a module inside it): its own forward or backward hooks,
    or a global module hook."""
    if (torch_modules._global_forward_hooks or torch_modules._global_forward_pre_hooks
            or torch_modules._global_backward_hooks or torch_modules._global_backward_pre_hooks):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for m in module.modules())


def compute_dtype(x):
    """The dtype x's projections compute in: autocast's where it is on (float64 opts out), else x's."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type) and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def to_batch_first(x):
    """x ``[T, B, C]`` in batch-first memory and in compute_dtype(x), in one pass (autocast would cast it once
    per projection); its gradient comes back time-first and contiguous, as fairseq's layer norm reads it. As it
    is where the fused glue does not run (fused())."""
    dtype = compute_dtype(x)
    if not fused() or (x.dtype == dtype and x.transpose(0, 1).is_contiguous()):
        return x
    return _ToBatchFirst.apply(x, dtype)


class _ToBatchFirst(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = x.dtype
        T, B, C = x.shape
        return torch.empty((B, T, C), dtype=dtype, device=x.device).copy_(x.transpose(0, 1)).transpose(0, 1)

    @staticmethod
    def backward(ctx, grad):  # a copy in the input's dtype: differentiable again
        return torch.empty(grad.shape, dtype=ctx.dtype, device=grad.device).copy_(grad), None


def project(linear, x):
    """linear(x) for x ``[T, B, C]`` in either memory order, in that order: the GEMM reads x as it lies (a
    time-first GEMM on batch-first memory would copy it first, and add the bias in a pass of its own). A call
    that a hook could see, or outside the fused glue, is linear(x) on fairseq's [T, B, C] as it is."""
    if x.is_contiguous() or not fused() or observed(linear):
        return linear(x)
    return linear(x.transpose(0, 1)).transpose(0, 1)


def project_all(linears, x):
    """[project(linear, x) for linear in linears] for nn.Linear maps reading one input x ``[T, B, C]``, whose
    input gradients the backward pass sums inside the GEMMs (each accumulates into the sum so far) instead
    of in a pass per extra linear, as autograd would. Under autocast, computed as F.linear computes it.
    Without gradients, for a module that is not a plain nn.Linear, where a hook could see one, or outside the
    fused glue: the linears one by one."""
    if not torch.is_grad_enabled() or not fused() or any(type(linear) is not torch.nn.Linear or observed(linear)
                                                         for linear in linears):
        return [project(linear, x) for linear in linears]
    parameters = [p for linear in linears for p in (linear.weight, linear.bias)]
    return list(_SharedInput.apply(x, *parameters))


def _rows(x, batch_first):
    """x ``[T, B, n]`` as the matrix of its T B rows in batch-first (or time-first) order: a view where x lies
    in that order."""
    return (x.transpose(0, 1) if batch_first else x).reshape(-1, x.shape[-1])


def _unrows(y, batch_first, T, B):
    n = y.shape[-1]  # given, not -1: a batch of no tokens has no size to infer
    return y.view(B, T, n).transpose(0, 1) if batch_first else y.view(T, B, n)


class _SharedInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *parameters):
        T, B = x.shape[:2]
        batch_first = not x.is_contiguous() and x.transpose(0, 1).is_contiguous()
        dtype = compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            rows = _rows(x, batch_first).to(dtype)
            weights = [w.to(dtype) for w in parameters[0::2]]
            outs = [torch.nn.functional.linear(rows, w, None if b is None else b.to(dtype))
                    for w, b in zip(weights, parameters[1::2])]
        ctx.save_for_backward(rows, *weights, x, *parameters)
        ctx.layout, ctx.x_dtype, ctx.compute_dtype = (batch_first, T, B), x.dtype, dtype
        ctx.dtypes = [None if p is None else p.dtype for p in parameters]
        return tuple(_unrows(y, *ctx.layout) for y in outs)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():  # create_graph: through the composition, differentiable again
            return _SharedInput._differentiable_backward(ctx, grads)
        saved = ctx.saved_tensors
        rows, weights = saved[0], saved[1:1 + len(grads)]
        needs = ctx.needs_input_grad
        batch_first = ctx.layout[0]
        grad_rows, grad_parameters = None, []
        with torch.autocast(rows.device.type, enabled=False):
            for i, (g, w) in enumerate(zip(grads, weights)):
                needs_weight, needs_bias = needs[1 + 2 * i], needs[2 + 2 * i]
                if g is None:
                    grad_parameters += [None, None]
                    continue
                g = _rows(g, batch_first).to(w.dtype)
                if needs[0]:
                    grad_rows = g @ w if grad_rows is None else grad_rows.addmm_(g, w)
                grad_parameters.append((g.t() @ rows).to(ctx.dtypes[2 * i]) if needs_weight else None)
                grad_parameters.append(g.sum(0).to(ctx.dtypes[2 * i + 1]) if needs_bias else None)
        grad_x = None if grad_rows is None else _unrows(grad_rows, *ctx.layout).to(ctx.x_dtype)
        return (grad_x, *grad_parameters)

    @staticmethod
    def _differentiable_backward(ctx, grads):
        """The gradients as autograd gives them through the linears' composition on the saved inputs."""
        inputs = ctx.saved_tensors[1 + len(grads):]
        dtype = ctx.compute_dtype
        with torch.autocast(inputs[0].device.type, enabled=False):
            outs = [torch.nn.functional.linear(inputs[0].to(dtype), w.to(dtype), None if b is None else b.to(dtype))
                    for w, b in zip(inputs[1::2], inputs[2::2])]
        wanted = [i for i, (t, needed) in enumerate(zip(inputs, ctx.needs_input_grad)) if needed and t is not None]
        given = [(y, g) for y, g in zip(outs, grads) if g is not None]
        found = torch.autograd.grad([y for y, _ in given], [inputs[i] for i in wanted], [g for _, g in given],
                                    create_graph=True, allow_unused=True)
        result = [None] * len(inputs)
        for i, gradient in zip(wanted, found):
            result[i] = gradient
        return tuple(result)
