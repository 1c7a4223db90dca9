"""Uptraining: a trained softmax Transformer turned into a fast-weight one (Kasai et al., 2021,
"Finetuning Pretrained Transformers into RNNs"), then finetuned briefly.

    python -m fairseq_fwp.uptrain --softmax-checkpoint SOFTMAX.pt --out CONVERTED.pt -- \\
        DATA --user-dir fairseq_fwp --arch ARCH [model flags] --fwp-feature-map dpfp ...
    fairseq-train DATA --user-dir fairseq_fwp --arch ARCH [the same flags] [training flags] \\
        --finetune-from-model CONVERTED.pt --save-dir DIR

Everything after ``--`` is what fairseq-train will be given: the fast-weight
model is built from it, every parameter it shares with the softmax checkpoint
(embeddings, projections, feed-forward layers, norms: the same names in both)
is copied, and the new ones (the delta rule's beta projection, decay and
output gates, short convolutions, random features) are initialised afresh
(a new parameter outside the fast-weight attentions stops the conversion);
DeltaProduct's N key and value projections start as N copies of the
softmax ones, its extra writes with beta near 0:
by default (``--added-modules ungated``) decay gates at a_t = exp(-1e-4) and
short convolutions as identities (FastWeightAttention.start_as_ungated), so
that the converted model starts as its softmax source's nearest fast-weight
twin; the output gate's RMS norm has no such setting. ``--added-modules
fresh`` keeps them as initialised for training from scratch (Mamba-2's
spread of decays, random convolutions). A parameter whose shape
differs, or a softmax parameter the fast-weight model has no place for, stops
the conversion with its name, and so does every model option that makes the
two compute differently although the shapes agree (differences.py: heads,
layers, widths, normalize-before, layernorm-embedding, embedding scale,
positions, shared embeddings). The converted file is a complete fairseq
checkpoint: fairseq-generate and fairseq-eval-lm score it as it is (the
quality before any update), and ``--finetune-from-model`` starts training
from it with fresh optimizer, learning-rate schedule, meters and data
iterator (a resumed run continues from its own checkpoint_last.pt instead).

``--attention-transfer-steps N`` first trains only the converted attentions, N steps on the training
batches, to reproduce the softmax attentions they replace (attention_transfer.py), so that finetuning
starts from a model that already attends almost as the softmax one did.

``--pretrained NAME|URL|PATH --out FOLDER -- <--fwp-* flags>`` converts one of fairseq's published
translation or language models (published_archives.py fetches it, published_model.py says what it is and
builds the fairseq-train flags of its fast-weight twin) into a folder laid out as its archive, and prints the
command that finetunes it.
"""
import argparse
import logging
import sys

from .attention_transfer import DEFAULT_LR
from .conversion import ADDED_MODULES, convert, final_learning_rate
from .finetuning import finetune_command
from .published_model import convert_pretrained

logger = logging.getLogger(__name__)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: python -m fairseq_fwp.uptrain --softmax-checkpoint FILE --out FILE -- "
                         "<the fairseq-train arguments of the fast-weight model>\n"
                         "   or: python -m fairseq_fwp.uptrain --pretrained NAME|URL|PATH --out FOLDER -- "
                         "<the --fwp-* flags of the fast-weight model>")
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--softmax-checkpoint", help="a checkpoint of fairseq-train (give the fast-weight model's "
                                                     "fairseq-train arguments after --)")
    source.add_argument("--pretrained", metavar="NAME|URL|PATH",
                        help="a published fairseq translation or language model: a name of fairseq's hub (e.g. "
                             "transformer.wmt16.en-de, transformer_lm.wiki103.adaptive), an archive's URL, a local "
                             "archive or folder (give only the --fwp-* flags after --; --out is then a folder)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--data", help="with --pretrained: the training data, binarised with the archive's "
                                       "dictionaries (attention transfer's batches; the printed finetune command)")
    parser.add_argument("--attention-transfer-steps", type=int, default=0, metavar="N",
                        help="train the converted attentions on the softmax ones for N steps first (default 0: none)")
    parser.add_argument("--attention-transfer-lr", type=float, default=DEFAULT_LR, metavar="LR",
                        help=f"the attention transfer's Adam learning rate (default {DEFAULT_LR})")
    parser.add_argument("--added-modules", choices=ADDED_MODULES, default="ungated",
                        help="decay gates and short convolutions the softmax model lacks: ungated (a_t = exp(-1e-4), "
                             "identity convolutions; default) or fresh (as for training from scratch)")
    args = parser.parse_args(argv[:split])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.attention_transfer_steps < 0:
        parser.error(f"--attention-transfer-steps must be >= 0, got {args.attention_transfer_steps}")
    if args.pretrained:
        if args.attention_transfer_steps and not args.data:
            parser.error("--attention-transfer-steps reads training batches: with --pretrained, give --data (the "
                         "training data, binarised with the archive's dictionaries) and --max-tokens after --")
        try:
            fresh, model_args = convert_pretrained(args.pretrained, args.out, argv[split + 1:], args.added_modules,
                                                   args.data, args.attention_transfer_steps, args.attention_transfer_lr)
        except (ValueError, FileNotFoundError) as err:
            raise SystemExit(f"uptrain: {err}")
        logger.info(f"initialised afresh: {', '.join(fresh) if fresh else 'nothing'}\nnext, finetune it"
                    f"{'' if args.data else ' on your training data binarised with its dictionaries'} (more flags may "
                    f"follow: --max-update, --update-freq, --fp16, ...):\n  "
                    f"{finetune_command(args.out, args.data, model_args)}")
        return
    if args.data:
        parser.error("--data is for --pretrained: with --softmax-checkpoint the data comes first after --")
    fresh = convert(args.softmax_checkpoint, args.out, argv[split + 1:], args.attention_transfer_steps,
                    args.attention_transfer_lr, args.added_modules)
    logger.info(f"wrote {args.out}; initialised afresh: {', '.join(fresh) if fresh else 'nothing'}; the softmax "
                f"training had reached --lr {final_learning_rate(args.softmax_checkpoint)}")

