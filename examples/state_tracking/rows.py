"""The rows of the state-tracking table: the AttentionOptions of each (None: causal softmax attention).

Every fast-weight row uses DeltaNet's keys (SiLU features, L2-normalised: |k| = 1, so each write's
transition I - beta k k^T has eigenvalues 1 - beta and 1), without attention normalisation; [-1, 1] marks
beta in (0, 2) (--fwp-negative-eigenvalues on), [0, 1] beta in (0, 1).
"""
KEYS = dict(feature_map="silu", qk_norm="l2", attention_normalization=False)
NEGATIVE = dict(negative_eigenvalues=True)

ROWS = {
    "softmax": None,
    "sum": dict(KEYS, update_rule="sum"),
    "delta [0,1]": dict(KEYS, update_rule="delta"),
    "delta [-1,1]": dict(KEYS, update_rule="delta", **NEGATIVE),
    "gated delta [0,1]": dict(KEYS, update_rule="gated-delta"),
    "gated delta [-1,1]": dict(KEYS, update_rule="gated-delta", **NEGATIVE),
    "DeltaProduct N=2 [-1,1]": dict(KEYS, update_rule="delta-product", householder_steps=2, **NEGATIVE),
    "DeltaProduct N=3 [-1,1]": dict(KEYS, update_rule="delta-product", householder_steps=3, **NEGATIVE),
    # a decay per key channel (rules/channels.py), each with its paper's gate
    "GLA": dict(KEYS, update_rule="gla", decay_form="logsigmoid"),
    "KDA [0,1]": dict(KEYS, update_rule="kda"),
    "KDA [-1,1]": dict(KEYS, update_rule="kda", **NEGATIVE),
    "GDN-2 [-1,1]": dict(KEYS, update_rule="gdn2", **NEGATIVE),
}
