"""Translation model `fwp_transformer`: fairseq's Transformer with fast-weight attention."""
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerModel
from fairseq.models.transformer.transformer_legacy import base_architecture, transformer_vaswani_wmt_en_de_big

from ..modules.transformer_layers import FastWeightTransformerDecoder, FastWeightTransformerEncoder
from .fast_weight_model import FastWeightModel
from .fwp_config import add_fwp_args, set_fwp_defaults, transformer_config, validate


@register_model("fwp_transformer")
class FastWeightTransformerModel(FastWeightModel, TransformerModel):
    """--fwp-feature-map softmax gives the unmodified Transformer, as a baseline in the same model."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        add_fwp_args(parser)

    @classmethod
    def build_model(cls, args, task):
        return cls.finish(super().build_model(args, task))

    # fairseq's SequenceGeneratorWithAlignment (--print-alignment, --replace-unk) reads a model's alignments from one
    # teacher-forced forward of each hypothesis where this is set (forward_align), else from the attention each
    # decoding step returned: fast-weight decoding steps return none, and that forward gives the layers' exact
    # weights (source_attention.py)
    full_context_alignment = True

    @property
    def supported_targets(self):
        """What a language-modelling task asks of its model: a translation model has none to give."""
        raise ValueError("this checkpoint is a translation model (fwp_transformer), which fairseq-eval-lm cannot "
                         "score: translate with fairseq-generate, or give eval-lm an fwp_transformer_lm checkpoint")

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return FastWeightTransformerEncoder(transformer_config(args), validate(args, stacks(args)), src_dict,
                                            embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = transformer_config(args)
        return FastWeightTransformerDecoder(cfg, validate(args, stacks(args)), tgt_dict, embed_tokens,
                                            no_encoder_attn=cfg.no_cross_attention)


# The paper's MT setting (Table 1): every attention fast-weight, sum rule,
# attention normalisation (Eq. 19; "auto" keeps it off for a delta-rule
# decoder) and sum normalisation (Eq. 29).
MT_DEFAULTS = dict(fwp_feature_map="linear", fwp_update_rule="sum", fwp_attn_norm="auto", fwp_qk_norm="sum")


def stacks(args):
    return {"encoder": args.encoder_layers, "decoder": args.decoder_layers}


@register_model_architecture("fwp_transformer", "fwp_transformer")
def fwp_transformer(args):
    """fairseq's `transformer` (base_architecture): every option the model was given, the rest its defaults;
    what a converted published model is saved as (uptraining/published_model.py)."""
    set_fwp_defaults(args, **MT_DEFAULTS)
    base_architecture(args)
    validate(args, stacks(args))


@register_model_architecture("fwp_transformer", "fwp_transformer_tiny")
def fwp_transformer_tiny(args):
    """A 2+2-layer model of width 64 for tests and the quickstart."""
    for side in ("encoder", "decoder"):
        setattr(args, f"{side}_embed_dim", getattr(args, f"{side}_embed_dim", 64))
        setattr(args, f"{side}_ffn_embed_dim", getattr(args, f"{side}_ffn_embed_dim", 128))
        setattr(args, f"{side}_layers", getattr(args, f"{side}_layers", 2))
        setattr(args, f"{side}_attention_heads", getattr(args, f"{side}_attention_heads", 4))
    set_fwp_defaults(args, **MT_DEFAULTS)
    base_architecture(args)
    validate(args, stacks(args))


@register_model_architecture("fwp_transformer", "fwp_transformer_wmt_en_de_big")
def fwp_transformer_wmt_en_de_big(args):
    """transformer_vaswani_wmt_en_de_big: 6+6 layers, 1024/4096, 16 heads (d_key = 64)."""
    set_fwp_defaults(args, **MT_DEFAULTS)
    transformer_vaswani_wmt_en_de_big(args)
    validate(args, stacks(args))
