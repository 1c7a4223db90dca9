"""Runs one invariant of the property harness on one example, as a failure's report prints it:

    .venv/bin/python tests/properties/reproduce.py INVARIANT --arch lm --seed 7 [--draw 5] -- --fwp-update-rule delta ...
    .venv/bin/python tests/properties/reproduce.py INVARIANT --case "OpCase(rule='delta', ...)"

It raises the invariant's AssertionError (or the error it met), or prints that the example passes, or that it
has nothing to check (nothing_to_check.py: an example the property tests reject).
"""
import argparse
import os
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
if "TRITON_INTERPRET" not in os.environ:  # as the test suite runs without a GPU (tests/conftest.py)
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import model_invariants  # noqa: E402
import op_invariants  # noqa: E402
from flag_combos import Combination  # noqa: E402
from nothing_to_check import NothingToCheck  # noqa: E402
from op_cases import OpCase  # noqa: E402

INVARIANTS = {f.__name__: f for f in (*op_invariants.OP_INVARIANTS, *model_invariants.MODEL_INVARIANTS)}
DRAWS = {"None": None, "torch.float32": torch.float32, "torch.float64": torch.float64}


def parsed_draw(text):
    """A draw as model_command writes it: None, a dtype, an int, a float or a string."""
    if text in DRAWS:
        return DRAWS[text]
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    return text


def model_command(invariant, combination, seed, draws=()):
    """The command line that reruns `invariant` on a model example."""
    extra = [arg for draw in draws for arg in ("--draw", repr(draw) if isinstance(draw, torch.dtype) else str(draw))]
    return shlex.join([".venv/bin/python", "tests/properties/reproduce.py", invariant.__name__, "--arch",
                       combination.arch, "--seed", str(seed), *extra, "--", *combination.flags])


def op_command(invariant, case):
    """The command line that reruns `invariant` on an op case."""
    return shlex.join([".venv/bin/python", "tests/properties/reproduce.py", invariant.__name__, "--case", repr(case)])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("invariant", choices=sorted(INVARIANTS))
    parser.add_argument("--arch", choices=("translation", "lm"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draw", action="append", default=[], help="the invariant's own draws, in order")
    parser.add_argument("--case", help="an op case, as a failure prints it")
    args = parser.parse_args(argv[:split])
    invariant = INVARIANTS[args.invariant]
    try:
        if args.case:
            invariant(eval(args.case, {"OpCase": OpCase, "torch": torch}))
        else:
            draws = [parsed_draw(d) for d in args.draw]
            invariant(Combination(args.arch, tuple(argv[split + 1:])), args.seed, *draws)
    except NothingToCheck as why:
        print(f"{args.invariant}: nothing to check on this example ({why})")
        return
    print(f"{args.invariant}: passes on this example")


if __name__ == "__main__":
    main()
