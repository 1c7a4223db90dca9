"""How two model configs would compute differently: the options that define what a Transformer computes
beyond its attention, and the --fwp-* options (a conversion refuses the first; fairseq-train's
--finetune-from-model warns of both: compat.py)."""
import dataclasses

# The model options that define what a Transformer computes (beyond its attention), as fairseq names
# them: two models that differ in one of them are different models, even where every parameter has
# the same shape (2 or 4 heads over the same projections; pre- or post-norm layers).
COMPUTATION_FIELDS = (
    "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
    "encoder_embed_dim", "decoder_embed_dim", "encoder_ffn_embed_dim", "decoder_ffn_embed_dim",
    "decoder_input_dim", "decoder_output_dim", "activation_fn",
    "encoder_normalize_before", "decoder_normalize_before", "no_decoder_final_norm", "layernorm_embedding",
    "no_scale_embedding", "no_token_positional_embeddings", "encoder_learned_pos", "decoder_learned_pos",
    "share_all_embeddings", "share_decoder_input_output_embed", "adaptive_input", "adaptive_input_factor",
    "adaptive_input_cutoff", "adaptive_softmax_cutoff", "adaptive_softmax_factor", "tie_adaptive_weights",
    "tie_adaptive_proj", "character_embeddings", "cross_self_attention", "no_cross_attention",
)


def computation_differences(source, target, labels=("softmax", "fast-weight")):
    """``name: softmax X, fast-weight Y`` (or other labels) for every COMPUTATION_FIELDS option the two model
    configs set differently (options one of them lacks are skipped; unset counts as off; a number typed on a
    command line, which some of fairseq's options keep as its text, equals the number, and 4 equals 4.0)."""
    def value(cfg, name):
        x = getattr(cfg, name, None)
        return str(False if x is None else x)

    def number_or_text(text):
        try:
            return float(text)
        except ValueError:
            return text

    missing = object()
    return [f"{name}: {labels[0]} {value(source, name)}, {labels[1]} {value(target, name)}" for name in COMPUTATION_FIELDS
            if getattr(source, name, missing) is not missing and getattr(target, name, missing) is not missing
            and number_or_text(value(source, name)) != number_or_text(value(target, name))]


def model_differences(saved, model):
    """computation_differences, and every --fwp-* option the two configs set differently: how a model saved
    (a conversion) and the one a command builds would compute differently although their parameters fit. An
    option a config lacks (saved before the flag existed) counts as the flag's default, which computes as
    the code before it did."""
    from ..models.fwp_config import FastWeightConfig
    from ..ops.rules import update_rule

    defaults = {field.name: field.default for field in dataclasses.fields(FastWeightConfig)}
    # fwp_position_period is not compared: fwp_stream_lm sets it on every positional model it trains (positions
    # restart in each segment), and within a segment of its period the model computes as without it
    names = sorted({name for cfg in (saved, model) for name in (cfg.keys() if hasattr(cfg, "keys") else vars(cfg))
                    if name.startswith("fwp_") and name not in ("fwp_sum_norm", "fwp_position_period")})

    def value(cfg, name):
        given = getattr(cfg, name, None)
        given = str(defaults.get(name) if given is None else given)
        if name == "fwp_decay_form" and given == "auto":  # what auto computes: the rule's own form
            return update_rule(value(cfg, "fwp_update_rule")).decay_form
        return given

    saved_value, built_value = ({name: value(cfg, name) for name in names} for cfg in (saved, model))
    return computation_differences(saved, model, ("saved", "built")) + [
        f"{name}: saved {saved_value[name]}, built {built_value[name]}" for name in names
        if saved_value[name] != built_value[name]]

