"""Random calls of the ops (fairseq_fwp.ops), drawn from the registries: every registered update rule, with
random sizes (T = 0, 1, odd, past two chunks), dtypes, initial states, write strengths and gates, the decays
drawn on a log scale down to full forgets, per head or per key channel as the rule takes them, given as
``decay=`` or as ``log_decay=``.

A case is a few drawn numbers (a seed among them); its tensors are made from them with torch's generator,
so that hypothesis shrinks the structure (the rule, the sizes, the gate's pattern) and not millions of
floats.
"""
import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from fairseq_fwp.ops import UPDATE_RULES, fla
from fairseq_fwp.ops.backends import kernel_of

# Sequence lengths: none, one, odd, and past two chunks of the chunked form (32 tokens for D <= 32, 64 above).
LENGTHS = (0, 1, 2, 5, 17, 33, 70, 133)
DECAY_FORMS = ("decay", "log_decay")
# How a case's decays are drawn (OpCase.gate): strong ones, full forgets (a = 0), far below float32's range.
FORGETS = ("none", "some zeros", "zeros in a row", "small", "very negative logs", "the lowest float")


@dataclasses.dataclass(frozen=True)
class OpCase:
    rule: str
    B: int
    H: int
    T: int
    D: int
    Dv: int
    N: int  # writes per token (a rule with substeps), else 1
    dtype: torch.dtype
    with_state: bool
    backend: str
    decay_form: Optional[str]  # "decay" or "log_decay" for a gated rule, else None
    forgets: str
    decay_scale: float  # log a = -exp(U(-decay_scale, decay_scale / 2)) before the forgets
    beta_scale: float  # beta in (0, beta_scale): 2 for negative eigenvalues (Householder rules, unit keys)
    seed: int

    @property
    def spec(self):
        return UPDATE_RULES[self.rule]

    def tensors(self, requires_grad=True):
        """{"q", "k", "v", "beta", "state", gate form: the gate}: None where the rule takes no such input."""
        g = torch.Generator().manual_seed(self.seed)
        rule, dtype = self.spec, self.dtype
        writes = (self.N,) if rule.substeps else ()
        randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
        q = randn(self.B, self.H, self.T, self.D)
        k = randn(self.B, self.H, self.T, *writes, self.D)
        k = F.normalize(k, dim=-1) if rule.write_strength else k.sigmoid() / self.D  # stable writes, either rule
        v = randn(self.B, self.H, self.T, *writes, self.Dv)
        beta = None
        if rule.write_strength == "channels":  # erase gates (the first D) up to beta_scale, write gates up to 1
            beta = torch.rand(self.B, self.H, self.T, *writes, self.D + self.Dv, generator=g, dtype=torch.float64)
            beta = torch.cat([self.beta_scale * beta[..., :self.D], beta[..., self.D:]], -1)
        elif rule.write_strength:
            beta = self.beta_scale * torch.rand(self.B, self.H, self.T, *writes, generator=g, dtype=torch.float64)
        state = randn(self.B, self.H, self.Dv, self.D) if self.with_state else None
        tensors = {"q": q, "k": k, "v": v, "beta": beta, "state": state}
        if rule.decay:
            log_a = self.log_decays(g)
            tensors[self.decay_form] = log_a.exp() if self.decay_form == "decay" else log_a
        return {name: None if x is None else self._as_input(x, requires_grad) for name, x in tensors.items()}

    def _as_input(self, x, requires_grad):
        x = x.to(self.dtype)
        return x.requires_grad_() if requires_grad else x

    def log_decays(self, g):
        """log a_t ``[B, H, T]`` (``[B, H, T, D]`` per key channel) with the case's forgets."""
        per = (self.D,) if self.spec.decay == "channels" else ()
        shape = (self.B, self.H, self.T, *per)
        u = torch.rand(*shape, generator=g, dtype=torch.float64)
        log_a = -torch.exp(self.decay_scale * (1.5 * u - 1))  # from -e^-s (a near 1) to -e^(s/2)
        pick = torch.rand(*shape, generator=g, dtype=torch.float64)
        if self.forgets == "some zeros":
            log_a = log_a.masked_fill(pick < 0.15, -float("inf"))
        elif self.forgets == "zeros in a row" and self.T > 4:
            log_a[:, :, self.T // 3: self.T // 3 + 3] = -float("inf")
        elif self.forgets == "small":  # below sqrt(eps) of float32 and of float64: decay.py's exact gradients
            log_a = torch.where(pick < 0.2, torch.full_like(log_a, -25.0), log_a)
        elif self.forgets == "very negative logs":  # as a mask writes them: a is 0 in every dtype
            log_a = log_a.masked_fill(pick < 0.15, -1e4)
        elif self.forgets == "the lowest float":
            log_a = log_a.masked_fill(pick < 0.15, torch.finfo(self.dtype).min)
        return log_a


def backends_here(rule, with_reference=True):
    """The backends that run `rule` on CPU tensors here, which a case names: "auto", those the rule has a kernel
    for (fla's through Triton's interpreter, where it is on), and "reference" (with_reference). The csrc
    kernels run on CUDA tensors only: their refusals of CPU tensors are tests of their own (tests/test_ops.py)."""
    spec = UPDATE_RULES[rule]
    named = [name for name in ("chunked", "fla") if kernel_of(name, spec) is not None
             and (name != "fla" or fla.interpreting())]
    return ("auto", *named, *(("reference",) if with_reference else ()))


@st.composite
def op_cases(draw, rule, backends, max_T=None):
    """An OpCase of the registered rule `rule`, naming one of `backends`."""
    spec = UPDATE_RULES[rule]
    backend = draw(st.sampled_from(backends))
    interpreted = backend == "fla" and fla.interpreting()  # Triton's interpreter: seconds per call past 17 tokens
    max_T = min(max_T or LENGTHS[-1], 17 if interpreted else LENGTHS[-1])
    householder_negative = spec.householder and draw(st.booleans())
    return OpCase(
        rule=rule, B=draw(st.integers(1, 2)), H=draw(st.integers(1, 2)),
        T=draw(st.sampled_from([T for T in LENGTHS if T <= max_T])),
        D=draw(st.one_of(st.integers(1, 9), st.just(40))), Dv=draw(st.integers(1, 7)), N=draw(st.integers(2, 3)) if spec.substeps else 1,
        dtype=draw(st.sampled_from([torch.float32] if backend == "fla" else [torch.float64, torch.float32])),
        with_state=draw(st.booleans()), backend=backend,
        decay_form=draw(st.sampled_from(DECAY_FORMS)) if spec.decay else None,
        forgets=draw(st.sampled_from(FORGETS)) if spec.decay else "none",
        decay_scale=draw(st.sampled_from([0.5, 3.0, 6.0])),
        beta_scale=2.0 if householder_negative else 1.0,
        seed=draw(st.integers(0, 2**16)))
