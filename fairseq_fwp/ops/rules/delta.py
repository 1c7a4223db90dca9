"""The delta rule (the paper's Eqs. 20-25, "DeltaNet") and its gated form (Gated DeltaNet)."""
import torch

from .. import chunked, cuda, fla
from . import UpdateRule, register_update_rule


@register_update_rule("delta")
class DeltaRule(UpdateRule):
    """vbar_t = W_{t-1} k_t (Eq. 20), the value stored under k_t; W_t = W_{t-1} + beta_t (v_t - vbar_t) k_t^T
    (Eq. 24); out_t = W_t q_t (Eq. 25). beta_t in (0, 1) (Eq. 21); stable while beta |k|^2 <= 2, so the
    keys are normalised (Eq. 29)."""

    write_strength = True
    normalised_keys = True
    normalised_retrieval = True
    kernels = {"chunked": chunked.DELTA, "cuda": cuda.DELTA, "fla": fla.DELTA}

    def step(self, memory, q, k, v, beta, decay):
        memory.decay_(decay)
        vbar, read = memory.read(torch.stack([k, q], dim=-2)).unbind(-2)  # one pass: W_{t-1} k, W_{t-1} q
        u = beta.unsqueeze(-1) * (v - vbar)  # the pseudo-value of Eq. 24
        memory.write_(k, u)
        return read + u * (k * q).sum(-1, keepdim=True)  # W_t q = W_{t-1} q + u (k . q)


@register_update_rule("gated-delta")
class GatedDeltaRule(DeltaRule):
    """The delta rule on a decayed memory (Gated DeltaNet, Yang et al., ICLR 2025): vbar_t = a_t W_{t-1} k_t,
    W_t = a_t W_{t-1} + beta_t (v_t - vbar_t) k_t^T."""

    decay = True
    kernels = {"chunked": chunked.GATED_DELTA, "fla": fla.GATED_DELTA}
