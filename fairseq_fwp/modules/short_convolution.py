"""A short causal depthwise convolution over time (DeltaNet, Yang et al. 2024; Mamba).

Applied to the q, k and v projections of a causal fast-weight layer, each
output position mixes the last K inputs of its own channel. Its state is the
last K - 1 inputs ``[B, C, K - 1]``: incremental decoding and carried segments
continue from it, so a sequence cut into pieces gives what it gives whole.
Padded positions enter as zeros: at the start of a sequence, where fairseq
puts left padding, that is the same as no input. The state keeps the last
K - 1 inputs that are not padding, so a padded decoding step (a row that
reads nothing while others read their next token) leaves it as it was.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class ShortConvolution(nn.Module):
    def __init__(self, channels, kernel_size):
        super().__init__()
        if kernel_size < 2:
            raise ValueError(f"the short convolution needs a kernel size >= 2, got {kernel_size}")
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels))
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)  # as nn.Conv1d

    def forward(self, x, cache=None, keep=None):
        """x ``[T, B, C]`` (padded positions already zero); cache ``[B, C, K - 1]`` or None (zeros); keep
        ``[T, B]``: the positions that are not padding, or None for all.

        Returns (y ``[T, B, C]``, the new cache: the last K - 1 inputs that are not padding).
        """
        T, B, C = x.shape
        history = x.new_zeros(B, C, self.kernel_size - 1) if cache is None else cache.to(x.dtype)
        inputs = torch.cat([history, x.permute(1, 2, 0)], dim=2)  # [B, C, K - 1 + T]
        y = F.conv1d(inputs, self.weight.to(x.dtype), self.bias.to(x.dtype), groups=C)
        if keep is None or bool(keep.all()):
            return y.permute(2, 0, 1), inputs[:, :, -(self.kernel_size - 1):]
        kept = torch.cat([keep.new_ones(B, self.kernel_size - 1), keep.t()], 1)  # [B, K - 1 + T]
        column = torch.arange(kept.shape[1], device=x.device).expand_as(kept)
        last = torch.where(kept, column, -1).topk(self.kernel_size - 1, dim=1).values.flip(1)  # in order
        return y.permute(2, 0, 1), inputs.gather(2, last.unsqueeze(1).expand(B, C, -1))

    @torch.no_grad()
    def start_as_identity(self):
        """y_t = x_t: weight 1 on the current step, 0 on the earlier ones, no bias."""
        self.weight.zero_()
        self.weight[:, 0, -1] = 1
        self.bias.zero_()

    def extra_repr(self):
        return f"channels={self.weight.shape[0]}, kernel_size={self.kernel_size}"
