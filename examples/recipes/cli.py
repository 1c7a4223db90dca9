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
