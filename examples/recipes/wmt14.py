"""WMT14 English-German, the paper's Table 1.

    python -m examples.recipes.wmt14 prepare --download --out data/wmt14_en_de
    python -m examples.recipes.wmt14 prepare --raw-dir DIR --out data/wmt14_en_de   # files or archives already here
    python -m examples.recipes.wmt14 train --data data/wmt14_en_de --row dpfp-256 --save-dir ckpt/dpfp-256 [--gpus 3]
    python -m examples.recipes.wmt14 evaluate --data data/wmt14_en_de --checkpoint ckpt/dpfp-256/checkpoint_best.pt

Data: Europarl v7, Common Crawl and News Commentary v9 for training,
newstest2013 for validation, newstest2014 (full, 3003 sentences) for test.
Anything after `--` on train/evaluate goes to fairseq-train/-generate as is.
"""
import argparse
import json
import math
import os
import re
import tarfile
import urllib.request

from . import bpe, cli, rows, text, translation

ARCHIVES = {
    "training-parallel-europarl-v7.tgz": "http://statmt.org/wmt13/training-parallel-europarl-v7.tgz",
    "training-parallel-commoncrawl.tgz": "http://statmt.org/wmt13/training-parallel-commoncrawl.tgz",
    "training-parallel-nc-v9.tgz": "http://statmt.org/wmt14/training-parallel-nc-v9.tgz",
    "dev.tgz": "http://statmt.org/wmt14/dev.tgz",
    "test-full.tgz": "http://statmt.org/wmt14/test-full.tgz",
}
TRAIN = ["europarl-v7.de-en", "commoncrawl.de-en", "news-commentary-v9.de-en"]  # + .en / .de
VALID = "newstest2013"  # + .en / .de
TEST = ("newstest2014-deen-src.en.sgm", "newstest2014-deen-ref.de.sgm")

# The paper's training (Appendix E): fairseq's transformer big recipe on 3 GPUs x 3584 tokens
# x 16 accumulated batches for 45 epochs; the best checkpoint by validation BLEU.
TOKENS_PER_UPDATE_GPUS = 3 * 16
HYPERPARAMETERS = [
    "--share-all-embeddings", "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--clip-norm", "0.0",
    "--lr", "0.0005", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4000", "--dropout", "0.3",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", "3584",
    "--max-epoch", "45", "--eval-bleu", "--eval-bleu-args", '{"beam": 4, "lenpen": 0.6, "max_len_a": 1.2, "max_len_b": 10}',
    "--eval-bleu-detok", "moses", "--eval-bleu-remove-bpe", "--best-checkpoint-metric", "bleu",
    "--maximize-best-checkpoint-metric",
]
GENERATE = ["--beam", "4", "--lenpen", "0.6", "--batch-size", "128"]


def download(raw_dir):
    os.makedirs(raw_dir, exist_ok=True)
    for name, url in ARCHIVES.items():
        path = os.path.join(raw_dir, name)
        if not os.path.exists(path):
            print(f"downloading {url}", flush=True)
            urllib.request.urlretrieve(url, path + ".part")
            os.replace(path + ".part", path)


def find_files(raw_dir):
    """{file name: path} of every file under raw_dir, extracting .tgz archives first."""
    for entry in os.listdir(raw_dir):
        if entry.endswith((".tgz", ".tar.gz")) and not os.path.exists(os.path.join(raw_dir, entry + ".extracted")):
            with tarfile.open(os.path.join(raw_dir, entry)) as archive:
                archive.extractall(raw_dir, filter="data")
            open(os.path.join(raw_dir, entry + ".extracted"), "w").close()
    return {name: os.path.join(root, name) for root, _, names in os.walk(raw_dir) for name in names}


def read_sgm(path):
    """The segments of a WMT .sgm file, in order."""
    with open(path, encoding="utf-8") as f:
        return [m.group(1).strip().replace("\u2019", "'") for m in re.finditer(r"<seg id=\"?\d+\"?>(.*)</seg>", f.read())]


def raw_pairs(raw_dir):
    files = find_files(raw_dir)
    needed = [f"{c}.{lang}" for c in TRAIN for lang in ("en", "de")] + [f"{VALID}.en", f"{VALID}.de", *TEST]
    missing = [name for name in needed if name not in files]
    if missing:
        raise FileNotFoundError(f"not under {raw_dir}: {', '.join(missing)} (--download fetches them)")
    pair = lambda stem: (text.read_lines(files[f"{stem}.en"]), text.read_lines(files[f"{stem}.de"]))  # noqa: E731
    return {"train": [pair(c) for c in TRAIN], "valid": [pair(VALID)],
            "test": [(read_sgm(files[TEST[0]]), read_sgm(files[TEST[1]]))]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    prep = steps.add_parser("prepare", help="download or read, tokenise, clean, BPE, binarise")
    cli.add_source_arguments(prep)
    prep.add_argument("--bpe-merges", type=int, default=32000)
    prep.add_argument("--bpe-tool", choices=bpe.BPE_TOOLS, default="subword-nmt",
                      help="subword-nmt (as fairseq's prepare-wmt14en2de.sh) or fastbpe (much faster on 4.5M pairs)")

    train = steps.add_parser("train", help="fairseq-train one Table 1 row with the paper's hyperparameters")
    train.add_argument("--data", required=True, help="the prepare step's --out")
    train.add_argument("--row", required=True, choices=rows.WMT14)
    train.add_argument("--save-dir", required=True)
    train.add_argument("--gpus", type=int, default=1, help="GPUs used: --update-freq keeps 3 x 16 x 3584 tokens")
    train.add_argument("--arch", default="fwp_transformer_wmt_en_de_big")

    evaluate = steps.add_parser("evaluate", help="beam 4, lenpen 0.6: sacreBLEU and tokenised BLEU on newstest2014")
    evaluate.add_argument("--data", required=True)
    evaluate.add_argument("--checkpoint", required=True)
    evaluate.add_argument("--row", choices=rows.WMT14, help="print the paper's BLEU beside ours")
    cli.add_fairseq_passthrough(train, evaluate)
    args = parser.parse_args(argv)

    if args.step == "prepare":
        translation.prepare(raw_pairs(cli.raw_folder(args, download)), "en", "de", args.out, args.bpe_merges,
                            args.workers, args.bpe_tool)
    elif args.step == "train":
        update_freq = max(1, math.ceil(TOKENS_PER_UPDATE_GPUS / args.gpus))
        translation.train(os.path.join(args.data, "bin"), args.save_dir, args.arch, rows.WMT14[args.row].flags_for(),
                          HYPERPARAMETERS + ["--update-freq", str(update_freq)], cli.fairseq_passthrough(args))
    else:
        scores = translation.translate_and_score(args.data, args.checkpoint, "en", "de", GENERATE,
                                                 os.path.splitext(args.checkpoint)[0] + ".test",
                                                 cli.fairseq_passthrough(args))
        if args.row:
            scores["paper_bleu"] = rows.WMT14[args.row].paper["big"]
        print(json.dumps(scores, indent=1))



if __name__ == "__main__":
    main()
