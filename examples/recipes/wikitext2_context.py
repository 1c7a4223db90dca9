"""Reading past the context, at a CPU's scale: a stand-in of transformer_lm.wiki103.adaptive trained on
WikiText-2, uptrained into a fast-weight LM, beside a fast-weight LM of the same shape trained from scratch,
each scored at contexts from 512 to 16,384 tokens (long_context.py).

    python -m examples.recipes.wikitext2_context --download --out runs/wikitext2-context  # or --data-dir DIR

- data: small_real_data's WikiText-2 (--data-dir, default data/; --download fetches what it lacks) and its split
  (valid.txt trains, the last quarter of test.txt is the test part);
- original: transformer_lm_wiki103 (pre-norm, adaptive input and softmax, tied, sinusoidal positions, no final
  norm) at 4 layers of 128 with 4 heads and FFN 512, cutoffs 2000,6000, blocks of 3,072 tokens as the
  published model's, saved as the published archive is (published_layouts.train_lm_archive) after
  --original-updates updates;
- converted: ``uptrain --pretrained`` of it into --row (default delta), finetuned for --finetune-updates with
  the command uptrain prints (fwp_stream_lm, the state carried across 512-token segments; here with a warm-up
  and a learning rate for its short budget: FINETUNE);
- scratch: the converted model's architecture (its model.args) trained from a random initialisation with the
  same command (at the original's learning rate: SCRATCH), for as many updates as the other two had together;
- long_context.py scores the three on the test part at --contexts, carried and in sliding windows.
Run again, an interrupted run goes on where it stopped: the data and the two archives are written once, whole;
fairseq-train resumes from its checkpoint_last.pt (and stops at once where it had finished).
"""
import argparse
import os
import shlex

from fairseq_fwp.uptraining.finetuning import finetune_command
from fairseq_fwp.uptraining.published_model import convert_pretrained

from . import long_context, rows
from .commands import fairseq
from .published_layouts import train_lm_archive
from .small_real_data import DEFAULT_DATA, download, prepare_wikitext2

ORIGINAL_MODEL = ["--decoder-layers", 4, "--decoder-embed-dim", 128, "--decoder-ffn-embed-dim", 512,
                  "--decoder-attention-heads", 4, "--dropout", 0.1, "--attention-dropout", 0.1,
                  "--activation-dropout", 0.1]
# No validation during training: long_context scores the models at the end.
ORIGINAL_TRAINING = ["--max-tokens", 3072, "--lr", 0.001, "--warmup-updates", 100, "--clip-norm", 0.1,
                     "--log-interval", 50, "--disable-validation"]
# The stream recipe uptrain prints (its warm-up is for 20,000 updates), over budgets of hundreds: from the
# converted model at half the original's rate, from scratch at the original's.
FINETUNE = ["--lr", 0.0005, "--warmup-updates", 50]
SCRATCH = ["--lr", 0.001, "--warmup-updates", 100]
RUN = ["--log-interval", 50, "--num-workers", 0, "--no-epoch-checkpoints", "--disable-validation"]


def original(args, data):
    folder = os.path.join(args.out, "adaptive_lm_wiki103.stand-in")
    if not os.path.exists(os.path.join(folder, "model.pt")):
        train_lm_archive(folder, data, os.path.join(args.out, "checkpoints", "original"),
                         [*ORIGINAL_MODEL, "--adaptive-input-cutoff", args.cutoffs, "--adaptive-softmax-cutoff",
                          args.cutoffs, "--tokens-per-sample", args.positions], updates=args.original_updates,
                         extra=ORIGINAL_TRAINING)
    return os.path.join(folder, "model.pt")


def fast_weight_models(args, data, source):
    """(the converted model finetuned, the same model trained from scratch): their last checkpoints."""
    converted = os.path.join(args.out, "converted")
    if not os.path.exists(os.path.join(converted, "model.pt")):
        convert_pretrained(os.path.dirname(source), converted, rows.WIKITEXT103_UPTRAINING[args.row].flags_for())
    model_args = shlex.split(open(os.path.join(converted, "model.args")).read())
    command = shlex.split(finetune_command(converted, data, model_args))[1:]
    checkpoints = {}
    for name, updates, flags in (("finetuned", args.finetune_updates, FINETUNE),
                                 ("scratch", args.original_updates + args.finetune_updates, SCRATCH)):
        save = os.path.join(args.out, "checkpoints", name)
        checkpoints[name] = os.path.join(save, "checkpoint_last.pt")
        start = ["--finetune-from-model", os.path.join(converted, "model.pt")] if name == "finetuned" else []
        fairseq("train", *_without(command, "--finetune-from-model"), *start, *flags, *RUN, "--max-update", updates,
                "--save-dir", save, echo=True, log=os.path.join(args.out, f"{name}.log"))
    return checkpoints["finetuned"], checkpoints["scratch"]


def _without(argv, flag):
    """argv less `flag` and its value."""
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=DEFAULT_DATA, help="the folder that holds wikitext-2/{valid,test}.txt")
    parser.add_argument("--download", action="store_true", help="fetch what --data-dir lacks")
    parser.add_argument("--out", required=True)
    parser.add_argument("--row", default="delta", choices=rows.WIKITEXT103_UPTRAINING)
    parser.add_argument("--positions", type=int, default=3072, help="the original's blocks and positions")
    parser.add_argument("--cutoffs", default="2000,6000", help="the original's adaptive input and softmax cutoffs "
                                                               "(WikiText-2's training text has 13,780 types)")
    parser.add_argument("--original-updates", type=int, default=150)
    parser.add_argument("--finetune-updates", type=int, default=100)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 3072, 4096, 8192, 16384])
    parser.add_argument("--segment", type=int, default=512)
    parser.add_argument("--stride", type=int, default=512)
    args = parser.parse_args(argv)
    if args.download:
        download("wikitext2", args.data_dir)
    prepare_wikitext2(args.data_dir, args.out)
    data = os.path.join(args.out, "bin")
    source = original(args, data)
    finetuned, scratch = fast_weight_models(args, data, source)
    long_context.main(["--data", data, "--subset", "test", "--out", os.path.join(args.out, "context"),
                       "--model", f"original={source}", "--model", f"converted={finetuned}",
                       "--model", f"scratch={scratch}", "--contexts", *map(str, args.contexts),
                       "--segment", str(args.segment), "--stride", str(args.stride)])


if __name__ == "__main__":
    main()
