"""The rules that combine a fast-weight attention's options, in one table.

FastWeightAttention checks its arguments with them, naming the arguments;
``fairseq_fwp.models.fwp_config.validate`` checks every site of a model's
--fwp-* flags with them, naming the flags. docs/flags.md lists the same
rules (a test holds the two together).
"""
import collections

Rule = collections.namedtuple("Rule", "options refuses why")

DELTA_RULES = ("delta", "gated-delta")
RULES = (
    Rule(("update_rule", "qk_norm"), lambda o: o["update_rule"] in DELTA_RULES and o["qk_norm"] == "none",
         "the delta rules need normalised keys: they diverge without"),
    Rule(("update_rule", "attention_normalization"),
         lambda o: o["update_rule"].startswith("gated") and o["attention_normalization"],
         "attention normalisation is for the paper's rules; the gated rules use the output gate"),
    Rule(("feature_map", "qk_norm"), lambda o: o["feature_map"] == "silu" and o["qk_norm"] == "sum",
         "silu features are signed, and their sum can be zero: normalise them with l2"),
    Rule(("feature_map", "attention_normalization"),
         lambda o: o["feature_map"] == "silu" and o["attention_normalization"],
         "silu features are signed: attention normalisation would divide by sums that can be zero"),
    Rule(("update_rule", "causal"), lambda o: o["update_rule"] != "sum" and not o["causal"],
         "the delta and gated rules program a causal (decoder self-) attention only"),
    Rule(("short_conv", "causal"), lambda o: o["short_conv"] and not o["causal"],
         "the short convolution is for causal (decoder self-) attention only"),
)


def check(options, describe):
    """Raises ValueError for the first rule `options` ({name: value}) break.

    describe(name, value): how the message names an option and its value.
    """
    for rule in RULES:
        if rule.refuses(options):
            named = " with ".join(describe(name, options[name]) for name in rule.options)
            raise ValueError(f"{named}: {rule.why}")
