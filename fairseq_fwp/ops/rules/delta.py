"""The delta rule (the paper's Eqs. 20-25, "DeltaNet"), its gated form (Gated DeltaNet), and both with N
writes per token (DeltaProduct)."""
import torch

from .. import chunked, cuda, fla
from . import UpdateRule, register_update_rule


def delta_writes(memory, q, k, v, beta, decay):
    """N delta-rule writes of one token in order, k ``[rows, H, N, D]``, v ``[rows, H, N, Dv]``, beta
    ``[rows, H, N]``, after the decay, then the read of the result by q.

    The memory is read once, for every key and the query (W_{t-1} [k_1 .. k_N | q]); what the earlier
    writes of the token changed follows from their keys: sub-step i retrieves W_{i-1} k_i = W_{t-1} k_i +
    sum_{j<i} u_j (k_j . k_i) (Eq. 20), writes u_i = beta_i (v_i - W_{i-1} k_i) (Eq. 24), and the query
    reads W_t q = W_{t-1} q + sum_j u_j (k_j . q) (Eq. 25)."""
    memory.decay_(decay)
    reads = memory.read(torch.cat([k, q.unsqueeze(-2)], dim=-2))
    out, writes = reads[..., -1, :], []
    for i in range(k.shape[-2]):
        vbar = reads[..., i, :]
        for j, u in enumerate(writes):
            vbar = vbar + u * (k[..., j, :] * k[..., i, :]).sum(-1, keepdim=True)
        u = beta[..., i].unsqueeze(-1) * (v[..., i, :] - vbar)
        memory.write_(k[..., i, :], u)
        writes.append(u)
        out = out + u * (k[..., i, :] * q).sum(-1, keepdim=True)
    return out


@register_update_rule("delta")
class DeltaRule(UpdateRule):
    """vbar_t = W_{t-1} k_t (Eq. 20), the value stored under k_t; W_t = W_{t-1} + beta_t (v_t - vbar_t) k_t^T
    (Eq. 24); out_t = W_t q_t (Eq. 25). beta_t in (0, 1) (Eq. 21); stable while beta |k|^2 <= 2, so the
    keys are normalised (Eq. 29)."""

    write_strength = True
    normalised_keys = True
    normalised_retrieval = True
    householder = True
    product = "delta-product"
    kernels = {"chunked": chunked.DELTA, "cuda": cuda.DELTA, "fla": fla.DELTA}

    def step(self, memory, q, k, v, beta, decay):
        return delta_writes(memory, q, k.unsqueeze(-2), v.unsqueeze(-2), beta.unsqueeze(-1), decay)


@register_update_rule("gated-delta")
class GatedDeltaRule(DeltaRule):
    """The delta rule on a decayed memory (Gated DeltaNet, Yang et al., ICLR 2025): vbar_t = a_t W_{t-1} k_t,
    W_t = a_t W_{t-1} + beta_t (v_t - vbar_t) k_t^T."""

    decay = True
    product = "gated-delta-product"
    kernels = {"chunked": chunked.GATED_DELTA, "fla": fla.GATED_DELTA}


@register_update_rule("delta-product")
class DeltaProductRule(DeltaRule):
    """DeltaProduct (Siems et al., 2025): N delta-rule writes per token, each with its own key, value and
    write strength, in order; the query reads after the last. Each token's transition is a product of N
    generalised Householder matrices: with beta in (0, 2) (--fwp-negative-eigenvalues) one layer tracks the
    state of non-commutative groups such as S3. Chunked: the delta rule over a sequence N times as long."""

    substeps = True
    normalised_retrieval = False  # the paper's normalisation (Eqs. 26-28) is for one key per token
    product = None
    kernels = {"chunked": chunked.product(chunked.DELTA), "fla": fla.DELTA_PRODUCT}

    def step(self, memory, q, k, v, beta, decay):
        return delta_writes(memory, q, k, v, beta, decay)


@register_update_rule("gated-delta-product")
class GatedDeltaProductRule(DeltaProductRule):
    """DeltaProduct on a decayed memory: the decay once per token, before its first write."""

    decay = True
    kernels = {"chunked": chunked.product(chunked.GATED_DELTA), "fla": fla.GATED_DELTA_PRODUCT}
