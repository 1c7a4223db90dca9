"""Rules with a decay per key channel (a_t in [0, 1]^D, log a_t in [-inf, 0]^D): GLA, Kimi Delta Attention
(KDA) and Gated DeltaNet-2 (GDN-2), and KDA with N writes per token. W is [Dv, D]: Diag(a_t) scales its
columns, one per key channel.

- GLA (Yang et al., 2024): W_t = W_{t-1} Diag(a_t) + v_t k_t^T; the sum rule's step on a decayed memory.
- KDA (Kimi Team, "Kimi Linear", 2025): W_t = W_{t-1} Diag(a_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T;
  the delta rule's step on a decayed memory (vbar_t = W_{t-1} Diag(a_t) k_t).
- GDN-2: W_t = W_{t-1} Diag(a_t) (I - (b_t * k_t) k_t^T) + (w_t * v_t) k_t^T, an erase gate b_t in [0, 1]^D on
  the key axis and a write gate w_t in [0, 1]^Dv on the value axis; b_t = w_t = beta_t is KDA. Its write
  strength is both gates, beta ``[.., D + Dv]``: b_t, then w_t.
"""
import torch

from .. import chunked, chunked_channels, fla
from ..protocol import Kernel
from . import UpdateRule, register_update_rule
from .delta import DeltaProductRule, DeltaRule
from .sum import SumRule


def _kernel(written_and_retrieval):
    """The chunked kernel of a per-channel rule; written_and_retrieval(k, v, beta) -> (r_t or None, w_t)."""
    def sequence(call, q, k, v, beta, state, log_decay):
        retrieval, written = written_and_retrieval(k, v, beta)
        return chunked_channels.channel_chunked(q, k, v, log_decay, state, retrieval, written)

    def final_state(call, k, v, beta, state, log_decay):
        return sequence(call, k, k, v, beta, state, log_decay)[1]  # the outputs are computed and dropped

    return Kernel(sequence, final_state)


GLA_CHUNKED = _kernel(lambda k, v, beta: (None, None))
KDA_CHUNKED = _kernel(lambda k, v, beta: (beta.unsqueeze(-1) * k, beta.unsqueeze(-1) * v))
GDN2_CHUNKED = _kernel(lambda k, v, beta: (beta[..., :k.shape[-1]] * k, beta[..., k.shape[-1]:] * v))


@register_update_rule("gla")
class GLARule(SumRule):
    """W_t = W_{t-1} Diag(a_t) + v_t k_t^T; out_t = W_t q_t (the sum rule's step, Eqs. 17, 11)."""

    decay = "channels"
    decay_form = "logsigmoid"  # log a_t = logsigmoid(W_2 W_1 x_t + b) / 16
    write_form = "sum"
    kernels = {"chunked": GLA_CHUNKED, "fla": fla.GLA}


@register_update_rule("kda")
class KDARule(DeltaRule):
    """vbar_t = W_{t-1} Diag(a_t) k_t, W_t = W_{t-1} Diag(a_t) + beta_t (v_t - vbar_t) k_t^T (the delta rule's
    step, Eqs. 20, 24, 25, on a memory decayed per key channel)."""

    decay = "channels"
    product = "kda-product"
    write_form = "delta"
    kernels = {"chunked": KDA_CHUNKED, "fla": fla.KDA}


@register_update_rule("kda-product")
class KDAProductRule(DeltaProductRule):
    """KDA with N writes per token (DeltaProduct's form): the decay once per token, before its first write."""

    decay = "channels"
    write_form = "delta"
    kernels = {"chunked": chunked.product(KDA_CHUNKED)}


@register_update_rule("gdn2")
class GDN2Rule(UpdateRule):
    """W'_t = W_{t-1} Diag(a_t); W_t = W'_t + (w_t * v_t - W'_t (b_t * k_t)) k_t^T; out_t = W_t q_t."""

    write_strength = "channels"
    decay = "channels"
    normalised_keys = True
    householder = True  # the transition I - (b_t * k_t) k_t^T: its eigenvalue 1 - k_t . (b_t * k_t)
    kernels = {"chunked": GDN2_CHUNKED, "fla": fla.GDN2}

    def step(self, memory, q, k, v, beta, decay):
        erase, write = beta[..., :k.shape[-1]], beta[..., k.shape[-1]:]
        memory.decay_(decay)
        vbar, read = memory.read(torch.stack([erase * k, q], dim=-2)).unbind(-2)  # W'_t (b_t * k_t), W'_t q_t
        u = write * v - vbar
        memory.write_(k, u)
        return read + u * (k * q).sum(-1, keepdim=True)  # W_t q = W'_t q + u (k . q)
