"""A decoding step of the self-attention in one call: the csrc extension's fused_step (csrc/fast_weight_step.h).

At batch 1 every tensor op of a decoding step costs a few microseconds, and the step of a fast-weight layer
ran about twice as many as softmax attention's (the feature map, its normalisation, attention normalisation,
the decay, the writes and the read, each its own op and Python call). The fused step does those in one call
of C++, per (row, head), on the memory in place (W, or in beams W's factors, whose next slots it fills); the
projections before it and the output gate and projection after it stay torch's.

It runs where it computes exactly what the rule's own step computes (the oracle, tests/test_fused_step.py):
a built-in feature map with a built-in rule, float32 or float64, no autocast, no padding mask, and a backend
other than "reference" (which keeps the rule's own step, the oracle). On the CPU that is the extension's loop
over (row, head); on a GPU, where the extension has its CUDA kernels, one thread block per (row, head)
(csrc/fast_weight_step_cuda.cu), from the same source. Everything else, and every process where the extension
does not build, keeps the unfused step.

--fwp-decoding-step chooses: "own" keeps the rule's own step everywhere; "fused" runs the fused step wherever
it computes the same; "auto" does too, except in beams on a GPU: there it runs only where a GPU report has
timed it faster than the rule's own step, which is at one row so far (docs/benchmarks.md). The log says which
step decodes.
"""
import logging
from typing import Optional

import torch

from ..ops import BackendUnavailableError
from ..ops.backends import Call, resolve
from ..ops import cuda as extension
from ..ops import memory as memory_module
from ..ops.rules import UPDATE_RULES
from .feature_maps import DPFPFeatureMap, LinearFeatureMap, PerformerFeatureMap, SiLUFeatureMap

logger = logging.getLogger("fairseq_fwp.backend")
MAPS = {LinearFeatureMap: 0, SiLUFeatureMap: 1, DPFPFeatureMap: 2, PerformerFeatureMap: 3}  # fwp::FeatureMap
QK_NORMS = {"none": 0, "sum": 1, "l2": 2}
# fwp::Write of each built-in rule: what a write stores
WRITES = {"sum": 0, "gated-sum": 0, "gla": 0, "delta": 1, "gated-delta": 1, "delta-product": 1,
          "gated-delta-product": 1, "kda": 1, "kda-product": 1, "gdn2": 2}
DECAYS = {False: 0, True: 1, "channels": 2}  # fwp::Decay
_unavailable = []  # why the extension does not load here, once it was tried


def fused_step_for(attention) -> Optional["FusedStep"]:
    """The fused step (causal) or read (encoder-decoder attention) of a FastWeightAttention's decoding, or None
    where it keeps the rule's own step."""
    options, rule = attention.options, attention.rule
    builtin_rule = UPDATE_RULES.get(rule.name) is rule and rule.name in WRITES and \
        type(rule).__module__.startswith("fairseq_fwp.ops.rules")
    if not (builtin_rule and type(attention.feature_map) in MAPS and options.backend != "reference"
            and options.decoding_step != "own"):
        return None
    return FusedStep(attention)


class FusedStep:
    def __init__(self, attention):
        o = attention.options
        self.attention = attention
        self._flag_runs = {}  # (device, dtype) -> whether the backend flag runs steps there (_flag_runs_steps)
        self.attention_normalization = o.attention_normalization
        # fused_step's options, in its order: the map, DPFP's nu, FAVOR+'s input scale, the q/k normalisation,
        # attention normalisation, the delta rules' normalised retrieval (Eqs. 26-28), the write, the decay, eps
        feature_map = (MAPS[type(attention.feature_map)], getattr(attention.feature_map, "nu", 1),
                       float(getattr(attention.feature_map, "input_scale", 1.0)), QK_NORMS[o.qk_norm])
        self.options = (*feature_map, o.attention_normalization,
                        o.attention_normalization and attention.rule.normalised_retrieval,
                        WRITES[attention.rule.name], DECAYS[attention.rule.decay], o.eps)
        self.read_options = (*feature_map, o.attention_normalization, o.eps)
        what = f"decoding step of {attention.rule.name}" if o.causal else "decoding read of the source memory"
        self.log = f"--fwp-decoding-step {o.decoding_step} fuses each {what} (csrc/fast_weight_step.h)"
        self.untimed_log = (f"--fwp-decoding-step auto: the rule's own step runs each {what} of beams on a GPU, "
                            "where the fused step has been timed at one row only (--fwp-decoding-step fused runs it)")
        self.choice = o.decoding_step

    def runs(self, x, keep):
        """Whether this step runs fused: float32 or float64, no autocast, no padding, a backend flag that runs
        steps on x's device, the extension built (with its CUDA kernels, for x on a GPU), and on a GPU under
        --fwp-decoding-step auto one row (x ``[1, rows, C]``)."""
        device = x.device.type
        if keep is not None or device not in ("cpu", "cuda") or x.dtype not in (torch.float32, torch.float64) \
                or torch.is_autocast_enabled(device) or not self._flag_runs_steps(x.device, x.dtype):
            return False
        built = loaded()
        if built is None or (device == "cuda" and not built.has_cuda_kernels()):
            return False
        if device == "cuda" and self.choice == "auto" and x.shape[1] > 1:
            self.attention.backend_log.say(self.untimed_log)
            return False
        return True

    def _flag_runs_steps(self, device, dtype):
        """Whether --fwp-backend runs this rule's decoding steps on `device`: the fused step stands in for
        what it runs, and a backend refused there (cuda, fla on CPU tensors) stays refused, by the unfused step."""
        key = (device, dtype)
        if key not in self._flag_runs:
            a = self.attention
            call = Call(rule=a.rule, dtype=dtype, device=device, D=a.feature_map.out_dim, Dv=a.head_dim, T=1,
                        needs_grad=False, step=True)
            try:
                resolve(a.options.backend, call)
                self._flag_runs[key] = True
            except BackendUnavailableError:
                self._flag_runs[key] = False
        return self._flag_runs[key]

    @torch.no_grad()
    def __call__(self, q, k, v, beta, log_decay, state):
        """q ``[B, H, d]``, k ``[B, H, N, d]``, v ``[B, H, N, dv]`` (projected, before the feature map), beta and
        log_decay as the layer's gates give them for one step (or None); advances `state` (its memory, and z
        under attention normalisation) and returns the step's output ``[B, H, dv]``.

        Beams (more than one row) hold W's factors while they are smaller than W (ops/memory.py): fewer numbers
        to copy at each reorder; the step fills their next slots. Batch 1 holds W from its first token."""
        memory, D, Dv, N = state.memory, self.attention.feature_map.out_dim, v.shape[-1], k.shape[2]
        limit = memory_module.factored_length_limit(D, Dv)
        W = keys = writes = None
        if memory.fast_weight is None and limit > 0 and not (memory.is_empty and q.shape[0] == 1):
            held_keys = memory.held()[1]
            like = q if held_keys is None else held_keys  # new factors in q's dtype, or the held ones'
            keys, writes = memory.factor_slots_(N, q.shape[:2], D, Dv, (like, like), room=limit)
        else:
            W = memory.fast_weight_for(q, v, q.dtype, D=D)
            if not W.is_contiguous():  # as a sequence op returned it (a transposed view): C++ writes it in place
                memory.hold_(W.contiguous())
                W = memory.fast_weight
        held = W if W is not None else writes
        z = None
        if self.attention_normalization:
            if state.key_sum is None:
                state.key_sum = held.new_zeros(*q.shape[:2], D)
            elif not state.key_sum.is_contiguous():  # the last of a sequence's running sums (a view of them all)
                state.key_sum = state.key_sum.contiguous()
            z = state.key_sum
        cast = self._cast(held.dtype)
        self.attention.backend_log.say(self.log)
        out = loaded().fused_step(cast(q), cast(k), cast(v), cast(beta), cast(log_decay), W, keys, writes, z,
                                  cast(getattr(self.attention.feature_map, "projection", None)), *self.options)
        if keys is not None:
            memory.hold_fast_weight_at_(limit)
        return out

    @torch.no_grad()
    def read(self, q, state):
        """q ``[rows, H, d]`` (projected) read from the source memories of `state` (every rows_per_memory
        consecutive rows share one), divided by z . phi(q) under attention normalisation: ``[rows, H, dv]``."""
        W, keys, writes = state.memory.held()
        cast = self._cast((W if W is not None else writes).dtype)
        self.attention.backend_log.say(self.log)
        return loaded().fused_read(cast(q), W, keys, writes, state.key_sum,
                                   cast(getattr(self.attention.feature_map, "projection", None)), *self.read_options)

    @staticmethod
    def _cast(dtype):
        return lambda x: x if x is None or (x.dtype == dtype and x.is_contiguous()) else x.to(dtype).contiguous()


def loaded():
    """The extension with fused_step, or None (said once) where it does not load."""
    if _unavailable:
        return None
    try:
        built = extension.load_extension()
    except BackendUnavailableError as err:
        _unavailable.append(str(err))
        logger.info(f"decoding runs each rule's own step: {err}")
        return None
    return built
