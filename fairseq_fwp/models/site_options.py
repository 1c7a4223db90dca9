"""How the --fwp-* flags reach the layers: one AttentionOptions per attention site, built once.

A model has up to three attention sites: the encoder's self-attention ("encoder-self"), the decoder's
("decoder-self", the causal one that the update rule programs) and the decoder's attention to the encoder
("cross"). ``attention_plan(cfg, stacks)`` builds the options of each site the model uses from the flags
(with the site's real widths, so that a feature map's options are checked for its head size) and says
which layers keep softmax attention; the layers ask it for theirs (plan.options_for). A site's options
that cannot be are refused here, in the words of the flags that set them.
"""
import dataclasses
from typing import Dict, FrozenSet

from ..modules.attention_options import AttentionOptions, OptionsError
from ..modules.feature_maps import feature_map_class
from ..ops.rules import UPDATE_RULES

# Which attentions --fwp-sites replaces.
SITES = ("all", "self", "decoder-self")
# The flags that set each built-in feature map's options (a map of your own takes its defaults).
FEATURE_MAP_FLAGS = {
    "dpfp": {"nu": "fwp_dpfp_nu"},
    "performer": {"num_features": "fwp_performer_features", "redraw_interval": "fwp_performer_redraw",
                  "input_scaling": "fwp_performer_scaling"},
}
# How validate's messages name each option: the flag that sets it.
FLAG_OF_OPTION = {"feature_map": "--fwp-feature-map", "short_conv": "--fwp-short-conv", "decay_form": "--fwp-decay-form",
                  "householder_steps": "--fwp-householder-steps", "backend": "--fwp-backend",
                  "decoding_step": "--fwp-decoding-step"}


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """The options of each fast-weight site, and the layers (from 0) that keep softmax attention."""

    options: Dict[str, AttentionOptions]
    softmax_layers: FrozenSet[int]

    def options_for(self, site, index):
        """The AttentionOptions of `site` in layer `index`, or None where the layer keeps softmax attention."""
        return None if index in self.softmax_layers else self.options.get(site)


def softmax_layers(cfg):
    """The layer indices of --fwp-softmax-layers ("3,7"; checked at parse time)."""
    return frozenset(int(part) for part in cfg.fwp_softmax_layers.split(",") if part.strip())


def uses_fast_weights(cfg, site):
    if cfg.fwp_feature_map == "softmax":
        return False
    return {"all": True, "self": site != "cross", "decoder-self": site == "decoder-self"}[cfg.fwp_sites]


def _on(value):
    """A flag of on/off as a bool; other values as they are."""
    return {"on": True, "off": False}.get(value, value)


def site_options(cfg, site):
    """The AttentionOptions of `site` ("encoder-self", "decoder-self" or "cross") from the --fwp-* values in
    cfg, unchecked (attention_plan checks them). FAVOR+ seeds come from torch's RNG, which fairseq seeds with
    --seed before building the model: every layer differs, every run and rank agrees."""
    side = "encoder" if site == "encoder-self" else "decoder"
    embed_dim, num_heads = getattr(cfg, f"{side}_embed_dim"), getattr(cfg, f"{side}_attention_heads")
    name = cfg.fwp_feature_map
    map_options = {option: _on(getattr(cfg, flag)) for option, flag in FEATURE_MAP_FLAGS.get(name, {}).items()}
    if name == "performer" and not map_options["num_features"]:
        map_options["num_features"] = embed_dim // num_heads  # --fwp-performer-features 0: head_dim
    causal = site == "decoder-self"
    rule = str(cfg.fwp_update_rule) if causal else "sum"  # the rule programs the decoder self-attention
    writes = cfg.fwp_householder_steps if causal else 1
    if writes > 1 and UPDATE_RULES[rule].product:
        rule = UPDATE_RULES[rule].product  # DeltaProduct: the rule's form with several writes per token
    return dict(
        embed_dim=embed_dim, num_heads=num_heads, causal=causal,
        kdim=cfg.encoder_embed_dim if site == "cross" else None, feature_map=name, feature_map_options=map_options,
        update_rule=rule, qk_norm=qk_normalization(cfg, causal, rule),
        attention_normalization=attention_normalization(cfg, causal, rule), output_scaling=_on(cfg.fwp_output_scaling),
        decay_form=UPDATE_RULES[rule].decay_form if cfg.fwp_decay_form == "auto" else cfg.fwp_decay_form,
        short_conv=cfg.fwp_short_conv if causal else 0,
        output_gate=_on(cfg.fwp_output_gate), backend=cfg.fwp_backend, decoding_step=cfg.fwp_decoding_step,
        householder_steps=writes,
        negative_eigenvalues=causal and _on(cfg.fwp_negative_eigenvalues))


def signed_features(cfg):
    """Whether --fwp-feature-map's features can be negative (FeatureMap.signed)."""
    return feature_map_class(cfg.fwp_feature_map).signed


def qk_normalization(cfg, decoder_self, rule):
    """--fwp-decoder-qk-norm for the decoder self-attention (when not auto), else --fwp-qk-norm.

    auto: as --fwp-qk-norm, except that a rule that needs normalised keys takes sum (Eq. 29; l2 for signed
    features, and for negative eigenvalues, which need unit keys) where that is none: unnormalised keys
    would make it diverge.
    """
    if decoder_self and cfg.fwp_decoder_qk_norm != "auto":
        return cfg.fwp_decoder_qk_norm
    value = cfg.fwp_qk_norm
    if decoder_self and value == "none" and UPDATE_RULES[rule].normalised_keys:
        return "l2" if signed_features(cfg) or _on(cfg.fwp_negative_eigenvalues) else "sum"
    return value


def attention_normalization(cfg, decoder_self, rule):
    """--fwp-decoder-attn-norm for the decoder self-attention (when not auto), else --fwp-attn-norm.

    auto: on for the sum rule with positive features (the paper's Table 1), off for the other rules
    (the delta rule's default in the paper's LMs; the gated rules use the output gate) and for signed
    features (silu, FeatureMap.signed), whose sums can be zero.
    """
    value = cfg.fwp_attn_norm
    if decoder_self and cfg.fwp_decoder_attn_norm != "auto":
        value = cfg.fwp_decoder_attn_norm
    if value == "auto":
        return rule == "sum" and not signed_features(cfg)
    return value == "on"


def attention_plan(cfg, stacks):
    """The model's AttentionPlan; stacks: {"encoder": layer count, "decoder": layer count} (the LM has a
    decoder only). Raises ValueError naming the flags."""
    layers = softmax_layers(cfg)
    for index in sorted(layers):
        if all(index >= count for count in stacks.values()):
            counts = " and ".join(f"{count} {name} layers" for name, count in stacks.items())
            raise ValueError(f"--fwp-softmax-layers {cfg.fwp_softmax_layers}: layer {index} does not exist "
                             f"(the model has {counts}, counted from 0)")
    sites = ["decoder-self"] + (["encoder-self", "cross"] if "encoder" in stacks else [])
    plan = {}
    for site in sites:
        side_layers = stacks["encoder" if site == "encoder-self" else "decoder"]
        if not uses_fast_weights(cfg, site) or all(index in layers for index in range(side_layers)):
            continue
        try:
            plan[site] = AttentionOptions(**site_options(cfg, site))
        except OptionsError as err:
            raise ValueError(err.render(lambda name, value: _flag(cfg, site, name, value))) from None
    if "decoder-self" in plan and getattr(cfg, "cross_self_attention", False):
        raise ValueError(f"--cross-self-attention with --fwp-feature-map {cfg.fwp_feature_map}: fairseq's cross-self-"
                         "attention gives the decoder self-attention the source beside the target, and a fast weight "
                         "written one target token at a time has no place for it (leave it out, or keep the decoder "
                         "layers' softmax attention: --fwp-softmax-layers)")
    return AttentionPlan(plan, layers)


def _flag(cfg, site, name, value):
    """How a message names option `name` (with `value`) of `site`: the flag that sets it."""
    side = "encoder" if site == "encoder-self" else "decoder"
    decoder_self = site == "decoder-self"
    if name == "qk_norm":
        explicit = decoder_self and cfg.fwp_decoder_qk_norm != "auto"
        return f"--fwp-decoder-qk-norm {value}" if explicit else f"--fwp-qk-norm {cfg.fwp_qk_norm}"
    if name == "attention_normalization":
        flag = "--fwp-decoder-attn-norm" if decoder_self and cfg.fwp_decoder_attn_norm != "auto" else "--fwp-attn-norm"
        return (f"{flag} {getattr(cfg, flag[2:].replace('-', '_'))} (attention normalisation "
                f"{'on' if value else 'off'} at the {site} attention)")
    if name == "causal":
        return f"the {site} attention"
    if name == "update_rule":
        return f"--fwp-update-rule {cfg.fwp_update_rule}" if decoder_self else f"the {site} attention's rule {value}"
    if name == "negative_eigenvalues":
        return f"--fwp-negative-eigenvalues {cfg.fwp_negative_eigenvalues}"
    if name.startswith("feature_map_options."):
        flag = FEATURE_MAP_FLAGS[cfg.fwp_feature_map][name.split(".", 1)[1]]
        return f"--{flag.replace('_', '-')} {getattr(cfg, flag)} at the {site} attention"
    if name in ("embed_dim", "num_heads"):
        return f"--{side}-{'embed-dim' if name == 'embed_dim' else 'attention-heads'} {value}"
    return f"{FLAG_OF_OPTION[name]} {value}"
