"""FastWeightAttention: a drop-in for fairseq's MultiheadAttention.

Same forward signature and return value, same attributes the Transformer
layers read (``num_heads``, ``head_dim``, ``_get_input_buffer``,
``reorder_incremental_state``), and the same projection names (``q_proj``,
``k_proj``, ``v_proj``, ``out_proj``).

Two modes:
- causal (decoder self-attention): a fast weight programmed token by token
  with the sum rule (Eq. 17) or the delta rule (Eqs. 20-25); during
  incremental decoding the fast weight W (and the key sum z when attention
  normalisation is on) lives in the incremental state and is updated there
  in place, so each new token costs the same whatever its position.
- non-causal (encoder self-attention, encoder-decoder attention): one memory
  W = sum_j v_j phi(k_j)^T (Eq. 15) over all unpadded source positions, read by
  every query; for encoder-decoder attention it is built once per source
  sentence (not per beam) and cached as static state while decoding.
  decoding_state.py keeps these buffers and moves them for beam search.

Padded key positions never write to a memory. Attention weights are never
materialised: the second return value is always None (so
``fairseq-generate --print-alignment`` is not supported), and the attention
dropout of softmax attention has no weights to act on.
"""
import math
from typing import Dict, Optional

import torch
import torch.nn as nn
from fairseq.incremental_decoding_utils import with_incremental_state
from torch import Tensor

from ..ops import decoding, fast_weight_delta, fast_weight_sum
from ..ops.fast_weight import accumulation_dtype
from . import decoding_state
from .feature_maps import build_feature_map, sum_normalize

UPDATE_RULES = ("sum", "delta")


@with_incremental_state
class FastWeightAttention(nn.Module):
    def __init__(
        self,
        embed_dim,
        num_heads,
        *,
        kdim=None,
        vdim=None,
        causal=True,
        feature_map="linear",
        feature_map_options=None,
        update_rule="sum",
        sum_normalization=True,
        attention_normalization=False,
        output_scaling=False,
        backend="auto",
        eps=1e-5,
    ):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if update_rule not in UPDATE_RULES:
            raise ValueError(f"update_rule must be one of {', '.join(UPDATE_RULES)}; got {update_rule!r}")
        if update_rule == "delta" and not causal:
            raise ValueError("the delta rule is only implemented for causal (decoder self-) attention")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.causal = causal
        self.update_rule = update_rule
        self.sum_normalization = sum_normalization
        self.attention_normalization = attention_normalization
        self.output_scaling = output_scaling
        self.backend = backend
        self.eps = eps
        self.carry_over = False  # see enable_carry_over
        self._streams = {}

        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(kdim or embed_dim, embed_dim)
        self.v_proj = nn.Linear(vdim or embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        # Eq. 21: one write strength per head, from the layer input.
        self.beta_proj = nn.Linear(embed_dim, num_heads) if update_rule == "delta" else None
        self.feature_map = build_feature_map(feature_map, self.head_dim, **(feature_map_options or {}))
        self.reset_parameters()

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
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ):
        """query, key, value: Time x Batch x Channel. Returns (out, None).

        In causal mode the future mask ``attn_mask`` is implied and ignored; in
        non-causal mode ``value`` must be ``key`` (as in every fairseq layer).
        """
        if self.causal:
            return self._causal(query, key_padding_mask, incremental_state), None
        return self._non_causal(query, key, key_padding_mask, incremental_state, static_kv), None

    # -- helpers ---------------------------------------------------------------

    def _heads(self, x):
        """[T, B, H * d] -> [B, H, T, d]"""
        T, B, C = x.shape
        return x.view(T, B, self.num_heads, C // self.num_heads).permute(1, 2, 0, 3)

    def _phi(self, x):
        phi = self.feature_map(self._heads(x))
        return sum_normalize(phi) if self.sum_normalization else phi

    def _finish(self, out):
        """[B, H, T, d] -> [T, B, H * d] through the output projection."""
        if self.output_scaling:
            out = out * self.head_dim ** -0.5
        B, H, T, d = out.shape
        return self.out_proj(out.permute(2, 0, 1, 3).reshape(T, B, H * d))

    def _normalize_output(self, out, q, z):
        """Eq. 19 / Eq. 28: divide by z_t . phi(q_t)."""
        return out / ((q * z).sum(-1, keepdim=True) + self.eps)

    # -- causal ----------------------------------------------------------------

    def _causal(self, x, key_padding_mask, incremental_state):
        q, k, v = self._phi(self.q_proj(x)), self._phi(self.k_proj(x)), self._heads(self.v_proj(x))
        write = None if key_padding_mask is None else ~key_padding_mask.unsqueeze(1)  # [B, 1, T]
        if write is not None:
            k = k * write.unsqueeze(-1).to(k.dtype)
        if incremental_state is not None:
            saved = self._get_input_buffer(incremental_state)
            if x.shape[0] == 1 and write is None and not torch.is_grad_enabled():
                out = self._decoding_step(x, q, k, v, saved)
                self._set_input_buffer(incremental_state, saved)
                return self._finish(out)
        else:
            saved = self._carried_state(x.shape[1])
        W0, z0 = decoding_state.fast_weight(saved), saved.get("key_sum")
        z = None
        if self.attention_normalization:
            # z_t = z_0 + sum_{j<=t} phi(k_j) (Eq. 18), accumulated in float32; padded keys are zero.
            k_acc = k.to(accumulation_dtype(k.dtype))
            z = k_acc.cumsum(2) if z0 is None else z0.unsqueeze(2) + k_acc.cumsum(2)

        if self.update_rule == "sum":
            out, W = fast_weight_sum(q, k, v, W0, backend=self.backend)
        else:
            beta = torch.sigmoid(self.beta_proj(x)).permute(1, 2, 0)  # [B, H, T]
            if write is not None:
                beta = beta * write.to(beta.dtype)
            if self.attention_normalization:
                k, beta = self._delta_attention_normalization(k, beta, z)
            out, W = fast_weight_delta(q, k, v, beta, W0, backend=self.backend)
        if self.attention_normalization:
            out = self._normalize_output(out, q, z.to(out.dtype))

        if incremental_state is not None:
            decoding_state.store_fast_weight(saved, W)
            if z is not None:
                saved["key_sum"] = z[:, :, -1]
            self._set_input_buffer(incremental_state, saved)
        elif self.carry_over:
            self._carry(W, z)
        return self._finish(out)

    def _decoding_step(self, x, q, k, v, saved):
        """One token of incremental decoding: the state in `saved` advances in place.

        An empty memory is held as its factors (keys and writes) while they are
        smaller than W, then as W (decoding_state.py).
        """
        acc = accumulation_dtype(q.dtype)
        z, beta = saved.get("key_sum"), None
        if self.attention_normalization:  # Eq. 18, the state owns z: a fresh one at the first token
            z = k[:, :, 0].to(acc, copy=True) if z is None else z.add_(k[:, :, 0])
        if self.update_rule == "delta":
            beta = torch.sigmoid(self.beta_proj(x)).permute(1, 2, 0)  # [B, H, 1]
            if self.attention_normalization:
                k, beta = self._delta_attention_normalization(k, beta, z.unsqueeze(2))
            beta = beta[:, :, 0]
        out = decoding_state.advance_rows(saved, q[:, :, 0], k[:, :, 0], v[:, :, 0], beta, acc)
        out = out.unsqueeze(2).to(q.dtype)
        if self.attention_normalization:
            out = self._normalize_output(out, q, z.unsqueeze(2).to(q.dtype))
        saved["key_sum"] = z
        return out

    # -- carry-over across segments (paper Table 4) ------------------------------

    def enable_carry_over(self):
        """Start every causal segment from the final state of the stream's previous segment.

        Whoever feeds the segments calls ``start_segment`` before each one
        (the task fwp_stream_lm does). Training and evaluation keep separate
        streams (a validation pass in the middle of an epoch must not disturb
        the training streams); incremental decoding ignores them.
        """
        self.carry_over = True
        self._streams = {}

    def start_segment(self, position, training):
        """Before the segment at `position` (0, 1, ...) of the training or evaluation streams.

        Position 0 starts from zero; the position after the previous one
        starts from the state the previous one ended with; the previous
        position again (a retried update) starts where it started before, and
        so does every forward within one segment, which keeps fairseq's
        --checkpoint-activations (a second forward per layer in the backward
        pass) exact; any other position (a run resumed in the middle of an
        epoch) starts from zero.
        """
        stream = self._streams.get(training)
        if stream is not None and position == stream["position"]:
            start = stream["start"]
        elif stream is not None and position == stream["position"] + 1 and position > 0:
            start = stream["end"]
        else:
            start = {}
        self._streams[training] = {"position": position, "start": start, "end": start}

    def _carried_state(self, batch_size):
        stream = self._streams.get(self.training) if self.carry_over else None
        state = {} if stream is None else stream["start"]
        W = state.get("fast_weight")
        if W is not None and W.shape[0] != batch_size:
            raise RuntimeError(
                f"the carried fast weight holds {W.shape[0]} streams, but this segment has {batch_size} rows: "
                "every batch of a carry-over task must keep the same streams in the same rows")
        return state

    def _carry(self, W, z):
        """Truncated backpropagation: the stream's next segment starts from these values, detached."""
        stream = self._streams.get(self.training)
        if stream is not None:
            stream["end"] = {"fast_weight": W.detach(), "key_sum": None if z is None else z[:, :, -1].detach()}

    def _delta_attention_normalization(self, k, beta, z):
        """Eqs. 26-28: normalise the retrieval vbar_t by d_t = z_{t-1} . phi(k_t).

        With k'_t = phi(k_t) / d_t and beta'_t = beta_t d_t, the delta update
        on (k', beta') retrieves W k_t / d_t and writes the same change as the
        paper. d_t = 1 while nothing has been written yet (the first token).
        """
        k_acc = k.to(z.dtype)
        z_prev = z - k_acc
        d = (z_prev * k_acc).sum(-1)
        d = torch.where(z_prev.sum(-1) > 0, d, torch.ones_like(d)).to(k.dtype)
        return k / (d.unsqueeze(-1) + self.eps), beta * d

    # -- non-causal ------------------------------------------------------------

    def _non_causal(self, query, key, key_padding_mask, incremental_state, static_kv):
        q = self._phi(self.q_proj(query))
        cached = incremental_state is not None and static_kv
        saved = self._get_input_buffer(incremental_state) if cached else {}
        if "fast_weight" not in saved:
            # Beam search repeats each source once per beam: one memory per source serves its rows.
            g = decoding_state.rows_per_source(key, key_padding_mask) if cached else 1
            mask = None if key_padding_mask is None else key_padding_mask[::g]
            saved["fast_weight"], saved["key_sum"] = self._source_memory(key[:, ::g], mask)
            saved[decoding_state.MEMORY_ROWS] = torch.tensor(g)
            if cached:
                self._set_input_buffer(incremental_state, saved)
        W, z = saved["fast_weight"], saved["key_sum"]
        out = decoding_state.read_memory(W, q)
        if self.attention_normalization:
            z = z.repeat_interleave(decoding_state.memory_rows(saved), 0)
            out = self._normalize_output(out, q, z.unsqueeze(2).to(q.dtype))
        return self._finish(out)

    def _source_memory(self, key, key_padding_mask):
        """Eq. 15 over the unpadded source: W = sum_j v_j phi(k_j)^T, z = sum_j phi(k_j)."""
        k, v = self._phi(self.k_proj(key)), self._heads(self.v_proj(key))
        if key_padding_mask is not None:
            k = k * (~key_padding_mask).unsqueeze(1).unsqueeze(-1).to(k.dtype)
        W = torch.einsum("bhte,bhtd->bhed", v, k)
        z = k.to(accumulation_dtype(k.dtype)).sum(2) if self.attention_normalization else None
        return W, z

    # -- incremental state (fairseq interface) -----------------------------------

    def _get_input_buffer(self, incremental_state):
        result = self.get_incremental_state(incremental_state, "fwp_state")
        return result if result is not None else {}

    def _set_input_buffer(self, incremental_state, buffer):
        return self.set_incremental_state(incremental_state, "fwp_state", buffer)

    def reorder_incremental_state(self, incremental_state, new_order):
        """Beam search reorders hypotheses (decoding_state.py)."""
        buffer = self._get_input_buffer(incremental_state)
        if buffer:
            reorder = decoding_state.reorder_rows if self.causal else decoding_state.reorder_sources
            reorder(buffer, new_order)
            self._set_input_buffer(incremental_state, buffer)
        return incremental_state

    def extra_repr(self):
        return (f"causal={self.causal}, update_rule={self.update_rule}, "
                f"sum_normalization={self.sum_normalization}, "
                f"attention_normalization={self.attention_normalization}, "
                f"output_scaling={self.output_scaling}, backend={self.backend}")
