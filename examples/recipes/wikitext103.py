"""WikiText-103 language modelling, the paper's Tables 2-5.

    python -m examples.recipes.wikitext103 prepare --download --out data/wikitext-103
    python -m examples.recipes.wikitext103 prepare --raw-dir DIR --out data/wikitext-103  # wiki.*.tokens or the zip
    python -m examples.recipes.wikitext103 train --data data/wikitext-103 --table table2 --row delta \\
        --size small --save-dir ckpt/t2-delta-small [--gpus 2]
    python -m examples.recipes.wikitext103 evaluate --data data/wikitext-103 --table table2 --row delta \\
        --size small --checkpoint ckpt/t2-delta-small/checkpoint_best.pt

Training follows the paper (Sec. 6.3, Appendix F): small = 16 layers, D 128,
L 256, 96 sequences per batch, about 120 epochs; medium = D 256, L 384, 56
sequences, about 70 epochs; Adam, lr 0.00025, 2000 warm-up steps, dropout 0.1.
Table 4 rows train and evaluate with task fwp_stream_lm (fast weights carried
across segments); the other tables with the sliding window. Anything after
`--` goes to fairseq as is.
"""
import argparse
import json
import os
import urllib.request
import zipfile

from . import cli, language_model, rows

URLS = ["https://wikitext.smerity.com/wikitext-103-v1.zip",
        "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip"]
FILES = {"train": "wiki.train.tokens", "valid": "wiki.valid.tokens", "test": "wiki.test.tokens"}
SIZES = {  # arch, L, sequences per batch, epochs
    "small": ("fwp_lm_wiki103_small", 256, 96, 120),
    "medium": ("fwp_lm_wiki103_medium", 384, 56, 70),
}
# The archs' adaptive softmax trains with adaptive_loss, which fairseq builds with its own DDP only.
HYPERPARAMETERS = ["--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--lr", "0.00025",
                   "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "2000", "--dropout", "0.1",
                   "--criterion", "adaptive_loss", "--ddp-backend", "legacy_ddp"]


def download(folder):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "wikitext-103-v1.zip")
    for url in URLS:
        if os.path.exists(path):
            break
        try:
            print(f"downloading {url}", flush=True)
            urllib.request.urlretrieve(url, path + ".part")
            os.replace(path + ".part", path)
        except OSError as err:
            print(f"  failed: {err}")
    if not os.path.exists(path):
        raise RuntimeError(f"could not download WikiText-103 from {', '.join(URLS)}")


def find_splits(raw_dir):
    """Paths of wiki.{train,valid,test}.tokens under raw_dir, unzipping an archive found there first."""
    for entry in os.listdir(raw_dir):
        if entry.endswith(".zip"):
            with zipfile.ZipFile(os.path.join(raw_dir, entry)) as archive:
                archive.extractall(raw_dir)
    found = {name: os.path.join(root, name) for root, _, names in os.walk(raw_dir) for name in names}
    missing = [f for f in FILES.values() if f not in found]
    if missing:
        raise FileNotFoundError(f"not under {raw_dir}: {', '.join(missing)} (--download fetches them)")
    return {split: found[name] for split, name in FILES.items()}


def train_row(data, table, row, size, save_dir, gpus=1, extra=()):
    arch, length, batch, epochs = SIZES[size]
    spec = rows.wikitext103_row(table, row, size)
    per_gpu = max(1, batch // gpus)
    return language_model.train(os.path.join(data, "bin"), save_dir, arch, spec.task, length, per_gpu,
                                spec.flags_for(size), HYPERPARAMETERS + ["--max-epoch", epochs], extra)


def add_row_arguments(parser):
    parser.add_argument("--data", required=True, help="the prepare step's --out")
    parser.add_argument("--table", required=True, choices=rows.LM_TABLES)
    parser.add_argument("--row", required=True, help="a row of --table (see examples/recipes/rows.py)")
    parser.add_argument("--size", required=True, choices=SIZES)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    prep = steps.add_parser("prepare", help="download or read, binarise")
    cli.add_source_arguments(prep)
    train = steps.add_parser("train")
    add_row_arguments(train)
    train.add_argument("--save-dir", required=True)
    train.add_argument("--gpus", type=int, default=1, help="GPUs used: the batch is split across them")
    evaluate = steps.add_parser("evaluate")
    add_row_arguments(evaluate)
    evaluate.add_argument("--checkpoint", required=True)
    evaluate.add_argument("--subset", default="test", choices=("valid", "test"))
    cli.add_fairseq_passthrough(train, evaluate)
    args = parser.parse_args(argv)

    if args.step == "prepare":
        splits = find_splits(cli.raw_folder(args, download))
        language_model.prepare(splits["train"], splits["valid"], splits["test"], args.out, args.workers)
        return
    try:
        spec = rows.wikitext103_row(args.table, args.row, args.size)
    except ValueError as err:
        parser.error(f"--row/--size: {err}")
    extra = cli.fairseq_passthrough(args)
    if args.step == "train":
        train_row(args.data, args.table, args.row, args.size, args.save_dir, args.gpus, extra)
    else:
        protocol = "carry" if spec.task == "fwp_stream_lm" else "sliding"
        result = language_model.evaluate(os.path.join(args.data, "bin"), args.checkpoint, protocol,
                                         SIZES[args.size][1], args.subset, extra=extra)
        result["paper_test_perplexity"] = spec.paper[args.size]
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
