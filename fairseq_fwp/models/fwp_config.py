"""The --fwp-* flags: one dataclass, shared by the translation and LM models.

Every flag is a dataclass field (fairseq silently drops LM flags that are
not), and every invalid value fails at argument parsing with a message that
names the flag and the allowed values.
"""
import argparse
from dataclasses import dataclass, field

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass

from ..modules.feature_maps import FEATURE_MAPS
from ..modules.transformer_layers import SITES
from ..modules.fast_weight_attention import UPDATE_RULES
from ..ops import BACKENDS

ATTENTION_KINDS = ("softmax",) + FEATURE_MAPS
ON_OFF = ("on", "off")
AUTO_ON_OFF = ("auto", "on", "off")


@dataclass
class FastWeightConfig(FairseqDataclass):
    fwp_feature_map: ChoiceEnum(ATTENTION_KINDS) = field(
        default="linear", metadata={"help": "phi of the fast-weight attention; softmax = unmodified fairseq attention"})
    fwp_update_rule: ChoiceEnum(UPDATE_RULES) = field(
        default="sum", metadata={"help": "programming instruction of the decoder self-attention"})
    fwp_dpfp_nu: int = field(default=1, metadata={"help": "DPFP capacity nu (>= 1): D = 2 * head_dim * nu"})
    fwp_performer_features: int = field(
        default=0, metadata={"help": "FAVOR+ random features m (>= 1; 0 = head_dim): D = 2m"})
    fwp_performer_redraw: int = field(
        default=1, metadata={"help": "FAVOR+: new random features every N training forwards (1 = every "
                                      "mini-batch, as the paper; 0 = never)"})
    fwp_performer_scaling: ChoiceEnum(ON_OFF) = field(
        default="off", metadata={"help": "FAVOR+: scale q and k by head_dim^-1/4 first, so that the features "
                                          "estimate softmax attention's kernel exp(q.k/sqrt(d))"})
    fwp_backend: ChoiceEnum(BACKENDS) = field(default="auto", metadata={"help": "fast-weight op backend"})
    fwp_sum_norm: ChoiceEnum(ON_OFF) = field(
        default="on", metadata={"help": "divide phi(q), phi(k) by their sums (Eq. 29); always on for delta"})
    fwp_attn_norm: ChoiceEnum(AUTO_ON_OFF) = field(
        default="auto", metadata={"help": "divide outputs by z_t . phi(q_t) (Eqs. 19, 26-28) at every fast-weight "
                                           "site; auto: on for the sum rule (Table 1), off for the delta rule"})
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


def tighten_arg_types(parser):
    """Make the integer flags reject out-of-range values at parse time."""
    checks = {"fwp_dpfp_nu": _at_least(1), "fwp_performer_features": _at_least(0),
              "fwp_performer_redraw": _at_least(0)}
    for action in parser._actions:
        if action.dest in checks:
            action.type = checks[action.dest]


def add_fwp_args(parser):
    """The --fwp-* flags for an argparse-based (legacy) model."""
    gen_parser_from_dataclass(parser, FastWeightConfig(), delete_default=True)
    tighten_arg_types(parser)


def set_fwp_defaults(args, **overrides):
    """Fill unset --fwp-* values: first the arch's overrides, then the dataclass defaults."""
    for name, f in FastWeightConfig.__dataclass_fields__.items():
        if getattr(args, name, None) is None:
            setattr(args, name, overrides.get(name, f.default))


def fast_weight_options(args):
    """The --fwp-* values of args (a Namespace or a DictConfig) as a plain namespace."""
    return argparse.Namespace(**{name: getattr(args, name) for name in FastWeightConfig.__dataclass_fields__})
