"""Random --fwp-* combinations for the two architectures, drawn from the flags themselves: every field of the
models' configs (FastWeightConfig, and the LM's own), the choices its ChoiceEnum or the registries give when
it is drawn, and for the integer flags the values below. A new flag joins by being given values here (the
coverage test fails until it is); a new choice, feature map or update rule joins by being registered.

Beside them, the fairseq flags of each architecture that change what the fast-weight layers see.
"""
import dataclasses
import enum
import shlex

from hypothesis import strategies as st

from fairseq_fwp.models.fwp_config import FastWeightConfig, registered_choices
from fairseq_fwp.models.fwp_transformer_lm import FastWeightLanguageModelConfig
from fairseq_fwp.ops import UPDATE_RULES

# The integer and free-form flags: the values drawn (the defaults among them).
VALUES = {
    "fwp_short_conv": ("0", "2", "4"),
    "fwp_householder_steps": ("1", "2", "3"),
    "fwp_dpfp_nu": ("1", "2", "3"),
    "fwp_performer_features": ("0", "3", "8"),
    "fwp_performer_redraw": ("0", "1", "2"),
    "fwp_softmax_layers": ("", "0", "1", "0,1"),
    "fwp_position_period": ("0", "3"),
}
# Flags of the --fwp-* family that no model invariant draws, and why.
NOT_DRAWN = {
    "fwp_sum_norm": "deprecated: --fwp-qk-norm says it (tests/test_flags_and_compat.py holds the two together)",
}
# Values that no model invariant draws, and why: a model runs on CPU tensors here, which these refuse at its
# first forward (tests/test_fused_step.py and tests/test_fairseq_cli.py hold the refusals, naming the flag).
NOT_DRAWN_VALUES = {
    ("fwp_backend", "cuda"): "the csrc kernels run on CUDA tensors",
    ("fwp_backend", "fla"): "fla runs on CUDA tensors (on the CPU only inside Triton's interpreter: the op harness)",
}
# fairseq's own flags that change what the fast-weight layers see, per architecture.
FAIRSEQ_FLAGS = {
    "translation": ("--cross-self-attention", "--encoder-normalize-before", "--decoder-normalize-before",
                    "--layernorm-embedding", "--share-all-embeddings", "--no-scale-embedding"),
    "lm": ("--decoder-normalize-before", "--no-decoder-final-norm", "--share-decoder-input-output-embed",
           "--no-scale-embedding"),
}
ARCHS = {"translation": ("translation", "fwp_transformer_tiny"), "lm": ("language_modeling", "fwp_lm_tiny")}


def model_fields(arch):
    """The --fwp-* fields of the architecture's config, by dest."""
    config = FastWeightLanguageModelConfig if arch == "lm" else FastWeightConfig
    return {f.name: f for f in dataclasses.fields(config) if f.name.startswith("fwp_")}


def values_of(field):
    """The values a combination draws for the config field (registered names at the time of the call)."""
    registered = registered_choices()
    if field.name in registered:
        return tuple(registered[field.name])
    if field.name in VALUES:
        return VALUES[field.name]
    choices = getattr(field.type, "__members__", None)  # fairseq's ChoiceEnum
    if choices is None and hasattr(field.type, "__args__"):  # Optional[ChoiceEnum]
        choices = next((getattr(t, "__members__", None) for t in field.type.__args__ if hasattr(t, "__members__")),
                       None)
    if choices is None:
        raise KeyError(f"--{field.name.replace('_', '-')}: no values to draw (give it some in VALUES)")
    return tuple(str(member.value if isinstance(member, enum.Enum) else member) for member in choices.values())


def drawn_values(arch):
    """{flag: the values a combination draws for it}, for every --fwp-* flag of the architecture but NOT_DRAWN's,
    without NOT_DRAWN_VALUES (the registries read now)."""
    return {f"--{dest.replace('_', '-')}": tuple(v for v in values_of(field) if (dest, v) not in NOT_DRAWN_VALUES)
            for dest, field in sorted(model_fields(arch).items()) if dest not in NOT_DRAWN}


def family(rule):
    """The family of a registered rule, which the model invariants each draw on their own: "product" (N writes
    per token), "per-channel" (a decay or write strength per channel), "gated" (a decay per head), "delta" (a
    write strength) or "sum"."""
    if rule.substeps:
        return "product"
    if "channels" in (rule.decay, rule.write_strength):
        return "per-channel"
    return "gated" if rule.decay else "delta" if rule.write_strength else "sum"


def families():
    """{family: the names of its registered rules}, the registry read now."""
    grouped = {}
    for name, rule in UPDATE_RULES.items():
        grouped.setdefault(family(rule), []).append(name)
    return grouped


@dataclasses.dataclass(frozen=True)
class Combination:
    arch: str  # "translation" or "lm"
    flags: tuple  # the fairseq-train flags that differ from the defaults

    @property
    def task_and_arch(self):
        return ARCHS[self.arch]

    def command(self):
        """A fairseq-train command line of the model (with the data of your own), for a failure's report."""
        task, arch = self.task_and_arch
        return shlex.join(["fairseq-train", "DATA", "--user-dir", "fairseq_fwp", "--task", task, "--arch", arch,
                           *self.flags])

    def __repr__(self):  # as hypothesis reports a failing example: the command that builds the model
        return self.command()

    def without(self, flag):
        """The combination without `flag` (and its value, where it takes one)."""
        index = self.flags.index(flag)
        takes_value = index + 1 < len(self.flags) and not self.flags[index + 1].startswith("--")
        return Combination(self.arch, self.flags[:index] + self.flags[index + 1 + takes_value:])


def refusal(combination):
    """The message of the combination's refusal when its arguments are parsed, or None where it is taken."""
    from helpers import parse_args

    try:
        parse_args(*combination.task_and_arch, *combination.flags)
    except ValueError as err:
        return str(err)
    return None


def named_flags(combination, message):
    """The combination's flags that a refusal names."""
    return [flag for flag in combination.flags if flag.startswith("--") and flag in message]


def taken(combination, keep=(), draw=None):
    """The combination with the flags its refusals name dropped, one at a time, until it is taken: a random
    combination most of whose flags are valid together. A refusal that names only flags of `keep` and flags
    the combination leaves at their defaults gets one of those set (a value drawn with `draw`, a hypothesis
    draw: silu features need --fwp-qk-norm l2); None where that cannot help. A refusal that names none of its
    flags is an AssertionError (the harness's first invariant)."""
    message = refusal(combination)
    for _ in range(2 * len(drawn_values(combination.arch))):
        if message is None:
            return combination
        named = named_flags(combination, message)
        assert named, f"{combination.command()}: refused without naming one of its flags: {message}"
        droppable = [flag for flag in named if flag not in keep]
        if droppable:
            combination = combination.without(droppable[-1])
        else:
            unset = [flag for flag, values in drawn_values(combination.arch).items()
                     if flag in message and flag not in combination.flags]
            if draw is None or not unset:
                return None
            flag = draw(st.sampled_from(unset))
            combination = Combination(combination.arch, (flag, draw(st.sampled_from(drawn_values(combination.arch)[flag])),
                                                         *combination.flags))
        message = refusal(combination)
    return None


# What a family's combination keeps (taken(keep=...)): its rule, its fast-weight map, its writes per token.
FAMILY_FLAGS = ("--fwp-update-rule", "--fwp-feature-map", "--fwp-householder-steps")


def fast_weight_maps():
    """The registered feature maps but softmax (which keeps fairseq's attention)."""
    return tuple(m for m in registered_choices()["fwp_feature_map"] if m != "softmax")


@st.composite
def combinations(draw, archs=tuple(sorted(ARCHS)), family=None, feature_map=None):
    """A Combination of one of `archs`: each --fwp-* flag given with probability about 1/3, a random value of it;
    each fairseq flag of the architecture with probability 1/6. With a family (family()): a rule of the family
    and a map other than softmax (`feature_map`, or drawn), always given, and N = 2 or 3 writes per token for
    the product rules; --fwp-attn-norm on or off where the family's rules normalise their retrieval."""
    arch = draw(st.sampled_from(archs))
    values = drawn_values(arch)
    fixed = []
    if family is not None:
        fixed = [("--fwp-update-rule", draw(st.sampled_from(families()[family]))),
                 ("--fwp-feature-map", feature_map or draw(st.sampled_from(fast_weight_maps())))]
        if family == "product":
            fixed.append(("--fwp-householder-steps", draw(st.sampled_from(["2", "3"]))))
    flags = []
    if family is not None and any(UPDATE_RULES[name].normalised_retrieval for name in families()[family]):
        # attention normalisation changes these rules' retrieval too (Eqs. 26-28): on in half the examples, and
        # first, so that taken() drops the other flags a refusal names before it (it drops the last named)
        attention_normalisation = draw(st.sampled_from(["on", "off"]))
        fixed.append(("--fwp-attn-norm", attention_normalisation))
        flags += ["--fwp-attn-norm", attention_normalisation]
    for flag, choices in values.items():
        if flag not in dict(fixed) and draw(st.integers(0, 2)) == 0:
            flags += [flag, draw(st.sampled_from(choices))]
    flags += [flag for flag in FAIRSEQ_FLAGS[arch] if draw(st.integers(0, 5)) == 0]
    for flag, value in fixed:
        if flag != "--fwp-attn-norm":
            flags += [flag, value]
    return Combination(arch, tuple(flags))
