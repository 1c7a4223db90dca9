"""fairseq Transformer layers whose attention hooks build FastWeightAttention.

Each layer overrides only the attention builders; everything else is fairseq's. ``plan`` says which
attention of which layer is fast-weight and with what options (an AttentionPlan, built from the flags by
models/site_options.py): the layers know fairseq's interfaces and the options, not the flags.
"""
from fairseq.distributed import fsdp_wrap
from fairseq.models.transformer import TransformerDecoderBase, TransformerEncoderBase
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase

from .fast_weight_attention import FastWeightAttention


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
    def __init__(self, cfg, plan, dictionary, embed_tokens, no_encoder_attn=False):
        self.plan, self._layers_built = plan, 0
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        index, self._layers_built = self._layers_built, self._layers_built + 1
        return _wrap(FastWeightDecoderLayer(cfg, self.plan, index, no_encoder_attn=no_encoder_attn), cfg)
