"""Learning and applying a joint BPE with subword-nmt and with fastBPE, on the same lines.

    .venv/bin/python examples/speed/bpe_tools.py --files TOK.en TOK.de [--merges 32000] [--workers 1]

Times both steps of both tools (examples/recipes/bpe.py, what the WMT14
recipe's --bpe-tool runs) and prints them with the ratio.
"""
import argparse
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.recipes import bpe, text  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", nargs="+", required=True, help="tokenised text, e.g. both sides of a corpus")
    parser.add_argument("--merges", type=int, default=32000)
    parser.add_argument("--workers", type=int, default=1, help="subword-nmt's learning processes")
    args = parser.parse_args(argv)
    lines = [line for path in args.files for line in text.read_lines(path)]
    words = sum(len(line.split()) for line in lines)
    print(f"# {len(lines)} lines, {words} words, {args.merges} merges; {platform.machine()} {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}")
    print("| tool | learn (s) | apply (s) |\n|---|---|---|")
    seconds = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tool in bpe.BPE_TOOLS:
            codes = os.path.join(tmp, f"codes.{tool}")
            start = time.perf_counter()
            bpe.learn(tool, args.files, codes, args.merges, args.workers)
            learned = time.perf_counter()
            bpe.apply(tool, codes, lines)
            seconds[tool] = (learned - start, time.perf_counter() - learned)
            print(f"| {tool} | {seconds[tool][0]:.1f} | {seconds[tool][1]:.1f} |", flush=True)
    slow, fast = seconds["subword-nmt"], seconds["fastbpe"]
    print(f"fastbpe vs subword-nmt: learning {slow[0] / fast[0]:.1f}x, applying {slow[1] / fast[1]:.1f}x faster")


if __name__ == "__main__":
    main()
