"""fairseq Transformer layers whose attention hooks build FastWeightAttention.

Each layer overrides only the attention builders; everything else is fairseq's. ``plan`` says which
attention of which layer is fast-weight and with what options (an AttentionPlan, built from the flags by
models/site_options.py): the layers know fairseq's interfaces and the options, not the flags. The decoder
also reads several tokens in one incremental call (a prompt: FastWeightTransformerDecoder._read).
"""
from typing import Dict, Optional

from fairseq.distributed import fsdp_wrap
from fairseq.models.transformer import TransformerDecoderBase, TransformerEncoderBase
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase

from torch import Tensor

from .fast_weight_attention import FastWeightAttention
from .positions import embedded, future_mask, positions_after


class FastWeightEncoderLayer(TransformerEncoderLayerBase):
    def __init__(self, cfg, plan, index, return_fc=False):
        self.plan, self.index = plan, index  # read by build_self_attention inside the base __init__
        super().__init__(cfg, return_fc=return_fc)

    def build_self_attention(self, embed_dim, cfg):
        options = self.plan.options_for("encoder-self", self.index)
        return super().build_self_attention(embed_dim, cfg) if options is None else FastWeightAttention(options)


class FastWeightDecoderLayer(TransformerDecoderLayerBase):
    def __init__(self, cfg, plan, index, no_encoder_attn=False):
        self.plan, self.index = plan, index
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)
        # encoder-decoder attention weights only where the decoder asks (its alignment layer): fairseq's layer
        # asks every layer, at every step, in eval mode, which fast-weight attention would compute for nothing
        self.need_attn = False

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        options = self.plan.options_for("decoder-self", self.index)
        if options is None:
            return super().build_self_attention(embed_dim, cfg, add_bias_kv, add_zero_attn)
        return FastWeightAttention(options)

    def build_encoder_attention(self, embed_dim, cfg):
        options = self.plan.options_for("cross", self.index)
        return super().build_encoder_attention(embed_dim, cfg) if options is None else FastWeightAttention(options)


def _wrap(layer, cfg):
    """fairseq's activation checkpointing and FSDP wrapping of a layer."""
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)


class FastWeightTransformerEncoder(TransformerEncoderBase):
    def __init__(self, cfg, plan, dictionary, embed_tokens):
        self.plan, self._layers_built = plan, 0
        super().__init__(cfg, dictionary, embed_tokens)

    def build_encoder_layer(self, cfg):
        index, self._layers_built = self._layers_built, self._layers_built + 1  # fairseq builds them in order
        return _wrap(FastWeightEncoderLayer(cfg, self.plan, index, return_fc=self.return_fc), cfg)


class FastWeightTransformerDecoder(TransformerDecoderBase):
    """fairseq's Transformer decoder with fast-weight layers. With an incremental state it reads every token of
    prev_output_tokens that the state has not read yet: one per step as fairseq's SequenceGenerator gives them,
    or a whole prompt in one call (FastWeightSequenceGenerator), each layer's state then as after reading them
    one at a time. A padding token in a step is a row that reads nothing there."""

    def __init__(self, cfg, plan, dictionary, embed_tokens, no_encoder_attn=False, position_period=None):
        """position_period: positions restart every this many tokens (--fwp-position-period), or None."""
        self.plan, self._layers_built = plan, 0
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn)
        self.position_period = position_period

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        index, self._layers_built = self._layers_built, self._layers_built + 1
        return _wrap(FastWeightDecoderLayer(cfg, self.plan, index, no_encoder_attn=no_encoder_attn), cfg)

    def extract_features_scriptable(self, prev_output_tokens, encoder_out, incremental_state=None,
                                    full_context_alignment=False, alignment_layer=None, alignment_heads=None):
        if incremental_state is None and self.position_period is None:
            return super().extract_features_scriptable(prev_output_tokens, encoder_out, incremental_state,
                                                       full_context_alignment, alignment_layer, alignment_heads)
        return self._read(prev_output_tokens, encoder_out, incremental_state)

    def max_positions(self):
        """Without positions, or with positions that restart, no length is out of reach."""
        if self.embed_positions is None or self.position_period is not None:
            return int(1e12)  # fairseq compares and takes minima of it: a number, not inf
        return super().max_positions()

    def _read(self, tokens, encoder_out, incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]]):
        """The features ``[rows, new, C]`` of the tokens past those the incremental state has read (``tokens``
        holds the whole prefix, fairseq's convention; all of them without a state), each positioned by its
        row's count of tokens read, restarting every position_period (positions.py). A state may also have
        read columns before this prefix ("before": a session's earlier turns, session.py), which a softmax
        layer's cache holds."""
        read = None if incremental_state is None else self.get_incremental_state(incremental_state, "read")
        length = 0 if read is None else int(read["length"])
        before = 0 if read is None or read.get("before") is None else int(read["before"])
        if tokens.size(1) <= length:
            raise ValueError(f"prev_output_tokens has {tokens.size(1)} tokens, and the incremental state has read "
                             f"{length}: give the whole prefix, with the tokens to read at its end")
        new = tokens[:, length:].contiguous()
        keep = new.ne(self.padding_idx)
        counts = tokens.new_zeros(tokens.size(0)) if read is None else read["counts"]
        positions, counts = positions_after(counts, keep, self.padding_idx, self.position_period)
        x = self.embed_scale * self.embed_tokens(new)
        if self.quant_noise is not None:
            x = self.quant_noise(x)
        if self.project_in_dim is not None:
            x = self.project_in_dim(x)
        if self.embed_positions is not None:
            x = x + embedded(self.embed_positions, positions)
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = self.dropout_module(x).transpose(0, 1)
        padding = ~keep if self.cross_self_attention or not keep.all() else None
        # the future mask of a hybrid's softmax layers, as wide as their caches (a fast-weight layer reads none)
        mask = future_mask(before + length, new.size(1), x) if new.size(1) > 1 and self._softmax_layers() else None
        enc = encoder_out["encoder_out"][0] if encoder_out is not None and encoder_out["encoder_out"] else None
        enc_padding = (encoder_out["encoder_padding_mask"][0]
                       if encoder_out is not None and encoder_out["encoder_padding_mask"] else None)
        inner_states = [x]
        for layer in self.layers:
            x, _, _ = layer(x, enc, enc_padding, incremental_state, self_attn_mask=mask,
                            self_attn_padding_mask=padding)
            if padding is not None and incremental_state is not None:  # a softmax layer's padded query that
                x = x.masked_fill(padding.t().unsqueeze(-1), 0.0)  # sees only padding is NaN
            inner_states.append(x)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        if incremental_state is not None:
            self._set_read(incremental_state, read, tokens.new_tensor([tokens.size(1)]), counts)
        return x, {"attn": [None], "inner_states": inner_states}

    def _softmax_layers(self):
        """Whether any layer's self-attention is softmax attention (a hybrid: --fwp-softmax-layers)."""
        return any(not isinstance(layer.self_attn, FastWeightAttention) for layer in self.layers)

    def _set_read(self, incremental_state, read, length, counts):
        kept = {} if read is None or read.get("before") is None else {"before": read["before"]}
        self.set_incremental_state(incremental_state, "read", {"length": length, "counts": counts, **kept})

    def reorder_incremental_state(self, incremental_state, new_order):
        read = self.get_incremental_state(incremental_state, "read")
        if read is not None:
            self._set_read(incremental_state, read, read["length"], read["counts"].index_select(0, new_order))

    def start_after_read(self, incremental_state):
        """The state's columns read count as read before (a session's next turn): the next prefix given starts
        at column 0, its tokens positioned after those read."""
        read = self.get_incremental_state(incremental_state, "read")
        if read is not None:
            before = read["length"] + (0 if read.get("before") is None else read["before"])
            self.set_incremental_state(incremental_state, "read", {"length": read["length"] * 0,
                                                                   "counts": read["counts"], "before": before})
