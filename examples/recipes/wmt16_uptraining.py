"""fairseq's published transformer.wmt16.en-de (transformer_vaswani_wmt_en_de_big, 28.6 sacreBLEU on
newstest2014 by its README) uptrained into fast-weight models, for a user with GPUs and network.

    python -m examples.recipes.wmt16_uptraining prepare --download --out data/wmt16_en_de
    python -m examples.recipes.wmt16_uptraining convert --data data/wmt16_en_de --row dpfp-256 --out models/dpfp-256
    python -m examples.recipes.wmt16_uptraining finetune --data data/wmt16_en_de --row dpfp-256 --model models/dpfp-256 \\
        --save-dir ckpt/dpfp-256 [--gpus 8]
    python -m examples.recipes.wmt16_uptraining evaluate --data data/wmt16_en_de --checkpoint ckpt/dpfp-256/checkpoint_best.pt

Each step reads what the one before wrote:
- prepare: the training data as fairseq's scaling_nmt example prepares it (Google's preprocessed WMT'16
  En-De: tokenised, BPE'd with 32K joint codes), binarised with the published model's own dictionary, so
  that every token index means what it meant to the model; the model is fetched into the cache once, and
  DATA/model says where it is (the original: the source of the conversion and the teacher);
- convert: one ``python -m fairseq_fwp.uptrain --pretrained`` of the original with the row's flags
  (WMT16_ROWS) and --attention-transfer-steps (default ATTENTION_TRANSFER_STEPS) on the prepared batches,
  into a model folder (model.pt, the dictionaries, model.args: the flags that build its model);
- finetune: fairseq-train of that folder's model (its model.args) from its model.pt, with the original as
  the distillation teacher (--criterion fwp_distillation), FINETUNE_UPDATES updates at the published
  model's batch (3584 tokens x 128 GPUs' worth, through --update-freq);
- evaluate: newstest2014 (3003 sentences), beam 4, length penalty 0.6, sacreBLEU on detokenised output;
  ``--original`` scores the published model with the same command, beside it.
--pretrained (prepare) takes another archive of the same kind (the tests use a small stand-in of this
model's layout). Anything after `--` goes to fairseq as it is.
"""
import argparse
import json
import os
import shlex
import subprocess
import tarfile
import urllib.request

from fairseq_fwp.uptraining import published_archives

from . import cli, text
from .commands import PLUGIN_DIR, fairseq, python_module

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
FINETUNE = ["--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--clip-norm", "0.0", "--lr", "0.0005",
            "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "1000", "--dropout", "0.3", "--max-tokens", "3584",
            "--max-update", str(FINETUNE_UPDATES), "--criterion", "fwp_distillation", "--label-smoothing", "0.1",
            "--distillation-weight", "0.5"]
PRECISIONS = {"fp16": ["--fp16"], "bf16": ["--bf16"], "fp32": []}
GENERATE = ["--beam", "4", "--lenpen", "0.6", "--batch-size", "128", "--remove-bpe"]
GOOGLE_FILES = {"train": "train.tok.clean.bpe.32000", "valid": "newstest2013.tok.bpe.32000",
                "test": "newstest2014.tok.bpe.32000"}


def prepare(args):
    """Download and extract Google's data (or read --raw-dir), binarise it with the model's dictionary."""
    raw = cli.raw_folder(args, lambda folder: _download(folder))
    model = published_archives.fetch(args.pretrained)
    fairseq("preprocess", "--source-lang", "en", "--target-lang", "de",
            *[x for split, name in GOOGLE_FILES.items() for x in (f"--{split}pref", os.path.join(raw, name))],
            "--srcdict", os.path.join(model, "dict.en.txt"), "--tgtdict", os.path.join(model, "dict.de.txt"),
            "--destdir", os.path.join(args.out, "bin"), "--workers", args.workers, echo=True)
    with open(os.path.join(args.out, "model"), "w") as f:
        f.write(model + "\n")  # where the published model is: the source of the conversion, the teacher


def _download(folder):
    os.makedirs(folder, exist_ok=True)
    archive = os.path.join(folder, "wmt16_en_de.tar.gz")
    if not os.path.exists(archive):
        print(f"downloading {GOOGLE_DATA}", flush=True)
        urllib.request.urlretrieve(GOOGLE_DATA, archive + ".part")
        os.replace(archive + ".part", archive)
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")


def original_folder(data):
    return open(os.path.join(data, "model")).read().strip()


def convert(args):
    """One conversion of the original, attention transfer included, into the model folder --out."""
    arguments = ["--pretrained", original_folder(args.data), "--out",
               args.out, "--data", os.path.join(args.data, "bin"), "--attention-transfer-steps",
               str(args.attention_transfer_steps), "--", *WMT16_ROWS[args.row], "--max-tokens", "3584"]
    print("+ " + shlex.join(["python", "-m", "fairseq_fwp.uptrain", *arguments]), flush=True)
    python_module("fairseq_fwp.uptrain", *arguments)


def finetune(args):
    update_freq = max(1, PUBLISHED_GPUS // args.gpus)
    model_args = shlex.split(open(os.path.join(args.model, "model.args")).read())  # the converted model's flags
    os.makedirs(args.save_dir, exist_ok=True)
    fairseq("train", os.path.join(args.data, "bin"), "--user-dir", PLUGIN_DIR, *model_args, *FINETUNE,
            *PRECISIONS[args.precision], "--update-freq", update_freq,
            "--teacher-checkpoint", os.path.join(original_folder(args.data), "model.pt"),
            "--finetune-from-model", os.path.join(args.model, "model.pt"), "--save-dir", args.save_dir,
            *cli.fairseq_passthrough(args), echo=True, log=os.path.join(args.save_dir, "train.log"))


def evaluate(args):
    checkpoint = os.path.join(original_folder(args.data), "model.pt") if args.original else args.checkpoint
    output = fairseq("generate", os.path.join(args.data, "bin"), "--user-dir", PLUGIN_DIR, "--path", checkpoint,
                     "--gen-subset", "test", *GENERATE, *cli.fairseq_passthrough(args), echo=True)
    hypotheses = [line.split("\t")[2] for line in sorted(
        (line for line in output.splitlines() if line.startswith("H-")), key=lambda line: int(line[2:].split("\t")[0]))]
    detokenized = text.detokenize(hypotheses, "de")
    if args.references:
        references = open(args.references).read().splitlines()
    else:
        references = subprocess.run(["sacrebleu", "-t", "wmt14/full", "-l", "en-de", "--echo", "ref"],
                                    capture_output=True, text=True, check=True).stdout.splitlines()
    import sacrebleu

    score = sacrebleu.corpus_bleu(detokenized, [references])
    print(json.dumps({"checkpoint": checkpoint, "sacrebleu": score.score, "signature": str(score),
                      "sentences": len(hypotheses)}, indent=1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = cli.add_uptraining_steps(parser, PUBLISHED, WMT16_ROWS, ATTENTION_TRANSFER_STEPS, "the training data")
    tune = steps.add_parser("finetune", help="fairseq-train with the published model as the teacher")
    tune.add_argument("--data", required=True)
    tune.add_argument("--row", required=True, choices=WMT16_ROWS)
    tune.add_argument("--model", required=True, help="convert's --out")
    tune.add_argument("--save-dir", required=True)
    tune.add_argument("--gpus", type=int, default=8, help="GPUs used: --update-freq keeps the published batch")
    tune.add_argument("--precision", choices=PRECISIONS, default="fp16")
    test = steps.add_parser("evaluate", help="newstest2014: beam 4, lenpen 0.6, sacreBLEU")
    test.add_argument("--data", required=True)
    which = test.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint")
    which.add_argument("--original", action="store_true", help="score the published model itself")
    test.add_argument("--references", help="the detokenised references, one a line (default: sacreBLEU's newstest2014)")
    cli.add_fairseq_passthrough(tune, test)
    args = parser.parse_args(argv)
    {"prepare": prepare, "convert": convert, "finetune": finetune, "evaluate": evaluate}[args.step](args)


if __name__ == "__main__":
    main()
