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
  With ``channels=D`` the gate gives one decay per key channel, a_t in
  [0, 1]^D (GLA, KDA, GDN-2), from a low-rank projection of the layer input
  (x -> rank -> H D), as the papers build it: rank 16 for logsigmoid (GLA's
  W_1 W_2), the head size for mamba2 (Kimi Linear's f = W_up W_down x), whose
  dt_bias is then one per channel (A stays one per head).
- ``OutputGate``: out = RMSNorm(out) * SiLU(W_g x) per head (Gated DeltaNet's
  output; the norm's scale is learned per channel).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layouts import project

DECAY_FORMS = ("mamba2", "logsigmoid")


GLA_RANK = 16  # GLA's low-rank decay projection (Yang et al., 2024)


class DecayGate(nn.Module):
    def __init__(self, embed_dim, num_heads, form="mamba2", channels=None):
        """channels: None for one decay per head, or D for one per key channel of each head."""
        super().__init__()
        if form not in DECAY_FORMS:
            raise ValueError(f"decay form must be one of {', '.join(DECAY_FORMS)}; got {form!r}")
        self.form, self.num_heads, self.channels = form, num_heads, channels
        outputs = num_heads * (channels or 1)
        if channels is None:
            self.proj = nn.Linear(embed_dim, outputs, bias=form == "logsigmoid")
        else:  # x -> rank -> H D: the last linear map is the one start_near_one zeroes
            rank = GLA_RANK if form == "logsigmoid" else embed_dim // num_heads
            self.proj = nn.Sequential(nn.Linear(embed_dim, rank, bias=False),
                                      nn.Linear(rank, outputs, bias=form == "logsigmoid"))
        for linear in self._linears():
            nn.init.normal_(linear.weight, std=0.02)
        if form == "mamba2":
            self.A_log = nn.Parameter(torch.empty(num_heads).uniform_(1, 16).log())
            dt = torch.exp(torch.empty(outputs).uniform_(math.log(1e-3), math.log(1e-1)))
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        else:
            nn.init.zeros_(self._linears()[-1].bias)

    def _linears(self):
        return [self.proj] if isinstance(self.proj, nn.Linear) else list(self.proj)

    def forward(self, x):
        """x ``[T, B, C]`` -> log a ``[B, H, T]`` (or ``[B, H, T, D]`` per channel) in [-inf, 0], float32 or
        float64.

        The log goes to the ops as it is: exp of it underflows to 0 in float32 once log a < -104,
        which the ops take as the full forget it is (ops/decay.py).
        """
        z = project(self.proj, x)  # [T, B, H (D)], in x's memory order
        T, B = z.shape[:2]
        z = z.permute(1, 2, 0) if self.channels is None else z.view(T, B, self.num_heads, -1).permute(1, 2, 0, 3)
        return self.log_decay_from_logits(z)

    def log_decay_from_logits(self, z):
        """log a from the projection's output z ``[B, H, T]`` (or ``[B, H, T, D]``)."""
        z = z if z.dtype == torch.float64 else z.float()  # decays are computed in float32
        if self.form == "mamba2":
            A = self.A_log.exp().view(self.num_heads, *((1, 1) if self.channels else (1,)))
            dt_bias = self.dt_bias.view(self.num_heads, 1, -1) if self.channels else self.dt_bias.unsqueeze(-1)
            return -A * F.softplus(z + dt_bias)
        return F.logsigmoid(z) / 16

    @torch.no_grad()
    def start_near_one(self, log_decay=-1e-4):
        """log a_t = log_decay for every input, head and channel (the last projection 0); the gate still
        learns: its gradient to the projections, the bias and A is scaled by softplus' slope, about
        -log_decay, which Adam normalises away."""
        last = self._linears()[-1]
        last.weight.zero_()
        if self.form == "mamba2":  # -A softplus(dt_bias) = log_decay, per head's A
            A = self.A_log.exp().repeat_interleave(self.dt_bias.numel() // self.num_heads)
            dt = -log_decay / A
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        else:  # logsigmoid(b) / 16 = log_decay
            last.bias.fill_(-math.log(math.expm1(-16 * log_decay)))

    def extra_repr(self):
        return f"form={self.form}" + (f", channels={self.channels}" if self.channels else "")


class OutputGate(nn.Module):
    """RMSNorm of every head's output, times SiLU of a gate projection of the layer input."""

    def __init__(self, embed_dim, num_heads, eps=1e-6):
        super().__init__()
        self.num_heads, self.eps = num_heads, eps
        self.gate = nn.Linear(embed_dim, embed_dim)
        self.weight = nn.Parameter(torch.ones(embed_dim // num_heads))

    def forward(self, out, x):
        """out ``[B, H, T, d]`` (the attention's), x ``[T, B, C]`` -> ``[B, H, T, d]``, in out's dtype: the
        mean square is a float32 (float64) reduction of out as it is, and the scale is taken in out's dtype,
        so that no pass makes a float32 copy of out (the output projection reads out's dtype)."""
        wide = torch.float64 if out.dtype == torch.float64 else torch.float32
        mean_square = torch.linalg.vector_norm(out, dim=-1, keepdim=True, dtype=wide).square() / out.shape[-1]
        normed = out * torch.rsqrt(mean_square + self.eps).to(out.dtype)
        T, B, C = x.shape
        gate = F.silu(project(self.gate, x)).view(T, B, self.num_heads, -1).permute(1, 2, 0, 3)
        return normed * self.weight.to(out.dtype) * gate
