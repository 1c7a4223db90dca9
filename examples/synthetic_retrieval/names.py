"""Model names, ``softmax`` or ``RULE-PHI`` (e.g. ``sum-dpfp2``), checked and labelled without torch.

RULE is the update rule (``sum``, ``delta``, ``gated``, ``gdelta``, ``fwm``), PHI the
feature map (``linear``, ``dpfpNU``, ``favorM``, and ``tanh`` for ``fwm``
only); ``models.py`` says what each one computes.
"""
import re

D_KEY = 64  # the paper's key size, fixed for every model (Sec. 6.1.1)
RULES = ("sum", "delta", "gated", "gdelta", "fwm")
MODEL_NAME_HELP = (
    "softmax, or RULE-PHI with RULE one of sum, delta, gated, gdelta, fwm and PHI one of "
    "linear, dpfp<nu> (e.g. dpfp2), favor<m> (e.g. favor128), tanh (fwm only)"
)
RULE_LABELS = {"sum": "sum", "delta": "delta (ours)", "gated": "gated (App. B)", "gdelta": "gated delta (2025)",
               "fwm": "FWM (Schlag 2021)"}


def parse_model_name(name):
    """Check a model name; returns ``(rule, phi)``, with ``("softmax", None)`` for softmax."""
    if name == "softmax":
        return "softmax", None
    rule, _, phi = name.partition("-")
    valid_phi = re.fullmatch(r"linear|dpfp[1-9][0-9]*|favor[1-9][0-9]*", phi) or (rule == "fwm" and phi == "tanh")
    if rule not in RULES or not valid_phi:
        raise ValueError(f"model must be {MODEL_NAME_HELP}; got {name!r}")
    if phi.startswith("dpfp") and int(phi[4:]) >= 2 * D_KEY:
        raise ValueError(f"DPFP-nu needs nu < 2 * d_key = {2 * D_KEY}; got {name!r}")
    return rule, phi


def phi_label(phi):
    if phi.startswith("dpfp"):
        return f"DPFP-{phi[4:]}"
    if phi.startswith("favor"):
        return f"FAVOR+ {phi[5:]}"
    return {"linear": "Linear", "tanh": "tanh"}[phi]


def label(name):
    """A legend label, e.g. ``sum-dpfp2`` -> ``DPFP-2 sum``."""
    rule, phi = parse_model_name(name)
    return "Softmax" if rule == "softmax" else f"{phi_label(phi)} {RULE_LABELS[rule]}"
