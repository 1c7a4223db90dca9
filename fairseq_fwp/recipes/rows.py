"""Every row of the paper's tables as --fwp-* flags: the one place they are written down.

Translation rows (Table 1) use the sum rule with attention normalisation in
every attention, the paper's MT setting (the fwp_transformer_* defaults).
Language-model rows (Tables 2-5) start from the fwp_lm_* defaults: linear
phi, delta rule, sum normalisation, no attention normalisation, no
positional encoding. "{m}" is the Performer's m for the LM size (8 small,
16 medium: the capacity of the linear maps, Table 2).
"""

TABLE1 = {  # WMT14 En-De BLEU, big; D = d_dot (Table 6: Performer D = 2m, DPFP D = 2 * 64 * nu)
    "standard": ["--fwp-feature-map", "softmax"],
    "linear": ["--fwp-feature-map", "linear"],
    "performer-64": ["--fwp-feature-map", "performer", "--fwp-performer-features", "32"],
    "performer-256": ["--fwp-feature-map", "performer", "--fwp-performer-features", "128"],
    "performer-512": ["--fwp-feature-map", "performer", "--fwp-performer-features", "256"],
    "dpfp-256": ["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "2"],
    "dpfp-512": ["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "4"],
}
TABLE1_BLEU = {"standard": 27.7, "linear": 26.8, "performer-64": 24.4, "performer-256": 25.3,
               "performer-512": 27.7, "dpfp-256": 26.9, "dpfp-512": 27.1}

SUM_RULE = ["--fwp-update-rule", "sum", "--fwp-attn-norm", "on"]  # the linear Transformer's rule
TRANSFORMER = ["--fwp-feature-map", "softmax", "--fwp-positions", "on"]

TABLE2 = {  # WikiText-103 perplexity, small and medium, sliding window
    "transformer": TRANSFORMER,
    "linear-sum": SUM_RULE,
    "delta": [],
    "performer-sum": ["--fwp-feature-map", "performer", "--fwp-performer-features", "{m}"] + SUM_RULE,
    "performer-delta": ["--fwp-feature-map", "performer", "--fwp-performer-features", "{m}"],
}
TABLE3 = {  # medium, delta rule: positional encoding x attention normalisation
    "pos-attnnorm": ["--fwp-positions", "on", "--fwp-attn-norm", "on"],
    "nopos-attnnorm": ["--fwp-attn-norm", "on"],
    "pos-noattnnorm": ["--fwp-positions", "on"],
    "nopos-noattnnorm": [],
}
TABLE4 = {  # medium, trained and evaluated with fast weights carried across segments (task fwp_stream_lm)
    "linear-carry": SUM_RULE,
    "delta-carry": [],
}
TABLE5 = {  # small, d_dot = 256
    "performer-sum": ["--fwp-feature-map", "performer", "--fwp-performer-features", "16"] + SUM_RULE,
    "performer-delta": ["--fwp-feature-map", "performer", "--fwp-performer-features", "16"],
    "dpfp-sum": ["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "1"] + SUM_RULE,
    "dpfp-delta": ["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "1"],
}
LM_TABLES = {"table2": TABLE2, "table3": TABLE3, "table4": TABLE4, "table5": TABLE5}
TABLE_SIZES = {"table2": ("small", "medium"), "table3": ("medium",), "table4": ("medium",), "table5": ("small",)}
PERFORMER_M = {"small": 8, "medium": 16}

# Test perplexity in the paper, (table, row, size) -> ppl.
LM_PERPLEXITY = {
    ("table2", "transformer", "small"): 34.1, ("table2", "transformer", "medium"): 29.6,
    ("table2", "linear-sum", "small"): 38.3, ("table2", "linear-sum", "medium"): 33.0,
    ("table2", "delta", "small"): 35.5, ("table2", "delta", "medium"): 31.5,
    ("table2", "performer-sum", "small"): 39.6, ("table2", "performer-sum", "medium"): 33.8,
    ("table2", "performer-delta", "small"): 37.2, ("table2", "performer-delta", "medium"): 31.8,
    ("table3", "pos-attnnorm", "medium"): 32.1, ("table3", "nopos-attnnorm", "medium"): 31.2,
    ("table3", "pos-noattnnorm", "medium"): 31.5, ("table3", "nopos-noattnnorm", "medium"): 31.1,
    ("table4", "linear-carry", "medium"): 260.0, ("table4", "delta-carry", "medium"): 29.4,  # linear: "> 260"
    ("table5", "performer-sum", "small"): 38.8, ("table5", "performer-delta", "small"): 37.0,
    ("table5", "dpfp-sum", "small"): 38.8, ("table5", "dpfp-delta", "small"): 35.0,
}


def lm_row_flags(table, row, size):
    """The --fwp-* flags of one LM row at one size; raises ValueError naming the choices."""
    if table not in LM_TABLES:
        raise ValueError(f"table must be one of {', '.join(LM_TABLES)}; got {table!r}")
    if row not in LM_TABLES[table]:
        raise ValueError(f"{table} rows are {', '.join(LM_TABLES[table])}; got {row!r}")
    if size not in TABLE_SIZES[table]:
        raise ValueError(f"{table} is reported for {', '.join(TABLE_SIZES[table])}; got {size!r}")
    return [flag.format(m=PERFORMER_M[size]) for flag in LM_TABLES[table][row]]
