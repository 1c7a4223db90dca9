"""FastWeightAttention: a drop-in for fairseq's MultiheadAttention.

Same forward signature and return value, same attributes the Transformer
layers read (``num_heads``, ``head_dim``, ``_get_input_buffer``,
``reorder_incremental_state``), and the same projection names (``q_proj``,
``k_proj``, ``v_proj``, ``out_proj``).

Two modes:
- causal (decoder self-attention): a fast weight programmed token by token
  with the sum rule (Eq. 17), the delta rule (Eqs. 20-25) or their gated
  forms (a decay a_t from the layer input, gates.py); during incremental
  decoding the state (state.FastWeightState) lives in the incremental state, so
  each new token costs at most what it costs with W, whatever its position.
- non-causal (encoder self-attention, encoder-decoder attention): one memory
  W = sum_j v_j phi(k_j)^T (Eq. 15) over all unpadded source positions, read by
  every query; for encoder-decoder attention it is built once per source
  sentence (not per beam) and cached as static state while decoding
  (source_attention.py).

The layer composes small parts, each with a reference test of its own: the
feature map and the normalisation of phi(q), phi(k) (feature_maps.py: the
paper's sum normalisation, Eq. 29, or L2), a short causal convolution on the
q, k, v projections (short_convolution.py), the decay and the output gate
(gates.py), and the state carried across segments (carried_streams.py).

Padded key positions never write to a memory (nor decay it). Attention
weights are never formed to compute the output, and the attention dropout of
softmax attention has no weights to act on; the output is linear in the values
all the same (y_i = sum_j a_ij v_j), and the exact a_ij are computed where they
are asked for (``forward``'s need_weights, in eval mode: fairseq-generate
--print-alignment).
"""
import math
from typing import Dict, Optional

import torch
import torch.nn as nn
from fairseq.incremental_decoding_utils import with_incremental_state
from torch import Tensor

from ..ops import BackendUnavailableError, fast_weight, fast_weight_step_
from ..ops.fast_weight import accumulation_dtype
from .attention_options import AttentionOptions
from .backend_log import BackendLog
from .carried_streams import CarriedStreams
from .feature_maps import build_feature_map
from .fused_step import fused_step_for
from .gates import DecayGate, OutputGate
from .layouts import project, project_all, to_batch_first
from .normaliser import divided_by_normalizer
from .short_convolution import ShortConvolution
from .source_attention import attend_to_sources
from .state import FastWeightState


@with_incremental_state
class FastWeightAttention(nn.Module):
    def __init__(self, options: AttentionOptions):
        """options: every option of the layer, checked when the AttentionOptions was built."""
        super().__init__()
        self.options = options
        self.embed_dim, self.num_heads, self.head_dim = options.embed_dim, options.num_heads, options.head_dim
        self.causal = options.causal
        self.rule = options.rule
        self.backend_log = BackendLog()  # a model shares one among its layers (share_backend_log)
        self.streams = None  # see enable_carry_over

        embed_dim, kdim, writes = options.embed_dim, options.kdim or options.embed_dim, options.householder_steps
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(kdim, writes * embed_dim)  # DeltaProduct: N keys and values per token
        self.v_proj = nn.Linear(kdim, writes * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        # Eq. 21: one write strength per head (and write), from the layer input; a rule with strengths per
        # channel (GDN-2) gets one per key channel of phi(k) and one per value channel.
        self.strengths = (self._features(options) + self.head_dim if self.rule.write_strength == "channels"
                          else 1)
        self.beta_proj = (nn.Linear(embed_dim, writes * options.num_heads * self.strengths)
                          if self.rule.write_strength else None)
        self.decay_gate = DecayGate(embed_dim, options.num_heads, options.decay_form, channels=(
            self._features(options) if self.rule.decay == "channels" else None)) if self.rule.decay else None
        self.convolutions = nn.ModuleDict({
            name: ShortConvolution((1 if name == "q" else writes) * embed_dim, options.short_conv) for name in "qkv"
        }) if options.short_conv else None
        self.output_gate = OutputGate(embed_dim, options.num_heads) if options.output_gate else None
        self.feature_map = build_feature_map(options.feature_map, self.head_dim, **dict(options.feature_map_options))
        self.reset_parameters()
        self.fused_step = fused_step_for(self)  # decoding in one call (fused_step.py), where it computes the same

    @staticmethod
    def _features(options):
        """D, the size of phi(k): the key channels a per-channel decay or erase gate has one value for.
        Read off the map's class without building it (a random map would draw from torch's generator)."""
        with torch.random.fork_rng(devices=[]):
            return build_feature_map(options.feature_map, options.head_dim, **dict(options.feature_map_options)).out_dim

    def start_as_ungated(self):
        """The decay gate at a_t = exp(-1e-4) and the short convolutions as identities: the layer computes
        (almost exactly) what the same layer without them computes. For uptraining, whose converted model
        should start as the softmax model's nearest fast-weight twin. The output gate has no such setting
        (its RMS norm rescales every head's output)."""
        if self.decay_gate is not None:
            self.decay_gate.start_near_one()
        for convolution in (self.convolutions or {}).values():
            convolution.start_as_identity()
        if self.options.householder_steps > 1:  # every write but the first starts with beta near 0
            with torch.no_grad():
                self.beta_proj.weight[self.num_heads:].zero_()
                self.beta_proj.bias[self.num_heads:].fill_(-10.0)
        if self.strengths > 1:  # GDN-2's gates as one write strength per head: b_t = w_t = beta_t, KDA's
            with torch.no_grad():
                for rows in (self.beta_proj.weight.view(self.num_heads, self.strengths, -1),
                             self.beta_proj.bias.view(self.num_heads, self.strengths)):
                    rows.copy_(rows[:, :1].expand_as(rows))

    def reset_parameters(self):
        # As fairseq's MultiheadAttention, so that only the attention differs.
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.constant_(self.out_proj.bias, 0.0)
        if self.beta_proj is not None:
            nn.init.xavier_uniform_(self.beta_proj.weight)
            nn.init.constant_(self.beta_proj.bias, 0.0)

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_weights: bool = False,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ):
        """query, key, value: Time x Batch x Channel. Returns (out, the attention weights or None).

        In causal mode the future mask ``attn_mask`` is implied and ignored; in non-causal mode ``value`` must be
        ``key`` (as in every fairseq layer). The attention weights, where asked (need_weights, in eval mode: never
        while training): out_i = sum_j a_ij v_j exactly, v_j the values (``values``) before the output gate and
        projection; ``[H, B, T, S]`` with need_head_weights, else their mean over the heads ``[B, T, S]``, as
        fairseq's MultiheadAttention gives them (source_attention.py; a causal layer's: _dual_form_weights).
        need_weights defaults to False (MultiheadAttention's to True, which fairseq's layers always override):
        weights cost O(T S) here, and are computed only where asked.
        """
        weights_wanted = (need_weights or need_head_weights) and not self.training
        try:
            if self.causal:
                out, weights = self._causal(query, key_padding_mask, incremental_state, weights_wanted)
            else:
                out, weights = attend_to_sources(self, query, key, key_padding_mask, incremental_state, static_kv,
                                                 weights_wanted)
        except BackendUnavailableError as err:  # a backend that cannot run here: the flag that named it
            raise BackendUnavailableError(f"--fwp-backend {self.options.backend}: {err}") from None
        if weights is None:
            return out, None
        weights = weights.transpose(0, 1)  # [H, B, T, S]
        return out, weights if need_head_weights else weights.mean(0)

    def values(self, value, key_padding_mask=None):
        """The values ``[B, H, S, Dv]`` that the attention weights weigh (a DeltaProduct layer's: each write's,
        ``[B, H, S, N, Dv]``): the heads of the value projection of ``value`` ``[S, B, C]``, through a causal
        layer's short convolution where it has one (from an empty cache, padded positions zero)."""
        v = self.v_proj(value)
        if self.causal and self.convolutions is not None:
            keep = None if key_padding_mask is None else ~key_padding_mask
            v = self.convolutions["v"](v if keep is None else v * keep.t().unsqueeze(-1).to(v.dtype), None,
                                       None if keep is None else keep.t())[0]
        return self._heads(v)

    # -- helpers ---------------------------------------------------------------

    def _heads(self, x):
        """[T, B, H * d] -> [B, H, T, d]; DeltaProduct's keys and values [T, B, N * H * d] -> [B, H, T, N, d]."""
        T, B, C = x.shape
        writes = C // self.embed_dim
        if writes == 1 or not self.causal:
            return x.view(T, B, self.num_heads, C // self.num_heads).permute(1, 2, 0, 3)
        return x.view(T, B, writes, self.num_heads, self.head_dim).permute(1, 3, 0, 2, 4)

    def _step_heads(self, y):
        """_heads of one step without its T: [1, B, H * d] -> [B, H, d] (DeltaProduct's keys and values
        [1, B, N * H * d] -> [B, H, N, d]), in one view: each op costs microseconds at batch 1."""
        B, C = y.shape[1:]
        writes = C // self.embed_dim
        if writes == 1 or not self.causal:
            return y.view(B, self.num_heads, C // self.num_heads)
        return y.view(B, writes, self.num_heads, self.head_dim).transpose(1, 2)

    def _finish_step(self, out, x):
        """_finish of one step's [B, H, d] (in x's dtype: the fused step's)."""
        if self.output_gate is not None or self.options.output_scaling:
            return self._finish(out.unsqueeze(2), x)
        return self.out_proj(out.reshape(1, out.shape[0], -1))

    def _phi(self, x):
        return self.feature_map.normalized(self._heads(x), self.options.qk_norm)

    def _finish(self, out, x):
        """[B, H, T, d] -> [T, B, H * d] through the output gate (if any) and the output projection."""
        if self.output_gate is not None:
            out = self.output_gate(out, x)
        if self.options.output_scaling:
            out = out * self.head_dim ** -0.5
        B, H, T, d = out.shape
        return project(self.out_proj, out.permute(2, 0, 1, 3).reshape(T, B, H * d))

    def _normalize_output(self, out, q, z):
        """Eq. 19 / Eq. 28: divide by z_t . phi(q_t)."""
        return divided_by_normalizer(out, (q * z).sum(-1, keepdim=True), self.options.eps)

    # -- causal ----------------------------------------------------------------
    #
    # One call: the state it starts from, then features (through the short convolutions), gates,
    # attention normalisation, the op that programs and reads the memory, and the output; each a step
    # of its own below.

    def _causal(self, x, key_padding_mask, incremental_state, weights_wanted=False):
        """(the output, the attention weights ``[B, H, T, S]`` where wanted, else None)."""
        if weights_wanted and (incremental_state is not None or self.streams is not None):
            raise ValueError("a causal fast-weight layer's attention weights are those of a whole sequence read from "
                             "an empty memory (the dual form), not those of a decoding step or of a carried segment, "
                             "whose memory holds what came before")
        state = self._starting_state(x, incremental_state)
        keep = None if key_padding_mask is None else ~key_padding_mask  # [B, T]: positions that write
        one_step = incremental_state is not None and x.shape[0] == 1 and not torch.is_grad_enabled()
        if one_step and self.fused_step is not None and self.fused_step.runs(x, keep):
            return self._fused_causal_step(x, state, incremental_state), None
        x = to_batch_first(x)  # layouts.py: fla's layout from here to the output projection, which reads it
        projected, logits = self._projections(x, keep, state)
        q, k, v = self._causal_features(projected, keep)
        beta, log_decay = self._gates(x, keep, logits)
        z, k, beta = self._attention_normalization(k, beta, state, one_step)
        weights = self._dual_form_weights(q, k, v, beta, log_decay, z) if weights_wanted else None
        out = self._program(q, k, v, beta, log_decay, state, one_step)
        if z is not None:  # Eq. 19 / Eq. 28
            out = self._normalize_output(out, q, z.to(out.dtype))
        state.feature_draw = self.feature_map.draw
        if incremental_state is not None:
            self._set_input_buffer(incremental_state, state)
        elif self.streams is not None:
            self.streams.end(self.training, state)
        return self._finish(out, x), weights

    def _starting_state(self, x, incremental_state):
        """Decoding: the incremental state (advanced in place); carry-over: the stream's; else empty."""
        if incremental_state is not None:
            return self._get_input_buffer(incremental_state)
        if self.streams is None:
            return FastWeightState()
        state = self.streams.start(self.training, x.shape[1], x.device)
        state.check_features(self.feature_map.draw, "the carried state")
        return state

    def _projections(self, x, keep, state):
        """The q, k, v projections ``[T, B, .]``, through the short convolutions where there are any (their
        caches in `state` advance), and beta's logits (None for a rule without beta), all in one call
        (layouts.project_all: one input, whose gradient their GEMMs sum)."""
        linears = [self.q_proj, self.k_proj, self.v_proj] + ([self.beta_proj] if self.beta_proj is not None else [])
        projected = project_all(linears, x)
        logits = projected.pop() if self.beta_proj is not None else None
        if self.convolutions is not None:
            mask = None if keep is None else keep.t().unsqueeze(-1).to(x.dtype)  # [T, B, 1]
            caches = state.convolutions or (None,) * 3
            results = [conv(inputs if mask is None else inputs * mask, cache, None if keep is None else keep.t())
                       for conv, inputs, cache in zip(self.convolutions.values(), projected, caches)]
            projected, state.convolutions = [y for y, _ in results], tuple(cache for _, cache in results)
        return projected, logits

    def _fused_causal_step(self, x, state, incremental_state):
        """One decoding step through the fused step (fused_step.py): the projections and gates here, then
        one call for the features, the memory's update and its read."""
        projected, logits = self._projections(x, None, state)
        q, k, v = (self._step_heads(y) for y in projected)  # [B, H, (N,) d]
        if not self.rule.substeps:
            k, v = k.unsqueeze(2), v.unsqueeze(2)
        beta, log_decay = self._gates(x, None, logits)
        out = self.fused_step(q, k, v, _step(beta), _step(log_decay), state)
        state.feature_draw = self.feature_map.draw
        self._set_input_buffer(incremental_state, state)
        return self._finish_step(out, x)

    def _causal_features(self, projected, keep):
        """phi(q), phi(k) and v ``[B, H, T, .]`` of the projections; padded positions write nothing."""
        q, k, v = self._phi(projected[0]), self._phi(projected[1]), self._heads(projected[2])
        if keep is not None:
            k = k * _per_token(keep, k).to(k.dtype)
        return q, k, v

    def _gates(self, x, keep, logits=None):
        """beta (Eq. 21: the delta rules' write strength) and log a (the gated rules' decay) ``[B, H, T]``,
        or None; padded positions neither write nor decay. logits: beta_proj(x), where the caller has it."""
        beta = None
        if self.beta_proj is not None:
            T, B = x.shape[:2]
            writes = self.options.householder_steps
            logits = project(self.beta_proj, x) if logits is None else logits
            beta = torch.sigmoid(logits).view(T, B, writes, self.num_heads, self.strengths)
            beta = beta.permute(1, 3, 0, 2, 4)  # [B, H, T, N, channels]
            beta = beta.squeeze(-1) if self.strengths == 1 else beta
            beta = beta if self.rule.substeps else beta.squeeze(3)
            if self.options.negative_eigenvalues:  # in (0, 2): the transition's eigenvalues reach [-1, 1]
                beta = 2 * beta if self.strengths == 1 else self._double_erase_gates(beta)
        log_decay = self.decay_gate(x) if self.decay_gate is not None else None
        if keep is not None:
            beta = None if beta is None else beta * _per_token(keep, beta).to(beta.dtype)
            log_decay = None if log_decay is None else log_decay.masked_fill(~_per_token(keep, log_decay), 0.0)
        return beta, log_decay

    def _double_erase_gates(self, beta):
        """Strengths per channel [.., D + Dv]: the erase gates (the first D, in the transition I - k (b * k)^T)
        doubled, the write gates (the Dv after them, which scale what is written) kept."""
        D = self.strengths - self.head_dim
        return torch.cat([2 * beta[..., :D], beta[..., D:]], -1)

    def _attention_normalization(self, k, beta, state, one_step):
        """z_t = z_0 + sum_{j<=t} phi(k_j) (Eq. 18; padded keys are zero) where attention normalisation is
        on (None otherwise), kept in `state`; for the delta rules also the normalised retrieval's k and beta
        (Eqs. 26-28). Returns (z [B, H, T, D] or None, k, beta)."""
        if not self.options.attention_normalization:
            return None, k, beta
        k_acc = k.to(accumulation_dtype(k.dtype))
        z0 = state.key_sum
        if one_step:  # the incremental state owns z: updated in place, after the retrieval has read z_{t-1}
            if self.rule.normalised_retrieval:
                k, beta = self._delta_attention_normalization(k, beta, k_acc, None if z0 is None else z0.unsqueeze(2))
            z = (k_acc[:, :, 0].clone() if z0 is None else z0.add_(k_acc[:, :, 0])).unsqueeze(2)
        else:
            z = k_acc.cumsum(2) if z0 is None else z0.unsqueeze(2) + k_acc.cumsum(2)
            if self.rule.normalised_retrieval:
                k, beta = self._delta_attention_normalization(k, beta, k_acc, _previous_sums(z, z0))
        if k.shape[2]:
            state.key_sum = z[:, :, -1]
        return z, k, beta

    def _program(self, q, k, v, beta, log_decay, state, one_step):
        """The op: writes every token into the memory (sum or delta rule, Eqs. 17, 20-24) and reads it
        with each query (Eqs. 11, 25); one step of the same backend while decoding."""
        run = dict(rule=self.rule.name, backend=self.options.backend, on_choice=self.backend_log.note)
        if one_step:
            out = fast_weight_step_(state.memory, q[:, :, 0], k[:, :, 0], v[:, :, 0], _step(beta),
                                    log_decay=_step(log_decay), **run)
            return out.unsqueeze(2).to(q.dtype)
        out, W = fast_weight(q=q, k=k, v=v, beta=beta, state=state.memory.materialized(), log_decay=log_decay, **run)
        state.memory.hold_(W)
        return out

    def _dual_form_weights(self, q, k, v, beta, log_decay, z):
        """A ``[B, H, T, S]`` with out = A V (S = T writes, T N for DeltaProduct): the rule's output is linear in
        the values it writes (the dual form), so running it on one-hot values gives each write's weight in each
        output, divided by the normaliser as the output is (Eqs. 19, 28)."""
        shape = v.shape[2:-1]  # the writes: [T] or [T, N]
        writes = shape.numel()
        one_hot = torch.eye(writes, dtype=v.dtype, device=v.device).view(1, 1, *shape, writes)
        weights = self._program(q, k, one_hot.expand(*v.shape[:-1], writes), beta, log_decay, FastWeightState(),
                                one_step=False)
        return weights if z is None else self._normalize_output(weights, q, z.to(weights.dtype))

    def _delta_attention_normalization(self, k, beta, k_acc, z_prev):
        """Eqs. 26-28: normalise the retrieval vbar_t by d_t = z_{t-1} . phi(k_t).

        With k'_t = phi(k_t) / d_t and beta'_t = beta_t d_t, the delta update
        on (k', beta') retrieves W k_t / d_t and writes the same change as the
        paper. d_t = 1 while nothing has been written yet (the first token).
        z_prev: the sums z_{t-1} themselves (None: nothing written), never z_t - phi(k_t), whose
        cancellation loses d_t where it is small against |z_t| |phi(k_t)|, and d_t scales the write by
        d_t / (d_t + eps).
        """
        if z_prev is None:
            d = torch.ones_like(k_acc[..., 0])
        else:
            d = torch.where(z_prev.sum(-1) > 0, (z_prev * k_acc).sum(-1), 1.0)
        d = d.to(k.dtype)
        return k / (d.unsqueeze(-1) + self.options.eps), beta * d

    # -- carry-over across segments (paper Table 4) ------------------------------

    def enable_carry_over(self, rank=0, world_size=1):
        """Start every causal segment from the final state of the stream's previous segment; rank and
        world_size: this process's place among data-parallel ranks, each of which carries its own streams.

        Whoever feeds the segments calls ``start_segment`` before each one
        (the task fwp_stream_lm does); carried_streams.py says how. Incremental
        decoding ignores the carried state. Random features stop being redrawn
        per training step: a carried memory is only meaningful in the features
        it was written with (whoever feeds the segments may move to another
        draw where the streams start from zero: fix_features).
        """
        self.streams = CarriedStreams(rank, world_size)
        if self.feature_map.draw is not None:
            self.feature_map.fix_features(self.feature_map.draw)

    def start_segment(self, position, training):
        """Before the segment at `position` of the training or evaluation streams (CarriedStreams)."""
        self.streams.start_segment(position, training)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A checkpoint trained with carried streams loads into a model that carries none (evaluated
        # without carry-over, or finetuned on another task): their state has no place here.
        if self.streams is None:
            for key in [key for key in state_dict if key.startswith(prefix + "streams.")]:
                del state_dict[key]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # -- incremental state (fairseq interface) -----------------------------------

    def _get_input_buffer(self, incremental_state):
        """This layer's FastWeightState in fairseq's incremental state (a new, empty one at first)."""
        state = self.get_incremental_state(incremental_state, "fwp_state")
        return state if state is not None else FastWeightState()

    def _set_input_buffer(self, incremental_state, state):
        return self.set_incremental_state(incremental_state, "fwp_state", state)

    def reorder_incremental_state(self, incremental_state, new_order):
        """Beam search reorders hypotheses (state.py)."""
        state = self.get_incremental_state(incremental_state, "fwp_state")
        if state is not None:
            state.reorder_(new_order) if self.causal else state.reorder_sources_(new_order)
        return incremental_state

    def extra_repr(self):
        o = self.options
        return (f"causal={o.causal}, update_rule={o.update_rule}, qk_norm={o.qk_norm}, "
                f"attention_normalization={o.attention_normalization}, output_scaling={o.output_scaling}, "
                f"backend={o.backend}")


def _previous_sums(z, z0):
    """z_{t-1} for every t of the running sums z ``[B, H, T, D]`` that started from z0 ``[B, H, D]`` (None: zeros)."""
    first = torch.zeros_like(z[:, :, :1]) if z0 is None else z0.unsqueeze(2).to(z.dtype)
    return torch.cat([first, z[:, :, :-1]], 2)


def _step(x):
    """The only step of a [B, H, 1, ...] tensor, or None."""
    return None if x is None else x[:, :, 0]


def _per_token(keep, x):
    """keep ``[B, T]`` shaped to multiply x ``[B, H, T, ...]``."""
    return keep.view(keep.shape[0], 1, keep.shape[1], *([1] * (x.dim() - 3)))
