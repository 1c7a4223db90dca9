"""Small real-data comparisons that run on a CPU: Multi30k En-De and WikiText-2.

    python -m examples.recipes.small_real_data multi30k --download --out runs/multi30k [--rows ...]
    python -m examples.recipes.small_real_data wikitext2 --download --out runs/wikitext2 [--rows ...]

The corpora are read from --data-dir (default: data/ in the repository,
which git ignores): multi30k/ and wikitext-2/; --download first fetches
what is missing there from the corpora's public sources (SOURCES; or from
--source-url, another copy with the same file names). The rows are in
recipes/rows.py (MULTI30K, WIKITEXT2). Every row trains the same small model with the same budget,
differing only in its --fwp-* flags; results (BLEU or perplexity, and
training words/s) go to OUT/results.json and a markdown table on stdout.
Rows whose results are already in OUT/results.json are skipped, so an
interrupted run resumes; --evaluate-only evaluates trained rows again.

- multi30k: 29K training pairs; joint BPE (6K merges); a 2+2-layer
  Transformer of width 128 with 2 heads (d_key 64, as in the paper, so the
  Table 1 feature sizes carry over); Adam with inverse-sqrt schedule, label
  smoothing 0.1; the checkpoint with the best validation loss translates
  test_2016_flickr with beam 4 (sacreBLEU on detokenised output).
- wikitext2: small enough for a CPU: valid.txt is the training text and
  test.txt is cut at the article boundary nearest 3/4
  of the way through: the first part validates, the last quarter is the
  test part (the sliding window costs one L-token forward per test token).
  A 4-layer LM of width 128 with 4 heads, L = 64; test perplexity with the
  paper's sliding window (windows of L, stride 1), and for the carry-over
  row also with the state carried through the whole test part.
"""
import argparse
import json
import os
import re
import time
import urllib.request

from fairseq_fwp.uptraining import conversion
from . import language_model, prepared, rows, text, translation
from .pipeline import train_words_per_second
from .commands import PLUGIN_DIR

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data")
# Where each corpus comes from: (its folder under --data-dir, the public folder, the files read).
SOURCES = {
    "multi30k": ("multi30k", "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/",
                 [f"{split}.{lang}.gz" for split in ("train", "val", "test_2016_flickr") for lang in ("en", "de")]),
    "wikitext2": ("wikitext-2", "https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/"
                                "wikitext-2/", ["valid.txt", "test.txt"]),
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

WIKITEXT2_LENGTH = 64


def stream_shape(row):
    """(streams, tokens per segment) of a WikiText-2 row: 16 x 64, unless the row says otherwise."""
    return rows.WIKITEXT2[row].streams or (16, WIKITEXT2_LENGTH)


# test.txt from the article boundary nearest 3/4 of the way is the test part: the
# sliding window costs one L-token forward per test token, so it is kept small.
TEST_FROM = 0.75
WIKITEXT2_MODEL = ["--decoder-layers", "4", "--decoder-embed-dim", "128", "--decoder-ffn-embed-dim", "512",
                   "--decoder-attention-heads", "4", "--share-decoder-input-output-embed", "--dropout", "0.2"]
WIKITEXT2_TRAINING = ["--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--lr", "0.001",
                      "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "500", "--no-epoch-checkpoints",
                      "--log-format", "simple", "--log-interval", "50"]


def download(corpus, data_dir, source_url=None):
    """Fetches the corpus's files that --data-dir lacks, from its public source or `source_url`."""
    folder, url, names = SOURCES[corpus]
    os.makedirs(os.path.join(data_dir, folder), exist_ok=True)
    for name in names:
        path = os.path.join(data_dir, folder, name)
        if not os.path.exists(path):
            print(f"downloading {(source_url or url) + name}", flush=True)
            urllib.request.urlretrieve((source_url or url) + name, path + ".part")
            os.replace(path + ".part", path)


def corpus_folder(corpus, data_dir):
    """The corpus's folder under data_dir, with every file the recipe reads."""
    folder, url, names = SOURCES[corpus]
    missing = [name for name in names if not os.path.exists(os.path.join(data_dir, folder, name))]
    if missing:
        raise FileNotFoundError(f"{os.path.join(data_dir, folder)} lacks {', '.join(missing)}: add --download to "
                                f"fetch them from {url}, or point --data-dir at a copy")
    return os.path.join(data_dir, folder)


def prepare_multi30k(data_dir, out):
    source = corpus_folder("multi30k", data_dir)
    if prepared.is_prepared(out):
        return
    read = lambda stem, lang: text.read_lines(os.path.join(source, f"{stem}.{lang}.gz"))  # noqa: E731
    pairs = {split: [(read(stem, "en"), read(stem, "de"))]
             for split, stem in (("train", "train"), ("valid", "val"), ("test", "test_2016_flickr"))}
    translation.prepare(pairs, "en", "de", out, merges=6000, workers=2)


UPTRAINING_WARMUP = 100


def uptraining(out, row, save, train_argv, max_update):
    """For a row uptrained from another (rows.Uptraining): converts the source row's best checkpoint.
    Returns (the converted checkpoint or None, fairseq-train's budget flags, the budget's split to record)."""
    up = row.uptraining
    if up is None:
        return None, ["--max-update", str(max_update)], {}
    source = os.path.join(out, "checkpoints", up.source, "checkpoint_best.pt")
    if not os.path.exists(source):
        raise FileNotFoundError(f"{source} is missing: run the row {up.source!r} first")
    os.makedirs(save, exist_ok=True)
    converted = os.path.join(save, "converted.pt")
    start = time.time()
    conversion.convert(source, converted, train_argv + list(row.flags), up.transfer_steps)
    updates = max_update // 4 - up.transfer_steps
    warmup = min(UPTRAINING_WARMUP, updates // 2)
    budget = ["--max-update", str(updates), "--warmup-updates", str(warmup), "--finetune-from-model", converted]
    record = {"uptraining_updates": updates, "attention_transfer_steps": up.transfer_steps,
              "conversion_seconds": round(time.time() - start, 1)}
    if up.source_lr:
        record["uptraining_lr"] = conversion.final_learning_rate(source)
        budget += ["--lr", repr(record["uptraining_lr"])]
    if up.distillation:
        record["distillation_weight"] = up.distillation
        budget += ["--criterion", "fwp_distillation", "--teacher-checkpoint", source,
                   "--distillation-weight", str(up.distillation)]
    return converted, budget, record


def run_multi30k_row(out, row, max_update, seed):
    save, data_bin = os.path.join(out, "checkpoints", row), os.path.join(out, "bin")
    hyper = MULTI30K_MODEL + MULTI30K_TRAINING + ["--seed", str(seed)]
    spec = rows.MULTI30K[row]
    converted, budget, result = uptraining(out, spec, save, [
        data_bin, "--user-dir", PLUGIN_DIR, "--arch", "fwp_transformer_tiny", *hyper], max_update)
    if converted:  # the quality right after conversion (and attention transfer), before any update
        before = translation.translate_and_score(out, converted, "en", "de", MULTI30K_GENERATE,
                                                 os.path.join(save, "converted"))
        result["bleu_converted"] = before["sacrebleu"]
    log = translation.train(data_bin, save, "fwp_transformer_tiny", list(spec.flags), hyper, budget)
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
    source = corpus_folder("wikitext2", data_dir)
    with prepared.preparing(out) as staging:  # once per OUT, whoever else prepares it at the same time
        if staging is None:
            return
        raw = os.path.join(staging, "raw")
        os.makedirs(raw)
        valid, test = split_at_article_boundary(text.read_lines(os.path.join(source, "test.txt")), TEST_FROM)
        text.write_lines(os.path.join(raw, "train.txt"), text.read_lines(os.path.join(source, "valid.txt")))
        text.write_lines(os.path.join(raw, "valid.txt"), valid)
        text.write_lines(os.path.join(raw, "test.txt"), test)
        language_model.binarise(*(os.path.join(raw, f"{s}.txt") for s in ("train", "valid", "test")),
                                os.path.join(staging, "bin"), workers=2)


def run_wikitext2_row(out, row, max_update, seed):
    spec = rows.WIKITEXT2[row]
    save, data_bin = os.path.join(out, "checkpoints", row), os.path.join(out, "bin")
    hyper = WIKITEXT2_MODEL + WIKITEXT2_TRAINING + ["--seed", str(seed)]
    streams, length = stream_shape(row)
    task_flags = language_model.task_flags(spec.task, length, streams)
    converted, budget, result = uptraining(out, spec, save, [
        data_bin, "--user-dir", PLUGIN_DIR, "--arch", "fwp_lm_tiny", *map(str, task_flags), *hyper], max_update)
    if converted:  # the perplexity right after conversion (and attention transfer), before any update
        result["test_ppl_converted"] = language_model.evaluate(data_bin, converted, "sliding",
                                                               WIKITEXT2_LENGTH)["perplexity"]
    log = language_model.train(data_bin, save, "fwp_lm_tiny", spec.task, length, streams, list(spec.flags), hyper,
                               budget)
    result["train_wps"] = train_words_per_second(log)
    return dict(result, **evaluate_wikitext2_row(out, row))


def evaluate_wikitext2_row(out, row):
    """Test perplexity of a trained row's best checkpoint: the sliding window, and for a carry-over
    row also the state carried through the whole test part."""
    spec = rows.WIKITEXT2[row]
    checkpoint = os.path.join(out, "checkpoints", row, "checkpoint_best.pt")
    length = stream_shape(row)[1]
    if spec.task != "fwp_stream_lm":
        protocols = ("sliding",)
    else:  # rows of other stream shapes: carried only (rows.py)
        protocols = ("carry",) if spec.streams else ("sliding", "carry")
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
    "multi30k": (prepare_multi30k, run_multi30k_row, evaluate_multi30k_row, rows.MULTI30K, 1200),
    "wikitext2": (prepare_wikitext2, run_wikitext2_row, evaluate_wikitext2_row, rows.WIKITEXT2, 1500),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", choices=CORPORA)
    parser.add_argument("--out", required=True)
    parser.add_argument("--data-dir", default=DEFAULT_DATA,
                        help="the folder with multi30k/ and wikitext-2/ (default: data/ in the repository)")
    parser.add_argument("--download", action="store_true", help="first fetch the corpus's missing files")
    parser.add_argument("--source-url", help="with --download: another copy of the files (a folder's URL, "
                                             "file:// included) instead of the public source")
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

    if args.download:
        download(args.corpus, args.data_dir, args.source_url)
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
