"""fairseq Transformer layers whose attention hooks build FastWeightAttention.

Each layer overrides only the attention builders; everything else is
fairseq's. ``fwp`` holds the --fwp-* values (models/fwp_config.py).
"""
from fairseq.distributed import fsdp_wrap
from fairseq.models.transformer import TransformerDecoderBase, TransformerEncoderBase
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase

from .attention_rules import DELTA_RULES
from .fast_weight_attention import FastWeightAttention

# Which attentions --fwp-sites replaces.
SITES = ("all", "self", "decoder-self")


class FastWeightEncoderLayer(TransformerEncoderLayerBase):
    def __init__(self, cfg, fwp, index, return_fc=False):
        self.fwp, self.index = fwp, index  # read by build_self_attention inside the base __init__
        super().__init__(cfg, return_fc=return_fc)

    def build_self_attention(self, embed_dim, cfg):
        if not uses_fast_weights(self.fwp, "encoder-self", self.index):
            return super().build_self_attention(embed_dim, cfg)
        return build_fast_weight_attention(self.fwp, "encoder-self", embed_dim, cfg.encoder.attention_heads)


class FastWeightDecoderLayer(TransformerDecoderLayerBase):
    def __init__(self, cfg, fwp, index, no_encoder_attn=False):
        self.fwp, self.index = fwp, index
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if not uses_fast_weights(self.fwp, "decoder-self", self.index):
            return super().build_self_attention(embed_dim, cfg, add_bias_kv, add_zero_attn)
        return build_fast_weight_attention(self.fwp, "decoder-self", embed_dim, cfg.decoder.attention_heads)

    def build_encoder_attention(self, embed_dim, cfg):
        if not uses_fast_weights(self.fwp, "cross", self.index):
            return super().build_encoder_attention(embed_dim, cfg)
        return build_fast_weight_attention(self.fwp, "cross", embed_dim, cfg.decoder.attention_heads,
                                           kdim=cfg.encoder.embed_dim)


def softmax_layers(cfg):
    """The layer indices of --fwp-softmax-layers ("3,7"; checked at parse time)."""
    return {int(part) for part in cfg.fwp_softmax_layers.split(",") if part.strip()}


def uses_fast_weights(cfg, site, index):
    """site: "encoder-self", "decoder-self" or "cross"; index: the layer's, from 0 (--fwp-softmax-layers)."""
    if cfg.fwp_feature_map == "softmax" or index in softmax_layers(cfg):
        return False
    return {"all": True, "self": site != "cross", "decoder-self": site == "decoder-self"}[cfg.fwp_sites]


def layer_options(cfg, site, embed_dim, num_heads):
    """The FastWeightAttention arguments of a site ("encoder-self", "decoder-self" or "cross") from the
    --fwp-* values in cfg: how each flag reaches the layer.

    FAVOR+ seeds come from torch's RNG, which fairseq seeds with --seed before
    building the model: every layer differs, every run and rank agrees.
    """
    name = str(cfg.fwp_feature_map)  # fairseq's dataclass choices are enums
    causal = site == "decoder-self"
    options = {}
    if name == "dpfp":
        options["nu"] = cfg.fwp_dpfp_nu
    elif name == "performer":
        options.update(num_features=cfg.fwp_performer_features or embed_dim // num_heads,
                       redraw_interval=cfg.fwp_performer_redraw, input_scaling=cfg.fwp_performer_scaling == "on")
    rule = str(cfg.fwp_update_rule) if causal else "sum"  # the rule programs the decoder self-attention
    return dict(
        embed_dim=embed_dim, num_heads=num_heads, causal=causal, feature_map=name, feature_map_options=options,
        update_rule=rule, qk_norm=qk_normalization(cfg, causal, rule),
        attention_normalization=attention_normalization(cfg, causal, rule),
        output_scaling=cfg.fwp_output_scaling == "on", decay_form=str(cfg.fwp_decay_form),
        short_conv=cfg.fwp_short_conv if causal else 0, output_gate=cfg.fwp_output_gate == "on",
        backend=str(cfg.fwp_backend))


def build_fast_weight_attention(cfg, site, embed_dim, num_heads, kdim=None):
    """A FastWeightAttention for `site`, configured from the --fwp-* values in cfg."""
    return FastWeightAttention(**layer_options(cfg, site, embed_dim, num_heads), kdim=kdim, vdim=kdim)


def qk_normalization(cfg, decoder_self, rule):
    """--fwp-decoder-qk-norm for the decoder self-attention (when not auto), else --fwp-qk-norm.

    auto: as --fwp-qk-norm, except that a delta rule takes sum (Eq. 29; l2 for signed silu features) where
    that is none: its keys must be normalised, or the recurrence diverges.
    """
    if decoder_self and cfg.fwp_decoder_qk_norm != "auto":
        return str(cfg.fwp_decoder_qk_norm)
    value = str(cfg.fwp_qk_norm)
    if decoder_self and value == "none" and rule in DELTA_RULES:
        return "l2" if str(cfg.fwp_feature_map) == "silu" else "sum"
    return value


def attention_normalization(cfg, decoder_self, rule):
    """--fwp-decoder-attn-norm for the decoder self-attention (when not auto), else --fwp-attn-norm.

    auto: on for the sum rule with positive features (the paper's Table 1), off for the other rules
    (the delta rule's default in the paper's LMs; the gated rules use the output gate) and for signed
    (silu) features, whose sums can be zero.
    """
    value = cfg.fwp_attn_norm
    if decoder_self and cfg.fwp_decoder_attn_norm != "auto":
        value = cfg.fwp_decoder_attn_norm
    if value == "auto":
        return rule == "sum" and str(cfg.fwp_feature_map) != "silu"
    return value == "on"


def _wrap(layer, cfg):
    """fairseq's activation checkpointing and FSDP wrapping of a layer."""
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)


class FastWeightTransformerEncoder(TransformerEncoderBase):
    def __init__(self, cfg, fwp, dictionary, embed_tokens):
        self.fwp, self._layers_built = fwp, 0
        super().__init__(cfg, dictionary, embed_tokens)

    def build_encoder_layer(self, cfg):
        index, self._layers_built = self._layers_built, self._layers_built + 1  # fairseq builds them in order
        return _wrap(FastWeightEncoderLayer(cfg, self.fwp, index, return_fc=self.return_fc), cfg)


class FastWeightTransformerDecoder(TransformerDecoderBase):
    def __init__(self, cfg, fwp, dictionary, embed_tokens, no_encoder_attn=False):
        self.fwp, self._layers_built = fwp, 0
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        index, self._layers_built = self._layers_built, self._layers_built + 1
        return _wrap(FastWeightDecoderLayer(cfg, self.fwp, index, no_encoder_attn=no_encoder_attn), cfg)
