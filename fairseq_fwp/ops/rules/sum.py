"""The sum rule (the paper's Eq. 17; the linear Transformer) and its gated form (a decay a_t per head)."""
from .. import chunked, cuda, fla
from . import UpdateRule, register_update_rule


@register_update_rule("sum")
class SumRule(UpdateRule):
    """W_t = W_{t-1} + v_t k_t^T (Eq. 17); out_t = W_t q_t (Eq. 11)."""

    kernels = {"chunked": chunked.SUM, "cuda": cuda.SUM, "fla": fla.SUM}

    def step(self, memory, q, k, v, beta, decay):
        memory.decay_(decay)
        read = memory.read(q.unsqueeze(-2)).squeeze(-2)  # W_{t-1} q
        memory.write_(k, v)
        return read + v * (k * q).sum(-1, keepdim=True)  # W_t q = W_{t-1} q + v (k . q)


@register_update_rule("gated-sum")
class GatedSumRule(SumRule):
    """W_t = a_t W_{t-1} + v_t k_t^T: a decay a_t in [0, 1] per head from the layer input (the sum rule of
    Gated DeltaNet's family; RetNet's and Mamba-2's forms of linear attention)."""

    decay = True
    kernels = {"chunked": chunked.GATED_SUM, "fla": fla.GATED_SUM}
