"""Small real-data comparisons that run on a CPU: Multi30k En-De and WikiText-2.

    python -m fairseq_fwp.recipes.small_real_data multi30k --out runs/multi30k [--max-update 4000] [--rows ...]
    python -m fairseq_fwp.recipes.small_real_data wikitext2 --out runs/wikitext2 [--max-update 3000] [--rows ...]

Data come from ../shared/data (or --data-dir); nothing is copied into the
repository. Every row trains the same small model with the same budget,
differing only in its --fwp-* flags; results (BLEU or perplexity, and
training words/s) go to OUT/results.json and a markdown table on stdout.
Rows whose results are already in OUT/results.json are skipped, so an
interrupted run resumes; --evaluate-only evaluates trained rows again.

- multi30k: 29K training pairs; joint BPE (6K merges); a 2+2-layer
  Transformer of width 128 with 2 heads (d_key 64, as in the paper, so the
  Table 1 feature sizes carry over); Adam with inverse-sqrt schedule, label
  smoothing 0.1; the checkpoint with the best validation loss translates
  test_2016_flickr with beam 4 (sacreBLEU on detokenised output).
- wikitext2: the train split is not in ../shared/data, so valid.txt is the
  training text and test.txt is cut at the article boundary nearest 3/4
  of the way through: the first part validates, the last quarter is the
  test part (the sliding window costs one L-token forward per test token).
  A 4-layer LM of width 128 with 4 heads, L = 64; test perplexity with the
  paper's sliding window (windows of L, stride 1), and for the carry-over
  row also with the state carried through the whole test part.
"""
import argparse
import collections
import json
import os
import re
import time

from .. import uptrain
from . import language_model, text, translation
from .commands import PLUGIN_DIR

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "..", "shared", "data")

# A row finetuned from another row's best checkpoint (fairseq_fwp/uptrain.py) for a quarter of the
# budget, warming up over its first 100 updates (half of them, if fewer than 200): issue 20's
# uptraining. Steps of attention transfer before it (attention_transfer.py) count against that quarter.
# With source_lr, the peak learning rate is the one the source's training had reached, not --lr. With a
# distillation weight w > 0 the source row is also the teacher of the finetuning (criterions/distillation.py).
Uptrained = collections.namedtuple("Uptrained", "source flags transfer_steps source_lr distillation",
                                   defaults=(0, False, 0.0))
UPTRAINING_WARMUP = 100


DISTILLATION_WEIGHT = 0.5  # half cross-entropy, half the divergence from the softmax row (the teacher)


def uptrained_rows(name, flags):
    """Rows uptrained from the softmax row: NAME-uptrained as it is; -distilled with the softmax row as the
    finetuning's teacher; -transfer100 and -transfer200 with 100 or 200 steps of attention transfer (then
    200 or 100 updates), peaking at --lr or, with -source-lr, at the learning rate the softmax row ended
    with; -transfer100-distilled with both."""
    rows = {f"{name}-uptrained": Uptrained("softmax", flags),
            f"{name}-distilled-uptrained": Uptrained("softmax", flags, distillation=DISTILLATION_WEIGHT),
            f"{name}-transfer100-distilled-uptrained": Uptrained("softmax", flags, 100,
                                                                 distillation=DISTILLATION_WEIGHT)}
    for steps in (100, 200):
        for suffix, source_lr in (("", False), ("-source-lr", True)):
            rows[f"{name}-transfer{steps}{suffix}-uptrained"] = Uptrained("softmax", flags, steps, source_lr)
    return rows


PERFORMER = ["--fwp-feature-map", "performer", "--fwp-performer-features"]
DPFP = ["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu"]
MULTI30K_ROWS = {  # Table 1's feature maps at d_key = 64, sum rule with attention normalisation
    "softmax": ["--fwp-feature-map", "softmax"],
    "linear": ["--fwp-feature-map", "linear"],
    # FAVOR+ as the paper writes it (no input scaling; the recorded rows before issue 15) ...
    "performer-64": PERFORMER + ["32", "--fwp-performer-scaling", "off"],
    "performer-256": PERFORMER + ["128", "--fwp-performer-scaling", "off"],
    # ... and its options (issue 15): inputs scaled by d^-1/4 (the default now), features fixed after initialisation
    "performer-64-scaled": PERFORMER + ["32", "--fwp-performer-scaling", "on"],
    "performer-64-fixed": PERFORMER + ["32", "--fwp-performer-scaling", "off", "--fwp-performer-redraw", "0"],
    "performer-256-scaled": PERFORMER + ["128", "--fwp-performer-scaling", "on"],
    "dpfp-128": DPFP + ["1"],
    "dpfp-256": DPFP + ["2"],
    "dpfp-256-delta": DPFP + ["2", "--fwp-update-rule", "delta"],  # delta rule in the decoder self-attention
    # beyond the paper (issue 18): a gated delta-rule decoder; a hybrid with softmax in layer 1 of both stacks
    "dpfp-256-gated-delta": DPFP + ["2", "--fwp-update-rule", "gated-delta"],
    "dpfp-256-hybrid": DPFP + ["2", "--fwp-softmax-layers", "1"],
    # uptrained from the softmax row (issue 20): dpfp-256[-delta][-transfer{100,200}][-source-lr][-distilled]-uptrained
    **uptrained_rows("dpfp-256", DPFP + ["2"]),
    **uptrained_rows("dpfp-256-delta", DPFP + ["2", "--fwp-update-rule", "delta"]),
}
MULTI30K_MODEL = [
    "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "128", "--decoder-embed-dim", "128",
    "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512", "--encoder-attention-heads", "2",
    "--decoder-attention-heads", "2", "--share-all-embeddings", "--dropout", "0.2",
]
MULTI30K_TRAINING = [
    "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--lr", "0.001", "--lr-scheduler", "inverse_sqrt",
    "--warmup-updates", "500", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--max-tokens", "4096", "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "50",
]

SUM = ["--fwp-update-rule", "sum", "--fwp-attn-norm", "on"]
WIKITEXT2_ROWS = {  # Table 2/5 rows, and the Table 4 carry-over Delta Net; (task, flags)
    "softmax": ("language_modeling", ["--fwp-feature-map", "softmax", "--fwp-positions", "on"]),
    "linear-sum": ("language_modeling", SUM),
    "linear-delta": ("language_modeling", []),
    "dpfp-sum": ("language_modeling", DPFP + ["1"] + SUM),
    "dpfp-delta": ("language_modeling", DPFP + ["1"]),
    "performer-sum": ("language_modeling", PERFORMER + ["16", "--fwp-performer-scaling", "off"] + SUM),
    "performer-delta": ("language_modeling", PERFORMER + ["16", "--fwp-performer-scaling", "off"]),
    "linear-delta-carry": ("fwp_stream_lm", []),
    # issue 17: streams moved every epoch; the carried Linear Transformer of Table 4
    "linear-delta-carry-offset": ("fwp_stream_lm", ["--fwp-stream-offset", "random"]),
    "linear-sum-carry": ("fwp_stream_lm", ["--fwp-update-rule", "sum", "--fwp-attn-norm", "off",
                                         "--fwp-stream-offset", "random"]),
    "gated-delta-carry": ("fwp_stream_lm", ["--fwp-update-rule", "gated-delta", "--fwp-stream-offset", "random"]),
    "linear-delta-carry-long": ("fwp_stream_lm", ["--fwp-stream-offset", "random"]),
    # beyond the paper (issue 18): the Delta Net plus one addition each, and all of them (Gated DeltaNet)
    "gated-delta": ("language_modeling", ["--fwp-update-rule", "gated-delta"]),
    "delta-silu-l2": ("language_modeling", ["--fwp-feature-map", "silu", "--fwp-qk-norm", "l2"]),
    "delta-short-conv": ("language_modeling", ["--fwp-short-conv", "4"]),
    "delta-output-gate": ("language_modeling", ["--fwp-output-gate", "on"]),
    "delta-hybrid": ("language_modeling", ["--fwp-softmax-layers", "3"]),
    "gated-deltanet": ("language_modeling", ["--fwp-update-rule", "gated-delta", "--fwp-feature-map", "silu",
                                             "--fwp-qk-norm", "l2", "--fwp-short-conv", "4",
                                             "--fwp-output-gate", "on"]),
    # uptrained from the softmax row, keeping its positions (issue 20)
    **{row: ("language_modeling", spec) for row, spec in uptrained_rows("linear-delta", ["--fwp-positions", "on"]).items()},
}
WIKITEXT2_LENGTH = 64
# Rows with other (streams, tokens per segment) than 16 x 64 (the same tokens per update): 4 streams of
# 54K tokens, as long as the test part, and backpropagation through 256 tokens. Scored with the state
# carried only (a sliding window of 256 tokens per test token would cost 4x the others).
STREAM_SHAPES = {"linear-delta-carry-long": (4, 256)}


def stream_shape(row):
    """(streams, tokens per segment) of a WikiText-2 row."""
    return STREAM_SHAPES.get(row, (16, WIKITEXT2_LENGTH))


# test.txt from the article boundary nearest 3/4 of the way is the test part: the
# sliding window costs one L-token forward per test token, so it is kept small.
TEST_FROM = 0.75
WIKITEXT2_MODEL = ["--decoder-layers", "4", "--decoder-embed-dim", "128", "--decoder-ffn-embed-dim", "512",
                   "--decoder-attention-heads", "4", "--share-decoder-input-output-embed", "--dropout", "0.2"]
WIKITEXT2_TRAINING = ["--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--lr", "0.001",
                      "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "500", "--no-epoch-checkpoints",
                      "--log-format", "simple", "--log-interval", "50"]


def train_words_per_second(log):
    """Words per second over the whole training: fairseq's end-of-epoch wps weighted by each epoch's
    train_wall (a plain mean would count a final epoch of a few updates, and its low wps, as much as
    a full one)."""
    epochs = [(float(wps), float(wall)) for wps, wall in
              re.findall(r"\| train \| .*?\| wps ([0-9.]+) \|.*?\| train_wall ([0-9.]+)", log)]
    seconds = sum(wall for _, wall in epochs)
    return sum(wps * wall for wps, wall in epochs) / seconds if seconds else None


def shared_corpus(data_dir, name):
    source = os.path.join(data_dir, name)
    if not os.path.isdir(source):
        raise FileNotFoundError(f"{source} is missing: pass --data-dir (see ../shared/data/README.md)")
    return source


def prepare_multi30k(data_dir, out):
    source = shared_corpus(data_dir, "multi30k")
    if os.path.exists(os.path.join(out, "bin", "dict.en.txt")):
        return
    read = lambda stem, lang: text.read_lines(os.path.join(source, f"{stem}.{lang}.gz"))  # noqa: E731
    pairs = {split: [(read(stem, "en"), read(stem, "de"))]
             for split, stem in (("train", "train"), ("valid", "val"), ("test", "test_2016_flickr"))}
    translation.prepare(pairs, "en", "de", out, merges=6000, workers=2)


def uptraining(out, row_flags, save, train_argv, max_update):
    """For an Uptrained row: converts its source row's best checkpoint. Returns (the row's flags,
    the converted checkpoint or None, fairseq-train's budget flags, the budget's split to record)."""
    if not isinstance(row_flags, Uptrained):
        return row_flags, None, ["--max-update", str(max_update)], {}
    source = os.path.join(out, "checkpoints", row_flags.source, "checkpoint_best.pt")
    if not os.path.exists(source):
        raise FileNotFoundError(f"{source} is missing: run the row {row_flags.source!r} first")
    os.makedirs(save, exist_ok=True)
    converted = os.path.join(save, "converted.pt")
    start = time.time()
    uptrain.convert(source, converted, train_argv + row_flags.flags, row_flags.transfer_steps)
    updates = max_update // 4 - row_flags.transfer_steps
    warmup = min(UPTRAINING_WARMUP, updates // 2)
    budget = ["--max-update", str(updates), "--warmup-updates", str(warmup), "--finetune-from-model", converted]
    record = {"uptraining_updates": updates, "attention_transfer_steps": row_flags.transfer_steps,
              "conversion_seconds": round(time.time() - start, 1)}
    if row_flags.source_lr:
        record["uptraining_lr"] = uptrain.final_learning_rate(source)
        budget += ["--lr", repr(record["uptraining_lr"])]
    if row_flags.distillation:
        record["distillation_weight"] = row_flags.distillation
        budget += ["--criterion", "fwp_distillation", "--teacher-checkpoint", source,
                   "--distillation-weight", str(row_flags.distillation)]
    return row_flags.flags, converted, budget, record


def run_multi30k_row(out, row, max_update, seed):
    save, data_bin = os.path.join(out, "checkpoints", row), os.path.join(out, "bin")
    hyper = MULTI30K_MODEL + MULTI30K_TRAINING + ["--seed", str(seed)]
    flags, converted, budget, result = uptraining(out, MULTI30K_ROWS[row], save, [
        data_bin, "--user-dir", PLUGIN_DIR, "--arch", "fwp_transformer_tiny", *hyper], max_update)
    if converted:  # the quality right after conversion (and attention transfer), before any update
        before = translation.translate_and_score(out, converted, "en", "de", MULTI30K_GENERATE,
                                                 os.path.join(save, "converted"))
        result["bleu_converted"] = before["sacrebleu"]
    log = translation.train(data_bin, save, "fwp_transformer_tiny", flags, hyper, budget)
    return dict(result, train_wps=train_words_per_second(log), **evaluate_multi30k_row(out, row))


MULTI30K_GENERATE = ["--beam", "4", "--lenpen", "0.6", "--batch-size", "64"]


def evaluate_multi30k_row(out, row):
    """BLEU and decoding speed of a trained row's best checkpoint."""
    save = os.path.join(out, "checkpoints", row)
    scores = translation.translate_and_score(out, os.path.join(save, "checkpoint_best.pt"), "en", "de",
                                             MULTI30K_GENERATE, os.path.join(save, "test"))
    return {"bleu": scores["sacrebleu"], "tokenized_bleu": scores["tokenized_bleu"],
            "signature": scores["sacrebleu_signature"], "generate_tokens_per_s": scores["generate_tokens_per_s"]}


def split_at_article_boundary(lines, fraction):
    """WikiText lines cut before the top-level title nearest `fraction` of the way through."""
    titles = [i for i, line in enumerate(lines) if re.match(r"^ = [^=].* = $", line)]
    cut = min(titles, key=lambda i: abs(i - int(len(lines) * fraction)))
    return lines[:cut], lines[cut:]


def prepare_wikitext2(data_dir, out):
    source = shared_corpus(data_dir, "wikitext-2")
    if os.path.exists(os.path.join(out, "bin", "dict.txt")):
        return
    raw = os.path.join(out, "raw")
    os.makedirs(raw, exist_ok=True)
    valid, test = split_at_article_boundary(text.read_lines(os.path.join(source, "test.txt")), TEST_FROM)
    text.write_lines(os.path.join(raw, "train.txt"), text.read_lines(os.path.join(source, "valid.txt")))
    text.write_lines(os.path.join(raw, "valid.txt"), valid)
    text.write_lines(os.path.join(raw, "test.txt"), test)
    language_model.prepare(*(os.path.join(raw, f"{s}.txt") for s in ("train", "valid", "test")), out, workers=2)


def run_wikitext2_row(out, row, max_update, seed):
    task, flags = WIKITEXT2_ROWS[row]
    save, data_bin = os.path.join(out, "checkpoints", row), os.path.join(out, "bin")
    hyper = WIKITEXT2_MODEL + WIKITEXT2_TRAINING + ["--seed", str(seed)]
    streams, length = stream_shape(row)
    task_flags = language_model.task_flags(task, length, streams)
    flags, converted, budget, result = uptraining(out, flags, save, [
        data_bin, "--user-dir", PLUGIN_DIR, "--arch", "fwp_lm_tiny", *map(str, task_flags), *hyper], max_update)
    if converted:  # the perplexity right after conversion (and attention transfer), before any update
        result["test_ppl_converted"] = language_model.evaluate(data_bin, converted, "sliding",
                                                               WIKITEXT2_LENGTH)["perplexity"]
    log = language_model.train(data_bin, save, "fwp_lm_tiny", task, length, streams, flags, hyper, budget)
    result["train_wps"] = train_words_per_second(log)
    return dict(result, **evaluate_wikitext2_row(out, row))


def evaluate_wikitext2_row(out, row):
    """Test perplexity of a trained row's best checkpoint: the sliding window, and for a carry-over
    row also the state carried through the whole test part."""
    task, _ = WIKITEXT2_ROWS[row]
    checkpoint = os.path.join(out, "checkpoints", row, "checkpoint_best.pt")
    length = stream_shape(row)[1]
    if task != "fwp_stream_lm":
        protocols = ("sliding",)
    else:  # rows of other stream shapes: carried only (see STREAM_SHAPES)
        protocols = ("carry",) if row in STREAM_SHAPES else ("sliding", "carry")
    result = {}
    for protocol in protocols:
        ppl = language_model.evaluate(os.path.join(out, "bin"), checkpoint, protocol, length)
        result[f"test_ppl_{protocol}"] = ppl["perplexity"]
        result[f"test_tokens_{protocol}"] = ppl["tokens"]
    return result


def save_result(path, row, result):
    """Write one row into the results file, keeping the rows other runs of the recipe wrote to it since
    this one read it (rows of one corpus may train side by side), and never leaving a half-written file."""
    results = json.load(open(path)) if os.path.exists(path) else {}
    results[row] = result
    temporary = f"{path}.{os.getpid()}.tmp"  # one per process, so two writers never share it
    with open(temporary, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(temporary, path)


CORPORA = {  # prepare, train and evaluate a row, evaluate a trained row, rows, default updates
    "multi30k": (prepare_multi30k, run_multi30k_row, evaluate_multi30k_row, MULTI30K_ROWS, 1200),
    "wikitext2": (prepare_wikitext2, run_wikitext2_row, evaluate_wikitext2_row, WIKITEXT2_ROWS, 1500),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", choices=CORPORA)
    parser.add_argument("--out", required=True)
    parser.add_argument("--data-dir", default=DEFAULT_DATA, help="the folder with multi30k/ and wikitext-2/")
    parser.add_argument("--rows", nargs="+", help="a subset of the corpus's rows (default: all)")
    parser.add_argument("--max-update", type=int, help="training updates per row")
    parser.add_argument("--seed", type=int, default=1,
                        help="fairseq's --seed (default 1, the recorded rows'); another seed wants another --out")
    parser.add_argument("--evaluate-only", action="store_true",
                        help="evaluate the rows already trained again (e.g. decoding speed after a code change)")
    args = parser.parse_args(argv)
    prepare, run_row, evaluate_row, table, default_updates = CORPORA[args.corpus]
    unknown = set(args.rows or []) - set(table)
    if unknown:
        parser.error(f"--rows: {', '.join(sorted(unknown))} not among {', '.join(table)}")

    prepare(args.data_dir, args.out)
    results_path = os.path.join(args.out, "results.json")
    results = json.load(open(results_path)) if os.path.exists(results_path) else {}
    for row in args.rows or table:
        if args.evaluate_only and row in results:
            results[row].update(evaluate_row(args.out, row))
        elif row in results or args.evaluate_only:
            continue
        else:
            results[row] = run_row(args.out, row, args.max_update or default_updates, args.seed)
            results[row].update(max_update=args.max_update or default_updates, seed=args.seed)
        save_result(results_path, row, results[row])
        print(f"{row}: {json.dumps(results[row])}", flush=True)
    if os.path.exists(results_path):
        results = json.load(open(results_path))  # with the rows of any run beside this one
    for row, result in results.items():
        print(f"| {row} | " + " | ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in result.items() if k != "signature") + " |")


if __name__ == "__main__":
    main()
