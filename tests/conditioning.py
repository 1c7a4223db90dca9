"""How closely float32 can follow float64 where attention normalisation divides (Eqs. 19, 26-28): the smallest
normaliser of an example, read from its float64 forward.

Near disjoint DPFP supports a normaliser z . phi is a small part of |z| |phi|:
- a read (Eqs. 19, 28) divides by z_t . phi(q_t), and one float32 rounding of the features (about u |phi|,
  u = 2^-24) moves it by u / c of itself, c = z . phi / (|z| |phi|) the cosine between the two;
- the delta rule's write (Eqs. 26-28) is differentiated through beta d and phi(k) / (d + eps), with
  d = z_{t-1} . phi(k_t), whose gradients for d cancel to eps / d^2 of their size and leave their rounding,
  about u / d of the write's gradient.
So float32 keeps outputs and gradients to about u / m of the largest, m the smallest such c or d, on every
backend alike: measured up to 0.92 u / m (2e-3 at m = 3e-5) over 101 examples of the property harness and 120
draws of tests/test_attention.py's LM, each on the reference and the chunked backend; the bound is 4 u / m. Zero
normalisers (disjoint supports) do not count: there the output and every gradient through it are exactly 0.
"""
import contextlib
import math
from unittest import mock

from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention
from fairseq_fwp.modules.state import FastWeightState

FLOAT32_UNIT_ROUNDOFF = 2.0 ** -24
MARGIN = 4  # over the largest error measured, 0.92 u / m: another CPU's float32 rounds otherwise


class SmallestNormaliser:
    """m of the normalisers seen (inf while none is)."""

    def __init__(self):
        self.m = math.inf

    def read(self, phi, z):
        """A read's z . phi (Eqs. 19, 28): its cosine."""
        d = (phi * z).sum(-1)
        self._note(d, d / (phi.norm(dim=-1) * z.norm(dim=-1)))

    def write(self, phi_k, z_previous):
        """A write's d_t = z_{t-1} . phi(k_t) (Eq. 27): its cosine and itself."""
        d = (phi_k * z_previous).sum(-1)
        self._note(d, d / (phi_k.norm(dim=-1) * z_previous.norm(dim=-1)), d)

    def _note(self, d, *measures):
        nonzero = d > 0
        if nonzero.any():
            self.m = min(self.m, *(x[nonzero].min().item() for x in measures))

    def float32_bound(self):
        """4 u / m: how far float32 may stray from float64 near disjoint supports, where this is the largest of
        float32's errors, relative to the largest value (0 without a normaliser)."""
        return MARGIN * FLOAT32_UNIT_ROUNDOFF / self.m

    @contextlib.contextmanager
    def watching(self):
        """Notes the normalisers of the fast-weight layers' full forwards inside the block."""
        normalize_output = FastWeightAttention._normalize_output
        delta_attention_normalization = FastWeightAttention._delta_attention_normalization
        read_sources = FastWeightState.read_sources

        def causal_read(layer, out, q, z):
            self.read(q.detach(), z.detach())
            return normalize_output(layer, out, q, z)

        def causal_write(layer, k, beta, k_acc, z_prev):
            if z_prev is not None:
                self.write(k_acc.detach(), z_prev.detach())
            return delta_attention_normalization(layer, k, beta, k_acc, z_prev)

        def source_read(state, q, with_normalizer):
            if with_normalizer:  # rows read their source's sums (beam search: several rows per source)
                z = state.key_sum.detach().repeat_interleave(q.shape[0] // state.key_sum.shape[0], 0)
                self.read(q.detach(), z.unsqueeze(2))
            return read_sources(state, q, with_normalizer)

        with mock.patch.object(FastWeightAttention, "_normalize_output", causal_read), \
                mock.patch.object(FastWeightAttention, "_delta_attention_normalization", causal_write), \
                mock.patch.object(FastWeightState, "read_sources", source_read):
            yield
