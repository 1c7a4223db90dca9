"""The --fwp-* flags: one dataclass, shared by the translation and LM models, and validate(cfg).

Every flag is a dataclass field (fairseq silently drops LM flags that are
not), and every invalid value fails at argument parsing with a message that
names the flag and the allowed values: --fwp-feature-map and
--fwp-update-rule take the names registered when the arguments are parsed
(register_feature_map, register_update_rule; a user's --user-dir registers
before). Every rule that combines flags is checked by ``validate``, which
each architecture runs when fairseq parses the arguments (and applies it to
a loaded checkpoint's config), and which returns the AttentionPlan the model
is built from (site_options.py); its messages name the flags. docs/flags.md
lists the flags and the rules.
"""
import argparse
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models.transformer import TransformerConfig
from omegaconf import OmegaConf

from ..modules.attention_options import DECODING_STEPS
from ..modules.feature_maps import FEATURE_MAPS, QK_NORMS
from ..modules.gates import DECAY_FORMS
from ..ops import BACKENDS
from ..ops.rules import UPDATE_RULES
from .site_options import SITES, attention_plan

logger = logging.getLogger(__name__)

ON_OFF = ("on", "off")
AUTO_ON_OFF = ("auto", "on", "off")
AUTO_QK_NORMS = ("auto",) + QK_NORMS


@dataclass
class FastWeightConfig(FairseqDataclass):
    # Choices: the registered names when the arguments are parsed (finish_parser), a user's included.
    fwp_feature_map: str = field(
        default="linear", metadata={"help": "phi of the fast-weight attention; softmax = unmodified fairseq attention"})
    fwp_update_rule: str = field(
        default="sum", metadata={"help": "programming instruction of the decoder self-attention; gated-sum and "
                                          "gated-delta scale the memory by a decay a_t from the layer input"})
    fwp_decay_form: ChoiceEnum(("auto",) + DECAY_FORMS) = field(
        default="auto", metadata={"help": "the gated rules' a_t: mamba2 (exp(-A softplus(w.x + dt)), Gated "
                                           "DeltaNet, KDA) or logsigmoid (exp(logsigmoid(w.x + b) / 16), GLA); "
                                           "auto: the rule's paper's (logsigmoid for gla, else mamba2)"})
    fwp_qk_norm: ChoiceEnum(QK_NORMS) = field(
        default="sum", metadata={"help": "how phi(q), phi(k) are normalised at every fast-weight site: sum "
                                          "(Eq. 29), l2 (DeltaNet; with --fwp-feature-map silu) or none"})
    fwp_decoder_qk_norm: ChoiceEnum(AUTO_QK_NORMS) = field(
        default="auto", metadata={"help": "the decoder self-attention's own setting; auto: as --fwp-qk-norm, "
                                           "except that a delta rule, whose keys must be normalised, takes sum (l2 "
                                           "for silu features) where that is none"})
    fwp_short_conv: int = field(
        default=0, metadata={"help": "kernel size of a short causal depthwise convolution on the decoder "
                                      "self-attention's q, k, v projections (0 = none; DeltaNet uses 4)"})
    fwp_output_gate: ChoiceEnum(ON_OFF) = field(
        default="off", metadata={"help": "RMS-normalise each head's output and multiply by SiLU of a gate "
                                          "projection of the layer input (Gated DeltaNet)"})
    fwp_householder_steps: int = field(
        default=1, metadata={"help": "writes per token of the decoder's delta rule (DeltaProduct, Siems et al. 2025): "
                                      "N keys, values and write strengths from N projections, in order (1 = the delta "
                                      "rule)"})
    fwp_negative_eigenvalues: ChoiceEnum(ON_OFF) = field(
        default="off", metadata={"help": "beta = 2 sigmoid(.) for the delta rules, so that each write's transition "
                                          "I - beta k k^T has eigenvalues in [-1, 1] (Grazzi et al. 2024): state "
                                          "tracking such as parity"})
    fwp_softmax_layers: str = field(
        default="", metadata={"help": "comma-separated indices (from 0) of the layers that keep softmax "
                                       "attention: a hybrid stack, e.g. 3,7"})
    fwp_dpfp_nu: int = field(default=1, metadata={"help": "DPFP capacity nu (>= 1): D = 2 * head_dim * nu"})
    fwp_performer_features: int = field(
        default=0, metadata={"help": "FAVOR+ random features m (>= 1; 0 = head_dim): D = 2m"})
    fwp_performer_redraw: int = field(
        default=1, metadata={"help": "FAVOR+: new random features every N training forwards (1 = every "
                                      "mini-batch, as the paper; 0 = never)"})
    fwp_performer_scaling: ChoiceEnum(ON_OFF) = field(
        default="on", metadata={"help": "FAVOR+: scale q and k by head_dim^-1/4 first, so that the features "
                                         "estimate softmax attention's kernel exp(q.k/sqrt(d)) (off: the paper's "
                                         "Eqs. 31-32 as written; 5-7 BLEU lower on Multi30k, docs/results.md)"})
    fwp_backend: ChoiceEnum(BACKENDS) = field(default="auto", metadata={"help": "fast-weight op backend"})
    fwp_decoding_step: ChoiceEnum(DECODING_STEPS) = field(
        default="auto", metadata={"help": "which step decodes each token: fused (one call of the csrc extension per "
                                           "layer, where it computes what the rule's own step does), own (the "
                                           "rule's own step), auto (fused, except in beams on a GPU, where it has "
                                           "not been timed)"})
    fwp_sum_norm: Optional[ChoiceEnum(ON_OFF)] = field(
        default=None, metadata={"help": "deprecated: --fwp-qk-norm says it (--fwp-sum-norm off is --fwp-qk-norm "
                                         "none, on any other value)"})
    fwp_attn_norm: ChoiceEnum(AUTO_ON_OFF) = field(
        default="auto", metadata={"help": "divide outputs by z_t . phi(q_t) (Eqs. 19, 26-28) at every fast-weight "
                                           "site; auto: on for the sum rule (Table 1), off for the others"})
    fwp_decoder_attn_norm: ChoiceEnum(AUTO_ON_OFF) = field(
        default="auto", metadata={"help": "the decoder self-attention's own setting; auto: as --fwp-attn-norm"})
    fwp_output_scaling: ChoiceEnum(ON_OFF) = field(
        default="off", metadata={"help": "multiply attention outputs by 1/sqrt(head_dim)"})
    fwp_sites: ChoiceEnum(SITES) = field(
        default="all", metadata={"help": "which attentions become fast-weight: all, self (encoder and decoder "
                                          "self-attention), decoder-self"})


def _at_least(minimum):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value
    return parse


def _kernel_size(text):
    value = _at_least(0)(text)
    if value == 1:
        raise argparse.ArgumentTypeError("expected 0 (none) or a kernel size >= 2, got 1")
    return value


def _layer_list(text):
    """Comma-separated layer indices; returned as given, checked here."""
    if text.strip() and not all(part.strip().isdigit() for part in text.split(",")):
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices such as 3,7, got {text!r}")
    return text


class GivenOnCommandLine(str):
    """A value of the deprecated --fwp-sum-norm as typed on a command line: it is read as the user means it
    now, where a stored config's value is read as the code that stored it computed it (upgrade_sum_norm)."""


def registered_choices():
    """--fwp-feature-map's and --fwp-update-rule's choices: what is registered now."""
    return {"fwp_feature_map": ["softmax", *FEATURE_MAPS], "fwp_update_rule": list(UPDATE_RULES)}


def finish_parser(parser):
    """Give --fwp-feature-map and --fwp-update-rule the registered names as choices, make the integer flags
    reject out-of-range values at parse time, and mark --fwp-sum-norm's values as given on the command line."""
    checks = {"fwp_dpfp_nu": _at_least(1), "fwp_performer_features": _at_least(0),
              "fwp_performer_redraw": _at_least(0), "fwp_short_conv": _kernel_size, "fwp_householder_steps": _at_least(1),
              "fwp_position_period": _at_least(0),
              "fwp_softmax_layers": _layer_list, "fwp_sum_norm": GivenOnCommandLine}
    choices = registered_choices()
    for action in parser._actions:
        if action.dest in checks:
            action.type = checks[action.dest]
        if action.dest in choices:
            action.choices = choices[action.dest]


def add_fwp_args(parser):
    """The --fwp-* flags for an argparse-based (legacy) model."""
    gen_parser_from_dataclass(parser, FastWeightConfig(), delete_default=True)
    finish_parser(parser)


def upgrade_sum_norm(cfg):
    """Moves the deprecated --fwp-sum-norm into --fwp-qk-norm and --fwp-decoder-qk-norm (then None).

    Typed on a command line (GivenOnCommandLine), it means what it says now, with a warning: off is
    --fwp-qk-norm none, on any other value; an explicit --fwp-qk-norm that says otherwise stops the run,
    naming both. In a stored config (a checkpoint written while it was a flag of its own), it means what
    that code computed: off left phi(q), phi(k) unnormalised everywhere except at a delta rule's decoder
    self-attention, which kept --fwp-qk-norm's normalisation.
    """
    old = getattr(cfg, "fwp_sum_norm", None)
    if old is None:
        return
    cfg.fwp_sum_norm = None
    if isinstance(old, GivenOnCommandLine):
        logger.warning("--fwp-sum-norm is deprecated: --fwp-qk-norm says how phi(q), phi(k) are normalised "
                       "(--fwp-sum-norm off is --fwp-qk-norm none, on any other value)")
        given = getattr(cfg, "fwp_qk_norm", None)
        if given is not None and (given == "none") != (old == "off"):
            raise ValueError(f"--fwp-sum-norm {old} disagrees with --fwp-qk-norm {given}: give --fwp-qk-norm alone "
                             "(--fwp-sum-norm is deprecated; to keep only a delta rule's keys normalised, as "
                             "--fwp-sum-norm off did, give --fwp-qk-norm none --fwp-decoder-qk-norm sum or l2)")
        if old == "off":
            cfg.fwp_qk_norm = "none"
        return
    if old == "off":
        if UPDATE_RULES[str(cfg.fwp_update_rule)].normalised_keys and getattr(cfg, "fwp_decoder_qk_norm", None) in (
                None, "auto"):
            cfg.fwp_decoder_qk_norm = str(cfg.fwp_qk_norm)
        cfg.fwp_qk_norm = "none"


def validate(cfg, stacks):
    """Every rule that combines --fwp-* flags; raises ValueError naming the flags. stacks: {"encoder":
    layer count, "decoder": layer count} of the model (the LM has a decoder only). Returns the model's
    AttentionPlan (site_options.py)."""
    upgrade_sum_norm(cfg)  # configs built in code, which no architecture function saw
    for dest, choices in registered_choices().items():
        value = str(getattr(cfg, dest))
        if value not in choices:
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{flag} {value}: not registered (registered: {', '.join(choices)}); one of your own is "
                             "registered by the --user-dir that defines it, which the command must name too")
    return attention_plan(cfg, stacks)


def set_fwp_defaults(args, **overrides):
    """Fill unset --fwp-* values: first the arch's overrides, then the dataclass defaults (after the
    deprecated --fwp-sum-norm is upgraded: it must see which values were given)."""
    upgrade_sum_norm(args)
    for name, f in FastWeightConfig.__dataclass_fields__.items():
        if getattr(args, name, None) is None:
            setattr(args, name, overrides.get(name, f.default))


def transformer_config(args):
    """fairseq's TransformerConfig of a model's args (a Namespace or a DictConfig), with the options it has no
    field for: fairseq's from_namespace keeps those of a Namespace only, so under fairseq-train (a
    DictConfig) NormFormer's --scale-attn, --scale-fc, --scale-heads and --scale-resids, which its layers
    read from there, were silently dropped."""
    if OmegaConf.is_config(args):
        args = argparse.Namespace(**OmegaConf.to_container(args, resolve=True))
    return TransformerConfig.from_namespace(args)


def writable(cfg):
    """A context in which `cfg` (a model's arguments: a DictConfig, or a legacy Namespace) takes new options."""
    from omegaconf import open_dict

    return open_dict(cfg) if OmegaConf.is_config(cfg) else contextlib.nullcontext()
