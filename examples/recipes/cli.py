"""Command-line pieces every recipe shares."""
import argparse
import os


def add_source_arguments(prepare, workers_default=os.cpu_count()):
    """prepare's data source: --download into OUT/downloads, or --raw-dir with the files already there."""
    source = prepare.add_mutually_exclusive_group(required=True)
    source.add_argument("--download", action="store_true", help="fetch the data into OUT/downloads")
    source.add_argument("--raw-dir", help="a folder with the downloaded files or archives")
    prepare.add_argument("--out", required=True)
    prepare.add_argument("--workers", type=int, default=workers_default)


def add_uptraining_steps(parser, published, rows, attention_transfer_steps, data):
    """The first two steps of the uptraining recipes: prepare (`data` binarised with the published model's
    dictionary) and convert (uptrain --pretrained to one of `rows`, with attention transfer). Returns the
    subparsers, for the recipe's own finetune and evaluate."""
    steps = parser.add_subparsers(dest="step", required=True)
    prep = steps.add_parser("prepare", help=f"{data}, binarised with the published model's dictionary")
    add_source_arguments(prep)
    prep.add_argument("--pretrained", default=published, help=f"the model (default {published}): a name of "
                                                               "fairseq's hub, a URL, an archive or a folder")
    conv = steps.add_parser("convert", help="uptrain --pretrained with attention transfer on the prepared data")
    conv.add_argument("--data", required=True)
    conv.add_argument("--row", required=True, choices=rows)
    conv.add_argument("--out", required=True, help="the converted model's folder")
    conv.add_argument("--attention-transfer-steps", type=int, default=attention_transfer_steps)
    return steps


def raw_folder(args, download):
    """The folder prepare reads, after downloading into it if asked."""
    if not args.download:
        return args.raw_dir
    folder = os.path.join(args.out, "downloads")
    download(folder)
    return folder


def add_fairseq_passthrough(*steps):
    for step in steps:
        step.add_argument("fairseq_args", nargs=argparse.REMAINDER, help="-- then extra fairseq flags")


def fairseq_passthrough(args):
    return [a for a in args.fairseq_args if a != "--"]
