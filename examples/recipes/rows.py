"""Every row of every recipe, as data: the one place they are written down.

A row is the --fwp-* (and model) flags that make it, on top of its recipe's
model and training flags; its fairseq task; the paper's number where the
paper has one; and, for a row that starts from another row's checkpoint,
how it is uptrained. Recipes look rows up here; nothing else lists them.

- WMT14: the paper's Table 1 (BLEU, transformer_big). Translation rows use
  the sum rule with attention normalisation in every attention, the paper's
  MT setting (the fwp_transformer_* defaults).
- WIKITEXT103: Tables 2-5 (perplexity), keyed by (table, row), with the
  paper's number per model size. They start from the fwp_lm_* defaults:
  linear phi, delta rule, sum normalisation, no attention normalisation, no
  positional encoding. "{m}" is the Performer's m for the size (8 small,
  16 medium: the capacity of the linear maps, Table 2).
- WIKITEXT103_UPTRAINING: fairseq's published WikiText-103 LM (Baevski and Auli, 2019) converted by
  uptrain --pretrained, then finetuned with the fast weights carried (recipes/wikitext103_uptraining.py).
  Its flags go over the original's own architecture, whose fast-weight defaults are fairseq_fwp's
  (FastWeightConfig: linear phi, the sum rule).
- MULTI30K, WIKITEXT2: the small-real-data comparisons (recipes/
  small_real_data.py): Table 1's feature maps on Multi30k, Tables 2/4/5's
  rows on WikiText-2, and the rows beyond the paper (FAVOR+'s input scaling,
  the gated rules, hybrids, the modern delta rule, uptraining).
"""
import dataclasses
from typing import Dict, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class Uptraining:
    """A row converted from the `source` row's best checkpoint (fairseq_fwp/uptraining/conversion.py) and
    finetuned for a quarter of the source's budget, warming up over its first 100 updates (half of them, if
    fewer than 200). Steps of attention transfer come first and count against that quarter; with source_lr the peak
    learning rate is the one the source's training had reached; with a distillation weight w > 0 the source
    is also the finetuning's teacher (criterions/distillation.py)."""

    source: str = "softmax"
    transfer_steps: int = 0
    source_lr: bool = False
    distillation: float = 0.0


@dataclasses.dataclass(frozen=True)
class Row:
    flags: Tuple[str, ...] = ()
    task: str = "translation"  # "translation", "language_modeling" or "fwp_stream_lm"
    paper: Optional[Dict[str, float]] = None  # the paper's number, per model size ("big" for Table 1)
    uptraining: Optional[Uptraining] = None
    streams: Optional[Tuple[int, int]] = None  # an fwp_stream_lm row's (streams, tokens per segment), if not the
    #                                            recipe's default

    def flags_for(self, size=None):
        """The flags, with the Performer's m of the size where the row names it ("{m}")."""
        return [flag.format(m=PERFORMER_M[size]) if "{m}" in flag else flag for flag in self.flags]


def row(*flags, **fields):
    return Row(tuple(flags), **fields)


SOFTMAX = ("--fwp-feature-map", "softmax")
PERFORMER = ("--fwp-feature-map", "performer", "--fwp-performer-features")
DPFP = ("--fwp-feature-map", "dpfp", "--fwp-dpfp-nu")
SUM_RULE = ("--fwp-update-rule", "sum", "--fwp-attn-norm", "on")  # the linear Transformer's rule
TRANSFORMER = (*SOFTMAX, "--fwp-positions", "on")
PERFORMER_M = {"small": 8, "medium": 16}

WMT14 = {  # BLEU, transformer_big; D = d_dot (Table 6: Performer D = 2m, DPFP D = 2 * 64 * nu)
    "standard": row(*SOFTMAX, paper={"big": 27.7}),
    "linear": row("--fwp-feature-map", "linear", paper={"big": 26.8}),
    "performer-64": row(*PERFORMER, "32", paper={"big": 24.4}),
    "performer-256": row(*PERFORMER, "128", paper={"big": 25.3}),
    "performer-512": row(*PERFORMER, "256", paper={"big": 27.7}),
    "dpfp-256": row(*DPFP, "2", paper={"big": 26.9}),
    "dpfp-512": row(*DPFP, "4", paper={"big": 27.1}),
}

LM = "language_modeling"
WIKITEXT103 = {  # test perplexity, sliding window (Table 4: state carried)
    ("table2", "transformer"): row(*TRANSFORMER, task=LM, paper={"small": 34.1, "medium": 29.6}),
    ("table2", "linear-sum"): row(*SUM_RULE, task=LM, paper={"small": 38.3, "medium": 33.0}),
    ("table2", "delta"): row(task=LM, paper={"small": 35.5, "medium": 31.5}),
    ("table2", "performer-sum"): row(*PERFORMER, "{m}", *SUM_RULE, task=LM, paper={"small": 39.6, "medium": 33.8}),
    ("table2", "performer-delta"): row(*PERFORMER, "{m}", task=LM, paper={"small": 37.2, "medium": 31.8}),
    # medium, delta rule: positional encoding x attention normalisation
    ("table3", "pos-attnnorm"): row("--fwp-positions", "on", "--fwp-attn-norm", "on", task=LM, paper={"medium": 32.1}),
    ("table3", "nopos-attnnorm"): row("--fwp-attn-norm", "on", task=LM, paper={"medium": 31.2}),
    ("table3", "pos-noattnnorm"): row("--fwp-positions", "on", task=LM, paper={"medium": 31.5}),
    ("table3", "nopos-noattnnorm"): row(task=LM, paper={"medium": 31.1}),
    # medium, trained and evaluated with fast weights carried across segments; the linear row: "> 260"
    ("table4", "linear-carry"): row(*SUM_RULE, task="fwp_stream_lm", paper={"medium": 260.0}),
    ("table4", "delta-carry"): row(task="fwp_stream_lm", paper={"medium": 29.4}),
    # small, d_dot = 256
    ("table5", "performer-sum"): row(*PERFORMER, "16", *SUM_RULE, task=LM, paper={"small": 38.8}),
    ("table5", "performer-delta"): row(*PERFORMER, "16", task=LM, paper={"small": 37.0}),
    ("table5", "dpfp-sum"): row(*DPFP, "1", *SUM_RULE, task=LM, paper={"small": 38.8}),
    ("table5", "dpfp-delta"): row(*DPFP, "1", task=LM, paper={"small": 35.0}),
}
LM_TABLES = sorted({table for table, _ in WIKITEXT103})


STREAM = "fwp_stream_lm"
WIKITEXT103_UPTRAINING = {  # finetuned with the fast weights carried across segments (Table 4's setting)
    # the sum rule with attention normalisation: DPFP (Table 5's dpfp-sum, D = 2 x 128 heads' width) and ELU + 1
    # (the linear Transformer, as T2R's feature map is a learned one)
    "dpfp-sum": row(*DPFP, "1", *SUM_RULE, task=STREAM),
    "linear-sum": row("--fwp-feature-map", "linear", *SUM_RULE, task=STREAM),
    "delta": row("--fwp-update-rule", "delta", task=STREAM),  # the Delta Net (Tables 2-4)
    "gated-delta-l2": row("--fwp-update-rule", "gated-delta", "--fwp-qk-norm", "l2", task=STREAM),
}


def wikitext103_row(table, name, size):
    """A Tables 2-5 row at one size; raises ValueError naming the choices."""
    if table not in LM_TABLES:
        raise ValueError(f"table must be one of {', '.join(LM_TABLES)}; got {table!r}")
    names = [n for t, n in WIKITEXT103 if t == table]
    if name not in names:
        raise ValueError(f"{table} rows are {', '.join(names)}; got {name!r}")
    found = WIKITEXT103[table, name]
    if size not in found.paper:
        raise ValueError(f"{table} is reported for {', '.join(found.paper)}; got {size!r}")
    return found


def uptrained_rows(name, flags, task="translation"):
    """Rows uptrained from the softmax row: NAME-uptrained as it is; -distilled with the softmax row as the
    finetuning's teacher; -transfer100 and -transfer200 with 100 or 200 steps of attention transfer (then
    200 or 100 updates), peaking at --lr or, with -source-lr, at the learning rate the softmax row ended
    with; -transfer100-distilled with both."""
    rows = {f"{name}-uptrained": Uptraining(),
            f"{name}-distilled-uptrained": Uptraining(distillation=DISTILLATION_WEIGHT),
            f"{name}-transfer100-distilled-uptrained": Uptraining(transfer_steps=100, distillation=DISTILLATION_WEIGHT)}
    for steps in (100, 200):
        for suffix, source_lr in (("", False), ("-source-lr", True)):
            rows[f"{name}-transfer{steps}{suffix}-uptrained"] = Uptraining(transfer_steps=steps, source_lr=source_lr)
    return {row_name: Row(tuple(flags), task=task, uptraining=up) for row_name, up in rows.items()}


DISTILLATION_WEIGHT = 0.5  # half cross-entropy, half the divergence from the softmax row (the teacher)
DPFP_256 = (*DPFP, "2")
MULTI30K = {  # Table 1's feature maps at d_key = 64, sum rule with attention normalisation
    "softmax": row(*SOFTMAX),
    "linear": row("--fwp-feature-map", "linear"),
    # FAVOR+ as the paper writes it (Eqs. 31-32, no input scaling) ...
    "performer-64": row(*PERFORMER, "32", "--fwp-performer-scaling", "off"),
    "performer-256": row(*PERFORMER, "128", "--fwp-performer-scaling", "off"),
    # ... and its options: inputs scaled by d^-1/4 (the default now), features fixed after initialisation
    "performer-64-scaled": row(*PERFORMER, "32", "--fwp-performer-scaling", "on"),
    "performer-64-fixed": row(*PERFORMER, "32", "--fwp-performer-scaling", "off", "--fwp-performer-redraw", "0"),
    "performer-256-scaled": row(*PERFORMER, "128", "--fwp-performer-scaling", "on"),
    "dpfp-128": row(*DPFP, "1"),
    "dpfp-256": row(*DPFP_256),
    "dpfp-256-delta": row(*DPFP_256, "--fwp-update-rule", "delta"),  # delta rule in the decoder self-attention
    # beyond the paper: a gated delta-rule decoder; a hybrid with softmax in layer 1 of both stacks
    "dpfp-256-gated-delta": row(*DPFP_256, "--fwp-update-rule", "gated-delta"),
    "dpfp-256-hybrid": row(*DPFP_256, "--fwp-softmax-layers", "1"),
    # uptrained from the softmax row: dpfp-256[-delta][-transfer{100,200}][-source-lr][-distilled]-uptrained
    **uptrained_rows("dpfp-256", DPFP_256),
    **uptrained_rows("dpfp-256-delta", (*DPFP_256, "--fwp-update-rule", "delta")),
}

MOVED = ("--fwp-stream-offset", "random")  # the streams move by a random offset every epoch
WIKITEXT2 = {  # Table 2/5 rows, and Table 4's carried rows
    "softmax": row(*TRANSFORMER, task=LM),
    "linear-sum": row(*SUM_RULE, task=LM),
    "linear-delta": row(task=LM),
    "dpfp-sum": row(*DPFP, "1", *SUM_RULE, task=LM),
    "dpfp-delta": row(*DPFP, "1", task=LM),
    "performer-sum": row(*PERFORMER, "16", "--fwp-performer-scaling", "off", *SUM_RULE, task=LM),
    "performer-delta": row(*PERFORMER, "16", "--fwp-performer-scaling", "off", task=LM),
    "linear-delta-carry": row(task=STREAM),
    "linear-delta-carry-offset": row(*MOVED, task=STREAM),
    "linear-sum-carry": row("--fwp-update-rule", "sum", "--fwp-attn-norm", "off", *MOVED, task=STREAM),
    "gated-delta-carry": row("--fwp-update-rule", "gated-delta", *MOVED, task=STREAM),
    # 4 streams of 54K tokens, as long as the test part, and backpropagation through 256 tokens (the same
    # tokens per update); scored with the state carried only (a 256-token sliding window would cost 4x)
    "linear-delta-carry-long": row(*MOVED, task=STREAM, streams=(4, 256)),
    # beyond the paper: the Delta Net plus one addition each, and all of them (Gated DeltaNet)
    "gated-delta": row("--fwp-update-rule", "gated-delta", task=LM),
    "delta-silu-l2": row("--fwp-feature-map", "silu", "--fwp-qk-norm", "l2", task=LM),
    "delta-short-conv": row("--fwp-short-conv", "4", task=LM),
    "delta-output-gate": row("--fwp-output-gate", "on", task=LM),
    "delta-hybrid": row("--fwp-softmax-layers", "3", task=LM),
    "gated-deltanet": row("--fwp-update-rule", "gated-delta", "--fwp-feature-map", "silu", "--fwp-qk-norm", "l2",
                          "--fwp-short-conv", "4", "--fwp-output-gate", "on", task=LM),
    # the gated delta rule with unit keys (each write's transition I - beta k k^T has eigenvalues 1 and 1 - beta),
    # then with beta in (0, 2) (eigenvalues in (-1, 1]), and with 2 writes per token (DeltaProduct)
    "gated-delta-l2": row("--fwp-update-rule", "gated-delta", "--fwp-qk-norm", "l2", task=LM),
    "gated-delta-l2-negative": row("--fwp-update-rule", "gated-delta", "--fwp-qk-norm", "l2",
                                   "--fwp-negative-eigenvalues", "on", task=LM),
    "gated-deltaproduct-2-l2-negative": row("--fwp-update-rule", "gated-delta", "--fwp-qk-norm", "l2",
                                            "--fwp-negative-eigenvalues", "on", "--fwp-householder-steps", "2",
                                            task=LM),
    # a decay per key channel: GLA (the sum rule), KDA (the delta rule), GDN-2 (KDA with erase and write gates)
    "gla": row("--fwp-update-rule", "gla", task=LM),
    "kda": row("--fwp-update-rule", "kda", task=LM),
    "gdn2": row("--fwp-update-rule", "gdn2", task=LM),
    # uptrained from the softmax row, keeping its positions
    **uptrained_rows("linear-delta", ("--fwp-positions", "on"), task=LM),
}
