"""Mutation testing of the code that holds the math and the state: `bash scripts/mutants.sh` (not in CI: it takes
minutes by design; the score is in docs/DEVELOPERS.md, "Test strength").

    bash scripts/mutants.sh                          # every mutant of mutants.py
    bash scripts/mutants.sh --only NAME [--only ...] # some of them
    bash scripts/mutants.sh --harness-only           # the property harness alone, no fast lane
    bash scripts/mutants.sh --list                   # the mutants, one line each

First a copy of the repository (copies.py: the working tree's files and the built extension) whose property
harness must pass unmutated (else it stops: exit status 2). Then, for each mutant, a fresh copy of that copy
with the mutant applied, and in it:

1. the property harness: `pytest tests/properties -m "not slow" -x` with the hypothesis profile "mutants" (the
   suite's derandomized examples, a failure not shrunk), one process, one thread;
2. where the harness passes, the fast lane: `pytest tests -m "not slow" -x` (scripts/test.sh --fast without
   xdist), but tests/properties, which just passed on the same copy with the same examples. The first time a
   mutant needs it, the unmutated copy's whole fast lane runs: the tests it fails (someone's work in progress)
   are left out of the mutants' fast lanes, and named in the output (else every mutant would count as caught).

Each mutant's line says: caught by the harness (the first test that failed), caught by the fast lane only (its
test), equivalent (the catalog's reason: nothing caught it, and mutants.py says why nothing can), survived, or
stale (its text is no longer in the file it changes). Flagged beside: a mutant whose `harness` selection says
the harness must catch it and that it missed (the harness needs strengthening), one the harness caught by a
test outside that selection, and one marked equivalent that a test caught (its reason is wrong). The table at
the end gives the totals and the time. Exit status 0 when every mutant is caught or equivalent and the harness
caught every one it must; 1 otherwise.
"""
import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from copies import apply, copy_of_the_repository, pytest_in  # noqa: E402
from mutants import MUTANTS  # noqa: E402

HARNESS = ("tests/properties", "-m", "not slow", "-x")
FAST_LANE = ("tests", "-m", "not slow", "-x", "--ignore=tests/properties")
TIMEOUT = {"harness": 1800, "fast lane": 3600}  # a mutant that makes a run hang is caught by it, as "(timed out)"
FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)(?: - (.*))?$", re.MULTILINE)


def selected(expression, nodeid):
    """Whether pytest's `-k expression` selects the test `nodeid` (names matched as substrings of its id, without
    case, as -k matches them against a test's names)."""
    from _pytest.mark.expression import Expression

    nodeid = nodeid.lower()
    return Expression.compile(expression).evaluate(lambda name, **_: name.lower() in nodeid)


def first_failure(status, output):
    """(the first failed test's id, its message) of a pytest run that failed, or a stand-in for a run that failed
    without one (an import error while collecting, a crash)."""
    found = FAILED.search(output)
    if found:
        return found.group(1), (found.group(2) or "").strip()
    tail = [line for line in output.strip().splitlines()[-3:] if line.strip()]
    return f"(pytest exit status {status})", " | ".join(tail)


def run_lane(copy, lane, args):
    """(failed test or None, its message, seconds) of one lane in the copy."""
    start = time.monotonic()
    try:
        status, output = pytest_in(copy, *args, timeout=TIMEOUT[lane])
    except Exception as err:  # subprocess.TimeoutExpired: the run hung on the mutant
        return "(timed out)", str(err), time.monotonic() - start
    seconds = time.monotonic() - start
    if status == 0:
        return None, "", seconds
    if status == 5:
        raise RuntimeError(f"{lane}: no tests collected in {copy}:\n{output[-3000:]}")
    test, message = first_failure(status, output)
    return test, message, seconds


class Copies:
    """The unmutated copy, and a fresh copy of it per run (a run may leave files behind)."""

    def __init__(self, root, keep):
        self.root, self.keep, self.count = root, keep, 0
        self.base = copy_of_the_repository(os.path.join(root, "unmutated"))

    def fresh(self, name):
        self.count += 1
        path = os.path.join(self.root, f"{self.count:02d}-{name}")
        shutil.copytree(self.base, path, symlinks=True)
        return path

    def done(self, path):
        if not self.keep:
            shutil.rmtree(path, ignore_errors=True)


def stale(mutant, base):
    """Why the mutant no longer applies to the copy (its text is not in its file exactly once), or None."""
    for path, original, _ in mutant.edits:
        full = os.path.join(base, path)
        if not os.path.isfile(full):
            return f"{path} is gone"
        with open(full) as f:
            found = f.read().count(original)
        if found != 1:
            return f"{path} holds its text {found} times, not once"
    return None


def baseline_harness(copies):
    """The unmutated copy's harness must pass: else it stops (exit status 2)."""
    path = copies.fresh("unmutated-harness")
    test, message, seconds = run_lane(path, "harness", HARNESS)
    copies.done(path)
    if test is not None:
        print(f"[mutants] the unmutated copy fails its harness: {test} {message}\nStopped: fix that first (a failure "
              "there would count every mutant as caught).", flush=True)
        sys.exit(2)
    print(f"[mutants] unmutated copy: its harness passes ({seconds:.0f} s)", flush=True)


def baseline_fast_lane(copies):
    """The tests the unmutated copy's fast lane fails (the whole lane run, not stopped at the first), which the
    mutants' fast lanes leave out (--deselect): a failure there would count every mutant as caught. Said, with
    the failures, in the output and the table; a run that fails without a test to name stops (exit status 2)."""
    path = copies.fresh("unmutated-fast-lane")
    start = time.monotonic()
    status, output = pytest_in(path, *[arg for arg in FAST_LANE if arg != "-x"], timeout=TIMEOUT["fast lane"])
    copies.done(path)
    failing = sorted({found.group(1) for found in FAILED.finditer(output)})
    if status not in (0, 1) or (status == 1 and not failing):
        print(f"[mutants] the unmutated copy's fast lane fails (pytest exit status {status}):\n{output[-3000:]}\n"
              "Stopped: fix that first.", flush=True)
        sys.exit(2)
    said = f"{len(failing)} tests fail, left out of the mutants' fast lanes: {', '.join(failing)}" if failing \
        else "passes"
    print(f"[mutants] unmutated copy: its fast lane {said} ({time.monotonic() - start:.0f} s)", flush=True)
    return failing


def run_mutant(mutant, copies, harness_only, fast_lane_failing):
    """({"result", "test", "message", "seconds", "notes"} of one mutant, the tests the unmutated copy's fast lane
    fails: None until a mutant needs the fast lane)."""
    why = stale(mutant, copies.base)
    if why is not None:
        return {"result": "stale", "test": "", "message": why, "seconds": 0.0,
                "notes": ["its text moved: rewrite it against the code"]}, fast_lane_failing
    path = copies.fresh(mutant.name)
    try:
        apply(mutant, path)
        test, message, seconds = run_lane(path, "harness", HARNESS)
        result = "harness"
        if test is None and not harness_only:
            if fast_lane_failing is None:
                fast_lane_failing = baseline_fast_lane(copies)
            left_out = [f"--deselect={test}" for test in fast_lane_failing]
            test, message, more = run_lane(path, "fast lane", (*FAST_LANE, *left_out))
            seconds += more
            result = "fast lane"
    finally:
        copies.done(path)
    notes = []
    if test is None:  # nothing caught it (with --harness-only: the harness did not)
        result = "equivalent" if mutant.equivalent else "not caught" if harness_only else "survived"
        if result == "equivalent":
            message = mutant.equivalent
    elif mutant.equivalent:
        notes.append("marked equivalent, but a test caught it: its reason is wrong")
    if mutant.harness and result != "harness":
        notes.append(f"the harness must catch it (-k {mutant.harness!r}) and missed it")
    if mutant.harness and result == "harness" and not selected(mutant.harness, test):
        notes.append(f"caught by a test outside its selection -k {mutant.harness!r}")
    return {"result": result, "test": test or "", "message": message, "seconds": seconds, "notes": notes}, \
        fast_lane_failing


def short(test):
    """A test id without its folder: file::name[id]."""
    path, found, rest = test.partition("::")
    return f"{os.path.basename(path)}::{rest}" if found else test


KINDS = ("harness", "fast lane", "equivalent", "survived", "not caught", "stale")  # "not caught": --harness-only


def table(results, elapsed):
    lines = [f"{'mutant':<52} {'result':<11} {'time':>6}  test (or reason)"]
    for name, r in results.items():
        lines.append(f"{name:<52} {r['result']:<11} {r['seconds']:>5.0f}s  {short(r['test']) or r['message']}")
        lines += [f"{'':<52} ! {note}" for note in r["notes"]]
    counts = {kind: sum(r["result"] == kind for r in results.values()) for kind in KINDS}
    lines.append(f"[mutants] {len(results)} mutants: caught by the harness {counts['harness']}, by the fast lane only "
                 f"{counts['fast lane']}, equivalent {counts['equivalent']}, survived {counts['survived']}"
                 + "".join(f", {kind} {counts[kind]}" for kind in KINDS[4:] if counts[kind])
                 + f"; {elapsed / 60:.1f} min")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="run this mutant (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--harness-only", action="store_true", help="run the property harness alone, no fast lane")
    parser.add_argument("--keep", action="store_true", help="keep the copies (their folder is printed)")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH")
    args = parser.parse_args(argv)

    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    unknown = set(args.only) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"no such mutant: {', '.join(sorted(unknown))} (--list lists them)")
    if args.list:
        for m in MUTANTS:
            kind = "harness" if m.harness else "equivalent" if m.equivalent else "fast lane"
            print(f"{m.name:<52} {kind:<10} {m.edits[0][0]}: {m.why}")
        return 0

    os.environ["COLUMNS"] = "400"  # pytest's summary lines keep the failure's message beside its test id
    start = time.monotonic()
    root = tempfile.mkdtemp(prefix="fwp-mutants-")
    print(f"[mutants] {len(chosen)} mutants; copies under {root}", flush=True)
    copies = Copies(root, args.keep)
    results = {}
    try:
        baseline_harness(copies)
        fast_lane_failing = None
        for i, mutant in enumerate(chosen, 1):
            r, fast_lane_failing = run_mutant(mutant, copies, args.harness_only, fast_lane_failing)
            results[mutant.name] = r
            print(f"[mutants] {i}/{len(chosen)} {mutant.name}: {r['result']} {r['seconds']:.0f} s "
                  f"{short(r['test'])} {r['message'][:200]}", flush=True)
            for note in r["notes"]:
                print(f"[mutants]     ! {note}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    elapsed = time.monotonic() - start
    print(table(results, elapsed), flush=True)
    if fast_lane_failing:
        print(f"[mutants] left out of the fast lanes (the unmutated copy fails them): {', '.join(fast_lane_failing)}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": elapsed, "results": results, "fast_lane_failing_unmutated": fast_lane_failing}, f,
                      indent=1)
    bad = [name for name, r in results.items() if r["result"] in ("survived", "stale")
           or any("must catch" in note or "reason is wrong" in note for note in r["notes"])]
    if bad:
        print(f"[mutants] to look at: {', '.join(bad)}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
