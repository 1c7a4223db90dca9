"""Command line of the dual-form analysis.

    python -m examples.dual_form verify --dir DIR --checkpoint CKPT [--layer L ...] [--subset valid]
    python -m examples.dual_form explain --dir DIR --checkpoint CKPT --layer L \\
        (--query "TEXT" | --query-file FILE --line N) [--position P] [--top-k 3] [--out OUT]

DIR is the --dual-form-dir of a `fairseq-train --task dual_form_language_modeling` run.
"""
import argparse
import json
import logging
import sys

from .corpus import WIKITEXT_TITLE
from fairseq_fwp.dual_form.storage import Record


def _common(parser):
    parser.add_argument("--dir", required=True, help="the record (--dual-form-dir of the training run)")
    parser.add_argument("--checkpoint", required=True, help="a checkpoint of the recorded run")
    parser.add_argument("--data", help="binarised data directory, if it moved since training")


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m examples.dual_form", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    verify = commands.add_parser("verify", help="compare the dual form with the trained layers on held-out tokens")
    _common(verify)
    verify.add_argument("--layer", action="append", help="a recorded layer (repeatable; default: all)")
    verify.add_argument("--subset", default="valid", help="held-out split of the data directory")
    verify.add_argument("--num-queries", type=int, default=256, help="held-out tokens compared per layer")
    verify.add_argument("--max-relative-error", type=float, default=1e-4,
                        help="exit with status 1 if a layer's max relative error is above this")
    verify.add_argument("--json", help="also write the report to this file")

    explain = commands.add_parser("explain", help="top-k training passages and documents a test position attends to")
    _common(explain)
    explain.add_argument("--layer", required=True, help="a recorded layer")
    query = explain.add_mutually_exclusive_group(required=True)
    query.add_argument("--query", help="test text, tokenised like the training data")
    query.add_argument("--query-file", help="raw text file (e.g. WikiText test.txt); use with --line")
    explain.add_argument("--line", type=int, help="1-based line of --query-file")
    explain.add_argument("--position", type=int, default=-1, help="word index of the query token (default: last)")
    explain.add_argument("--top-k", type=int, default=3)
    explain.add_argument("--window", type=int, default=12, help="words shown on each side of a training token")
    explain.add_argument("--title-pattern", default=WIKITEXT_TITLE,
                         help="regex of a document's title line (default: WikiText '= Title =')")
    explain.add_argument("--out", help="write explain.json, explain.md and attention.png here")
    return parser


def run_verify(args):
    from .verify import verify

    report = verify(Record(args.dir), args.checkpoint, args.layer, args.subset, args.num_queries, args.data)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    worst = max(layer["max_relative_error"] for layer in report["layers"].values())
    return 0 if worst <= args.max_relative_error else 1


def run_explain(args, parser):
    from .explain import explain, markdown, read_query_line, write_report

    if args.query_file:
        if args.line is None:
            parser.error("--query-file needs --line")
        words, title = read_query_line(args.query_file, args.line, args.title_pattern)
    else:
        words, title = args.query.split(), None
    if not words:
        parser.error("the query is empty")
    explanation = explain(Record(args.dir), args.checkpoint, args.layer, words, args.position, args.top_k,
                          args.window, args.data, args.title_pattern, title)
    print(markdown(explanation.report), end="")
    if args.out:
        for path in write_report(explanation, args.out).values():
            print(f"wrote {path}")
    return 0


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    # fairseq's text_to_speech task sets the root logger to DEBUG on import; keep the output readable.
    logging.getLogger().setLevel(logging.WARNING)
    try:
        return run_verify(args) if args.command == "verify" else run_explain(args, parser)
    except (FileNotFoundError, KeyError, ValueError) as error:
        print(f"error: {error.args[0] if error.args else error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
