"""The options of one fast-weight attention, in one frozen object, checked once, against one table of rules.

``AttentionOptions`` is FastWeightAttention's one argument. Building it checks every option alone (names
registered, values in range, the feature map's own options for this head size) and every rule of RULES
that combines them, raising OptionsError, which names the options; the models build one per attention
site from the --fwp-* flags (models/site_options.py) and render the same error with the flags' names.
docs/flags.md lists the same rules (a test holds the two together).
"""
import collections
import dataclasses
from typing import Optional

from ..ops.rules import update_rule
from .feature_maps import QK_NORMS, OptionError, feature_map_class, mapped
from .gates import DECAY_FORMS

DECODING_STEPS = ("auto", "fused", "own")  # --fwp-decoding-step (fused_step.py says what auto runs)


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    embed_dim: int
    num_heads: int
    causal: bool = True  # decoder self-attention (a memory written token by token); else one memory per source
    kdim: Optional[int] = None  # the keys' and values' input size, where it is not embed_dim (cross-attention)
    feature_map: str = "linear"  # a registered feature map (feature_maps.py)
    feature_map_options: tuple = ()  # its options, as (name, value) pairs (a dict is accepted)
    update_rule: str = "sum"  # a registered update rule (ops/rules/)
    qk_norm: str = "sum"  # how phi(q), phi(k) are normalised: sum (Eq. 29), l2 or none
    attention_normalization: bool = False  # divide outputs by z_t . phi(q_t) (Eqs. 19, 26-28)
    output_scaling: bool = False  # multiply outputs by 1/sqrt(head_dim)
    decay_form: str = "mamba2"  # the gated rules' a_t (gates.py)
    short_conv: int = 0  # kernel size of a short convolution on q, k, v (0: none; causal only)
    output_gate: bool = False  # RMS norm times SiLU gate on each head's output (Gated DeltaNet)
    householder_steps: int = 1  # writes per token (DeltaProduct: a rule with substeps; N keys, values, betas)
    negative_eigenvalues: bool = False  # beta = 2 sigmoid(.): Householder transitions with eigenvalues in [-1, 1]
    backend: str = "auto"  # which backend runs the ops (ops/backends.py)
    decoding_step: str = "auto"  # which step decodes a token: the fused step, the rule's own, or auto (fused_step.py)
    eps: float = 1e-5

    def __post_init__(self):
        if isinstance(self.feature_map_options, dict):
            object.__setattr__(self, "feature_map_options", tuple(sorted(self.feature_map_options.items())))
        check(self)

    @property
    def head_dim(self):
        return self.embed_dim // self.num_heads

    @property
    def rule(self):
        """The registered UpdateRule."""
        return update_rule(self.update_rule)

    @property
    def map_class(self):
        return feature_map_class(self.feature_map)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


Rule = collections.namedtuple("Rule", "options refuses why")

RULES = (
    Rule(("update_rule", "qk_norm"), lambda o: o.rule.normalised_keys and o.qk_norm == "none",
         "this rule needs normalised keys: it diverges without"),
    Rule(("update_rule", "attention_normalization"), lambda o: o.rule.decay and o.attention_normalization,
         "attention normalisation is for the paper's rules; the gated rules use the output gate"),
    Rule(("feature_map", "qk_norm"), lambda o: o.map_class.signed and o.qk_norm == "sum",
         "these features are signed, and their sum can be zero: normalise them with l2"),
    Rule(("feature_map", "attention_normalization"), lambda o: o.map_class.signed and o.attention_normalization,
         "these features are signed: attention normalisation would divide by sums that can be zero"),
    Rule(("update_rule", "causal"), lambda o: o.update_rule != "sum" and not o.causal,
         "only the sum rule programs a non-causal attention: the others program the decoder self-attention"),
    Rule(("short_conv", "causal"), lambda o: o.short_conv and not o.causal,
         "the short convolution is for causal (decoder self-) attention only"),
    Rule(("update_rule", "householder_steps"), lambda o: (o.householder_steps > 1) != o.rule.substeps,
         "several writes per token are DeltaProduct's: the delta rules' form with N keys (--fwp-householder-steps)"),
    Rule(("update_rule", "negative_eigenvalues"), lambda o: o.negative_eigenvalues and not o.rule.householder,
         "negative eigenvalues are for rules whose writes are Householder transitions, the delta rules"),
    Rule(("negative_eigenvalues", "attention_normalization"),
         lambda o: o.negative_eigenvalues and o.attention_normalization,
         "attention normalisation's retrieval (Eqs. 26-28) divides each key by z . k, which takes the "
         "transition's eigenvalues 1 - beta (k . k) out of [-1, 1]"),
    Rule(("householder_steps", "attention_normalization"), lambda o: o.householder_steps > 1 and o.attention_normalization,
         "attention normalisation (Eqs. 18-19, 26-28) sums one key per token"),
    Rule(("negative_eigenvalues", "qk_norm"), lambda o: o.negative_eigenvalues and o.qk_norm != "l2",
         "negative eigenvalues need unit keys (l2): a write's transition I - beta k k^T has the eigenvalues 1 and "
         "1 - beta |k|^2, which falls below 0 only where |k|^2 > 1 / beta, and sum-normalised keys are far "
         "shorter (|k|^2 about 0.05 in a trained LM): beta in (0, 2) would only double the write strength"),
    Rule(("backend", "update_rule"), lambda o: o.backend not in ("auto", "reference") and not o.rule.kernels.get(o.backend),
         "this backend has no kernel for this rule (auto runs every rule; reference runs any rule's own step)"),
)


def as_arguments(name, value):
    """How a message names an option: as the layer's argument."""
    return f"{name}={value!r}"


class OptionsError(ValueError):
    """What the options cannot be, naming the options involved (``names``; a feature map's own option as
    "feature_map_options.NAME"). ``render(describe)`` says it in other words (validate: the flags)."""

    def __init__(self, options, names, why):
        self.options, self.names, self.why = options, names, why
        super().__init__(self.render(as_arguments))

    def value(self, name):
        if name.startswith("feature_map_options."):
            return dict(self.options.feature_map_options)[name.split(".", 1)[1]]
        return getattr(self.options, name)

    def render(self, describe):
        return " with ".join(describe(name, self.value(name)) for name in self.names) + f": {self.why}"


def check(options):
    """Raises OptionsError for the first thing `options` cannot be: an option alone, then RULES. Names
    that are not registered raise ValueError, naming the registered ones."""
    if options.embed_dim % options.num_heads:
        raise OptionsError(options, ("embed_dim", "num_heads"), "embed_dim must be divisible by num_heads")
    for name, allowed in (("qk_norm", QK_NORMS), ("decay_form", DECAY_FORMS), ("decoding_step", DECODING_STEPS)):
        if getattr(options, name) not in allowed:
            raise OptionsError(options, (name,), f"must be one of {', '.join(allowed)}")
    if options.short_conv < 0 or options.short_conv == 1:
        raise OptionsError(options, ("short_conv",), "0 (none) or a kernel size >= 2")
    if options.householder_steps < 1:
        raise OptionsError(options, ("householder_steps",), "an integer >= 1")
    update_rule(options.update_rule)
    map_class = feature_map_class(options.feature_map)
    try:
        map_class.check_options(options.head_dim, **dict(options.feature_map_options))
    except OptionError as err:
        raise OptionsError(options, (f"feature_map_options.{err.option}",), str(err)) from None
    try:  # a map of a user's own may have conditions of its own (a head size it needs), checked here too
        mapped(map_class, options.head_dim, **dict(options.feature_map_options))
    except ValueError as err:
        raise OptionsError(options, ("feature_map",), f"with heads of {options.head_dim}: {err}") from None
    for rule in RULES:
        if rule.refuses(options):
            raise OptionsError(options, rule.options, rule.why)
