"""fairseq's published WikiText-103 LM (transformer_lm.wiki103.adaptive: Baevski and Auli, 2019, 247M
parameters, 18.7 test perplexity in its paper) uptrained into fast-weight LMs, for a user with a GPU and the
network.

    python -m examples.recipes.wikitext103_uptraining prepare --download --out data/wt103-uptraining
    python -m examples.recipes.wikitext103_uptraining convert --data data/wt103-uptraining --row delta \\
        --out models/delta
    python -m examples.recipes.wikitext103_uptraining finetune --data data/wt103-uptraining --model models/delta \\
        --save-dir ckpt/delta [--gpus 8]
    python -m examples.recipes.wikitext103_uptraining evaluate --data data/wt103-uptraining \\
        --checkpoint ckpt/delta/checkpoint_best.pt
    python -m examples.recipes.wikitext103_uptraining evaluate --data data/wt103-uptraining --original

Each step reads what the one before wrote:
- prepare: WikiText-103 (downloaded, or --raw-dir with wiki.{train,valid,test}.tokens or the zip),
  binarised with the published model's own dict.txt, so that every token index means what it meant to the
  model; the model is fetched into the cache once (--pretrained: its hub name, or a local copy: a URL, an
  archive or a folder), and DATA/model says where it is;
- convert: one ``python -m fairseq_fwp.uptrain --pretrained`` of the original with the row's flags
  (rows.WIKITEXT103_UPTRAINING) and --attention-transfer-steps (default ATTENTION_TRANSFER_STEPS) on the
  prepared batches (blocks of the original's 3,072 tokens), into a model folder;
- finetune: fairseq-train of that folder's model (its model.args) from its model.pt with the recipe uptrain
  prints (finetuning.FINETUNE_RECIPES: fwp_stream_lm, 6 streams of 512-token segments, the fast weights carried
  across segments), FINETUNE_UPDATES updates of GLOBAL_STREAMS streams (through --update-freq);
- evaluate: the test perplexity with the state carried through the split (fairseq-eval-lm --task fwp_stream_lm
  --batch-size 1); ``--original`` scores the published model as its paper did (blocks of 3,072 tokens, each
  after 2,560 of context: --context-window 2560), beside it.
How far each model reads past 3,072 tokens: examples/recipes/long_context.py. Anything after `--` goes to
fairseq as it is.
"""
import argparse
import json
import os
import shlex

from fairseq_fwp.uptraining import published_archives
from fairseq_fwp.uptraining.finetuning import finetune_command

from . import cli, language_model, rows, wikitext103
from .commands import PLUGIN_DIR, fairseq, python_module
from .prepared import preparing

PUBLISHED = "transformer_lm.wiki103.adaptive"
ATTENTION_TRANSFER_STEPS = 500
FINETUNE_UPDATES = 20000  # the finetuning budget (the cost estimate in examples/wikitext103/README.md is for it)
GLOBAL_STREAMS = 48  # 8 GPUs of the printed recipe's 6 streams: 24,576 tokens per update in 512-token segments
# The published model's own evaluation (its paper, and fairseq's examples/language_model): blocks of 512 new
# tokens, each after 2,560 of context, whole sentences.
ORIGINAL_EVALUATION = ["--task", "language_modeling", "--sample-break-mode", "complete", "--tokens-per-sample", 3072,
                       "--context-window", 2560, "--max-tokens", 3072, "--softmax-batch", 1024]
# Perplexity reported elsewhere, printed beside ours: dev, test
REFERENCES = {"published model (Baevski and Auli, 2019)": {"test": 18.7},
              "T2R + pretrain (Kasai et al., 2021)": {"valid": 19.0, "test": 19.6}}


def prepare(args):
    """WikiText-103 binarised with the published model's dictionary; DATA/model: where the model is."""
    splits = wikitext103.find_splits(cli.raw_folder(args, wikitext103.download))
    model = published_archives.fetch(args.pretrained)
    with preparing(args.out) as staging:
        if staging is None:
            print(f"{args.out}: prepared already", flush=True)
            return
        fairseq("preprocess", "--only-source", "--srcdict", os.path.join(model, "dict.txt"),
                *[x for split in ("train", "valid", "test") for x in (f"--{split}pref", splits[split])],
                "--destdir", os.path.join(staging, "bin"), "--workers", args.workers, echo=True)
        with open(os.path.join(staging, "model"), "w") as f:
            f.write(model + "\n")  # the source of the conversion


def original_folder(data):
    return open(os.path.join(data, "model")).read().strip()


def convert(args):
    """One conversion of the original, attention transfer included, into the model folder --out."""
    arguments = ["--pretrained", original_folder(args.data), "--out",
               args.out, "--data", os.path.join(args.data, "bin"), "--attention-transfer-steps",
               str(args.attention_transfer_steps), "--", *rows.WIKITEXT103_UPTRAINING[args.row].flags_for(),
               "--max-tokens", "3072"]
    print("+ " + shlex.join(["python", "-m", "fairseq_fwp.uptrain", *arguments]), flush=True)
    python_module("fairseq_fwp.uptrain", *arguments)


def finetune(args):
    model_args = shlex.split(open(os.path.join(args.model, "model.args")).read())  # the converted model's flags
    command = shlex.split(finetune_command(args.model, os.path.join(args.data, "bin"), model_args))
    streams = int(command[command.index("--batch-size") + 1])
    os.makedirs(args.save_dir, exist_ok=True)
    fairseq("train", *command[1:], "--max-update", args.updates, "--update-freq",
            max(1, GLOBAL_STREAMS // (streams * args.gpus)), "--save-dir", args.save_dir,
            *cli.fairseq_passthrough(args), echo=True, log=os.path.join(args.save_dir, "train.log"))


def evaluate(args):
    data = os.path.join(args.data, "bin")
    if args.original:
        checkpoint = os.path.join(original_folder(args.data), "model.pt")
        flags = ORIGINAL_EVALUATION
    else:
        checkpoint, flags = args.checkpoint, ["--task", "fwp_stream_lm", "--batch-size", 1, "--tokens-per-sample",
                                              args.segment]
    output = fairseq("eval-lm", data, "--user-dir", PLUGIN_DIR, "--path", checkpoint, "--gen-subset", args.subset,
                     *flags, *cli.fairseq_passthrough(args), echo=True)
    result = dict(language_model.parse_eval_lm(output), checkpoint=checkpoint, subset=args.subset)
    result["reported"] = {name: numbers[args.subset] for name, numbers in REFERENCES.items() if args.subset in numbers}
    print(json.dumps(result, indent=1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = cli.add_uptraining_steps(parser, PUBLISHED, rows.WIKITEXT103_UPTRAINING, ATTENTION_TRANSFER_STEPS, "WikiText-103")
    tune = steps.add_parser("finetune", help="fairseq-train on fwp_stream_lm, the fast weights carried")
    tune.add_argument("--data", required=True)
    tune.add_argument("--model", required=True, help="convert's --out")
    tune.add_argument("--save-dir", required=True)
    tune.add_argument("--updates", type=int, default=FINETUNE_UPDATES)
    tune.add_argument("--gpus", type=int, default=1, help="GPUs used: --update-freq keeps the global batch")
    test = steps.add_parser("evaluate", help="the perplexity of a split")
    test.add_argument("--data", required=True)
    which = test.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", help="a finetuned (or converted) model: the state carried through the split")
    which.add_argument("--original", action="store_true", help="the published model, as its paper scored it")
    test.add_argument("--subset", default="test", choices=("valid", "test"))
    test.add_argument("--segment", type=int, default=512, help="tokens per forward with the state carried")
    cli.add_fairseq_passthrough(tune, test)
    args = parser.parse_args(argv)
    {"prepare": prepare, "convert": convert, "finetune": finetune, "evaluate": evaluate}[args.step](args)


if __name__ == "__main__":
    main()
