"""Gates of the modern fast-weight layers: the decay of the gated rules and the output gate.

- ``DecayGate``: a_t in [0, 1], one per head and position, from the layer
  input (Gated DeltaNet, Yang et al., ICLR 2025), handed to the ops as
  log a_t. Two forms:
  - ``mamba2``: log a_t = -exp(A_log) softplus(w . x_t + dt_bias), with
    A in [1, 16) and softplus(dt_bias) in [1e-3, 1e-1) drawn per head at
    initialisation (Mamba-2's parametrisation, which Gated DeltaNet uses):
    a range of memory lengths from the start. Measured at initialisation
    (8,000 heads of width 512, random inputs): median a_t 0.93, and 43% of
    heads average below 0.9;
  - ``logsigmoid``: log a_t = logsigmoid(w . x_t + b) / 16 (GLA's gate with
    its normaliser 16): a_t starts at 0.96 (0.87 to 0.99 over random inputs).
  ``start_near_one()`` sets a_t = exp(-1e-4) for every input instead (all
  heads, both forms): uptraining converts a softmax model into one whose
  gates start as good as absent.
- ``OutputGate``: out = RMSNorm(out) * SiLU(W_g x) per head (Gated DeltaNet's
  output; the norm's scale is learned per channel).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

DECAY_FORMS = ("mamba2", "logsigmoid")


class DecayGate(nn.Module):
    def __init__(self, embed_dim, num_heads, form="mamba2"):
        super().__init__()
        if form not in DECAY_FORMS:
            raise ValueError(f"decay form must be one of {', '.join(DECAY_FORMS)}; got {form!r}")
        self.form = form
        self.proj = nn.Linear(embed_dim, num_heads, bias=form == "logsigmoid")
        nn.init.normal_(self.proj.weight, std=0.02)
        if form == "mamba2":
            self.A_log = nn.Parameter(torch.empty(num_heads).uniform_(1, 16).log())
            dt = torch.exp(torch.empty(num_heads).uniform_(math.log(1e-3), math.log(1e-1)))
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        else:
            nn.init.zeros_(self.proj.bias)

    def forward(self, x):
        """x ``[T, B, C]`` -> log a ``[B, H, T]`` in [-inf, 0] (float32 or float64).

        The log goes to the ops as it is: exp of it underflows to 0 in float32 once log a < -104,
        which the ops take as the full forget it is (ops/decay.py).
        """
        return self.log_decay_from_logits(self.proj(x).permute(1, 2, 0))

    def log_decay_from_logits(self, z):
        """log a from the projection's output z ``[B, H, T]``."""
        z = z if z.dtype == torch.float64 else z.float()  # decays are computed in float32
        if self.form == "mamba2":
            return -self.A_log.exp().unsqueeze(-1) * F.softplus(z + self.dt_bias.unsqueeze(-1))
        return F.logsigmoid(z) / 16

    @torch.no_grad()
    def start_near_one(self, log_decay=-1e-4):
        """log a_t = log_decay for every input and head (w = 0); the gate still learns: its gradient to w,
        the bias and A is scaled by softplus' slope, about -log_decay, which Adam normalises away."""
        self.proj.weight.zero_()
        if self.form == "mamba2":  # -A softplus(dt_bias) = log_decay, per head's A
            dt = -log_decay / self.A_log.exp()
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        else:  # logsigmoid(b) / 16 = log_decay
            self.proj.bias.fill_(-math.log(math.expm1(-16 * log_decay)))

    def extra_repr(self):
        return f"form={self.form}"


class OutputGate(nn.Module):
    """RMSNorm of every head's output, times SiLU of a gate projection of the layer input."""

    def __init__(self, embed_dim, num_heads, eps=1e-6):
        super().__init__()
        self.num_heads, self.eps = num_heads, eps
        self.gate = nn.Linear(embed_dim, embed_dim)
        self.weight = nn.Parameter(torch.ones(embed_dim // num_heads))

    def forward(self, out, x):
        """out ``[B, H, T, d]`` (the attention's), x ``[T, B, C]`` -> ``[B, H, T, d]``."""
        normed = out * torch.rsqrt(out.float().pow(2).mean(-1, keepdim=True) + self.eps).to(out.dtype)
        T, B, C = x.shape
        gate = F.silu(self.gate(x)).view(T, B, self.num_heads, -1).permute(1, 2, 0, 3)
        return normed * self.weight * gate
