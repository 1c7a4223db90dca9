"""fairseq's published transformer.wmt16.en-de (transformer_vaswani_wmt_en_de_big, 28.6 sacreBLEU on
newstest2014 by its README) uptrained into fast-weight models, for a user with GPUs and network.

    python -m examples.recipes.wmt16_uptraining prepare --download --out data/wmt16_en_de
    python -m examples.recipes.wmt16_uptraining convert --data data/wmt16_en_de --row dpfp-256 --out models/dpfp-256
    python -m examples.recipes.wmt16_uptraining finetune --data data/wmt16_en_de --row dpfp-256 --model models/dpfp-256 \\
        --save-dir ckpt/dpfp-256 [--gpus 8]
    python -m examples.recipes.wmt16_uptraining evaluate --data data/wmt16_en_de --checkpoint ckpt/dpfp-256/checkpoint_best.pt

- prepare: the training data as fairseq's scaling_nmt example prepares it (Google's preprocessed WMT'16
  En-De: tokenised, BPE'd with 32K joint codes), binarised with the published model's own dictionary, so
  that every token index means what it meant to the model; the model is fetched into the cache once.
- convert: ``python -m fairseq_fwp.uptrain --pretrained transformer.wmt16.en-de`` with the row's flags
  (WMT16_ROWS), then ATTENTION_TRANSFER_STEPS of attention transfer on the training batches.
- finetune: fairseq-train from the converted model, with the original as the distillation teacher
  (--criterion fwp_distillation), FINETUNE_UPDATES updates at the published model's batch (3584 tokens x
  128 GPUs' worth, through --update-freq).
- evaluate: newstest2014 (3003 sentences), beam 4, length penalty 0.6, sacreBLEU on detokenised output;
  ``--original`` scores the published model with the same command, beside it.
Anything after `--` goes to fairseq as it is.
"""
import argparse
import json
import os
import subprocess
import sys
import tarfile
import urllib.request

from fairseq_fwp import pretrained

from . import cli, text
from .commands import PLUGIN_DIR, fairseq

PUBLISHED = "transformer.wmt16.en-de"
GOOGLE_DATA = "https://drive.google.com/uc?export=download&id=0B_bZck-ksdkpM25jRUN2X2UxMm8"  # scaling_nmt's link
WMT16_ROWS = {  # the row's --fwp-* flags over the published model's own architecture and options
    "dpfp-256": ["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "2"],  # Table 1's best: the sum rule, D = 256
    "gated-delta-decoder": ["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "2", "--fwp-update-rule", "gated-delta"],
    "hybrid-2": ["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "2", "--fwp-softmax-layers", "2,5"],
}
ATTENTION_TRANSFER_STEPS = 500
FINETUNE_UPDATES = 30000  # the finetuning budget (the cost estimate in docs/uptraining.md is for this)
PUBLISHED_GPUS = 128  # the published model's batch: 3584 tokens on each of 128 GPUs
FINETUNE = ["--share-all-embeddings", "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--clip-norm", "0.0",
            "--lr", "0.0005", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "1000", "--dropout", "0.3",
            "--max-tokens", "3584", "--max-update", str(FINETUNE_UPDATES), "--criterion", "fwp_distillation",
            "--label-smoothing", "0.1", "--distillation-weight", "0.5", "--fp16"]
GENERATE = ["--beam", "4", "--lenpen", "0.6", "--batch-size", "128", "--remove-bpe"]


def prepare(args):
    """Download and extract Google's data (or read --raw-dir), binarise it with the model's dictionary."""
    raw = cli.raw_folder(args, lambda folder: _download(folder))
    model = pretrained.fetch(PUBLISHED)
    stem = {"train": "train.tok.clean.bpe.32000", "valid": "newstest2013.tok.bpe.32000",
            "test": "newstest2014.tok.bpe.32000"}
    fairseq("preprocess", "--source-lang", "en", "--target-lang", "de",
            *[x for split, name in stem.items() for x in (f"--{split}pref", os.path.join(raw, name))],
            "--srcdict", os.path.join(model, "dict.en.txt"), "--tgtdict", os.path.join(model, "dict.de.txt"),
            "--destdir", os.path.join(args.out, "bin"), "--workers", args.workers, echo=True)
    with open(os.path.join(args.out, "model"), "w") as f:
        f.write(model + "\n")  # where the published model is: the teacher


def _download(folder):
    os.makedirs(folder, exist_ok=True)
    archive = os.path.join(folder, "wmt16_en_de.tar.gz")
    if not os.path.exists(archive):
        print(f"downloading {GOOGLE_DATA}", flush=True)
        urllib.request.urlretrieve(GOOGLE_DATA, archive + ".part")
        os.replace(archive + ".part", archive)
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")


def original(data):
    return os.path.join(open(os.path.join(data, "model")).read().strip(), "model.pt")


def convert(args):
    base = [sys.executable, "-m", "fairseq_fwp.uptrain"]
    subprocess.run([*base, "--pretrained", PUBLISHED, "--out", args.out, "--", *WMT16_ROWS[args.row]], check=True)
    if ATTENTION_TRANSFER_STEPS:
        model = os.path.join(args.out, "model.pt")
        train_argv = [os.path.join(args.data, "bin"), "--user-dir", PLUGIN_DIR, "--task", "translation",
                      "--arch", "fwp_transformer", "--max-tokens", "3584", *WMT16_ROWS[args.row]]
        subprocess.run([*base, "--softmax-checkpoint", original(args.data), "--out", model,
                        "--attention-transfer-steps", str(ATTENTION_TRANSFER_STEPS), "--", *train_argv], check=True)


def finetune(args):
    update_freq = max(1, PUBLISHED_GPUS // args.gpus)
    fairseq("train", os.path.join(args.data, "bin"), "--user-dir", PLUGIN_DIR, "--arch", "fwp_transformer",
            *WMT16_ROWS[args.row], *FINETUNE, "--update-freq", update_freq, "--teacher-checkpoint", original(args.data),
            "--finetune-from-model", os.path.join(args.model, "model.pt"), "--save-dir", args.save_dir,
            *cli.fairseq_passthrough(args), echo=True, log=os.path.join(args.save_dir, "train.log"))


def evaluate(args):
    checkpoint = original(args.data) if args.original else args.checkpoint
    output = fairseq("generate", os.path.join(args.data, "bin"), "--user-dir", PLUGIN_DIR, "--path", checkpoint,
                     "--gen-subset", "test", *GENERATE, *cli.fairseq_passthrough(args), echo=True)
    hypotheses = [line.split("\t")[2] for line in sorted(
        (line for line in output.splitlines() if line.startswith("H-")), key=lambda line: int(line[2:].split("\t")[0]))]
    detokenized = text.detokenize(hypotheses, "de")
    references = subprocess.run(["sacrebleu", "-t", "wmt14/full", "-l", "en-de", "--echo", "ref"], capture_output=True,
                                text=True, check=True).stdout.splitlines()
    import sacrebleu

    score = sacrebleu.corpus_bleu(detokenized, [references])
    print(json.dumps({"checkpoint": checkpoint, "sacrebleu": score.score, "signature": str(score),
                      "sentences": len(hypotheses)}, indent=1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    prep = steps.add_parser("prepare", help="the training data, binarised with the published model's dictionary")
    cli.add_source_arguments(prep)
    conv = steps.add_parser("convert", help="uptrain --pretrained, then attention transfer")
    conv.add_argument("--data", required=True)
    conv.add_argument("--row", required=True, choices=WMT16_ROWS)
    conv.add_argument("--out", required=True, help="the converted model's folder")
    tune = steps.add_parser("finetune", help="fairseq-train with the published model as the teacher")
    tune.add_argument("--data", required=True)
    tune.add_argument("--row", required=True, choices=WMT16_ROWS)
    tune.add_argument("--model", required=True, help="convert's --out")
    tune.add_argument("--save-dir", required=True)
    tune.add_argument("--gpus", type=int, default=8, help="GPUs used: --update-freq keeps the published batch")
    test = steps.add_parser("evaluate", help="newstest2014: beam 4, lenpen 0.6, sacreBLEU")
    test.add_argument("--data", required=True)
    which = test.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint")
    which.add_argument("--original", action="store_true", help="score the published model itself")
    cli.add_fairseq_passthrough(tune, test)
    args = parser.parse_args(argv)
    {"prepare": prepare, "convert": convert, "finetune": finetune, "evaluate": evaluate}[args.step](args)


if __name__ == "__main__":
    main()
