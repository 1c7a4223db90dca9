"""Language model `fwp_transformer_lm`: fairseq's Transformer LM with fast-weight attention."""
import logging
from dataclasses import dataclass, field

from fairseq.dataclass import ChoiceEnum
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer_lm import (
    TransformerLanguageModel,
    TransformerLanguageModelConfig,
    base_lm_architecture,
)

from ..modules.transformer_layers import FastWeightTransformerDecoder
from .fast_weight_model import FastWeightModel
from .fwp_config import ON_OFF, FastWeightConfig, finish_parser, set_fwp_defaults, transformer_config, validate

logger = logging.getLogger(__name__)


@dataclass
class FastWeightLanguageModelConfig(TransformerLanguageModelConfig, FastWeightConfig):
    fwp_positions: ChoiceEnum(ON_OFF) = field(
        default="off", metadata={"help": "token positional embeddings (the paper's best LM has none)"})
    fwp_position_period: int = field(
        default=0, metadata={"help": "positions restart every N tokens (0: never), as fwp_stream_lm's segments "
                                      "restart them, so that the model reads and generates past its positions; "
                                      "fwp_stream_lm sets it to --tokens-per-sample for a model with positions"})


@register_model("fwp_transformer_lm", dataclass=FastWeightLanguageModelConfig)
class FastWeightTransformerLanguageModel(FastWeightModel, TransformerLanguageModel):
    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        finish_parser(parser)

    @classmethod
    def build_model(cls, args, task):
        plan = validate_lm(args)
        cls.settle_options(args)
        # fairseq's LM builder hard-codes its own decoder class; let it resolve
        # the (adaptive) input embeddings, then build the fast-weight decoder
        # around them. The throw-away decoder costs one extra initialisation.
        embed_tokens = super().build_model(args, task).decoder.embed_tokens
        decoder = FastWeightTransformerDecoder(transformer_config(args), plan, task.target_dictionary, embed_tokens,
                                               no_encoder_attn=True,
                                               position_period=getattr(args, "fwp_position_period", 0) or None)
        return cls.finish(cls(decoder))

    @classmethod
    def settle_options(cls, cfg):
        if cfg.fwp_positions == "off":  # the paper's LMs: no positional encoding
            cfg.no_token_positional_embeddings = True

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        drop_normformer_modules_not_in(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)


def validate_lm(args):
    """validate() of the LM's flags, and --fwp-position-period's: it needs positions, and at most as many as it
    numbers. Returns the AttentionPlan."""
    plan = validate(args, {"decoder": args.decoder_layers})
    period = getattr(args, "fwp_position_period", 0)
    if period:
        if args.fwp_positions == "off" or getattr(args, "no_token_positional_embeddings", False):
            raise ValueError(f"--fwp-position-period {period}: the model has no positions to restart (--fwp-positions "
                             "off, or --no-token-positional-embeddings)")
        # fairseq's LM takes --tokens-per-sample for positions not given when it builds the model
        positions = getattr(args, "max_target_positions", None) or getattr(args, "tokens_per_sample", None)
        if positions is not None and period > positions:
            raise ValueError(f"--fwp-position-period {period} is more than the model's {positions} positions "
                             "(--max-target-positions)")
    return plan


NORMFORMER_MODULES = ("attn_ln", "ffn_layernorm", "c_attn", "w_resid")  # --scale-attn, -fc, -heads, -resids


def drop_normformer_modules_not_in(model, state_dict):
    """A checkpoint trained while fairseq-train built no NormFormer modules despite --scale-* (its config
    says them, its weights lack them) loads without them, computing as it was trained."""
    dropped = []
    for index, layer in enumerate(model.decoder.layers):
        for name in NORMFORMER_MODULES:
            prefix = f"decoder.layers.{index}.{name}"
            if getattr(layer, name, None) is not None and not any(key.startswith(prefix) for key in state_dict):
                setattr(layer, name, None)
                dropped.append(name)
    if dropped:
        logger.warning(f"the checkpoint has no NormFormer {', '.join(sorted(set(dropped)))} although its config asks "
                       "for them (written while fairseq-train dropped --scale-*): loaded without them, as trained")

# The paper's best LM (Tables 2-3): Delta Net = linear phi + delta rule, sum
# normalisation, no attention normalisation, no positional encoding.
LM_DEFAULTS = dict(fwp_feature_map="linear", fwp_update_rule="delta", fwp_attn_norm="off", fwp_qk_norm="sum")


def _lm_defaults(args, layers, dim, heads, ffn):
    args.decoder_layers = getattr(args, "decoder_layers", layers)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", dim)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", heads)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", ffn)
    if getattr(args, "fwp_positions", None) is None:
        args.fwp_positions = "off"
    set_fwp_defaults(args, **LM_DEFAULTS)


def _wiki103_defaults(args):
    """Adaptive softmax/input over the 267K-word WikiText-103 vocabulary, tied."""
    args.dropout = getattr(args, "dropout", 0.1)
    args.adaptive_softmax_cutoff = getattr(args, "adaptive_softmax_cutoff", "20000,40000,200000")
    args.adaptive_input = getattr(args, "adaptive_input", True)
    args.adaptive_input_cutoff = getattr(args, "adaptive_input_cutoff", "20000,40000,200000")
    args.adaptive_input_factor = getattr(args, "adaptive_input_factor", 4)
    args.adaptive_softmax_factor = getattr(args, "adaptive_softmax_factor", 4)
    args.tie_adaptive_weights = getattr(args, "tie_adaptive_weights", True)


@register_model_architecture("fwp_transformer_lm", "fwp_lm_tiny")
def fwp_lm_tiny(args):
    """2 layers of width 64, for tests and the quickstart."""
    _lm_defaults(args, layers=2, dim=64, heads=4, ffn=128)
    base_lm_architecture(args)
    validate_lm(args)


@register_model_architecture("fwp_transformer_lm", "fwp_lm_wiki103_small")
def fwp_lm_wiki103_small(args):
    """Paper's small config: 16 layers, D = 128, 8 heads, FFN 2048 (train with --tokens-per-sample 256)."""
    _lm_defaults(args, layers=16, dim=128, heads=8, ffn=2048)
    _wiki103_defaults(args)
    base_lm_architecture(args)
    validate_lm(args)


@register_model_architecture("fwp_transformer_lm", "fwp_lm_wiki103_medium")
def fwp_lm_wiki103_medium(args):
    """Paper's medium config: 16 layers, D = 256, 8 heads, FFN 2048 (train with --tokens-per-sample 384)."""
    _lm_defaults(args, layers=16, dim=256, heads=8, ffn=2048)
    _wiki103_defaults(args)
    base_lm_architecture(args)
    validate_lm(args)
