"""Another float32 rounding of what a backend computes: the causal layers' fast-weight ops (the source memories of
non-causal layers are the same on every backend). Backends round differently, and where attention normalisation
divides by a small z . phi (tests/conditioning.py) the model amplifies that difference: the same example's float32
gradients moved from 1.2e-4 to 1.9e-3 of the largest with the chunked form's chunk size alone, the reference at
8.5e-4. Draws of the reference rounded once more say how far a backend's own rounding may take an example."""
import contextlib
from unittest import mock

import torch

from fairseq_fwp.modules import fast_weight_attention


def _moved(x, generator):
    """x plus a float32 sum's rounding of each row: u times the row's largest magnitude, times a standard normal."""
    u = torch.finfo(x.dtype).eps / 2
    noise = torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device)
    return x + u * x.abs().amax(-1, keepdim=True) * noise


class _RoundedAgain(torch.autograd.Function):
    """The op's outputs rounded once more, and so are the gradients that reach them."""

    @staticmethod
    def forward(ctx, x, generator):
        ctx.generator = generator
        return _moved(x, generator)

    @staticmethod
    def backward(ctx, grad):
        return _moved(grad, ctx.generator), None


@contextlib.contextmanager
def rounded_again(draw):
    """Inside the block the fast-weight layers' ops are rounded once more, with the draw's seed."""
    generator = torch.Generator().manual_seed(draw)
    op = fast_weight_attention.fast_weight

    def rounded(*args, **kwargs):
        out, W = op(*args, **kwargs)
        return _RoundedAgain.apply(out, generator), W

    with mock.patch.object(fast_weight_attention, "fast_weight", rounded):
        yield
