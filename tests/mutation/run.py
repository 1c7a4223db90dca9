"""Mutation testing of the code that holds the math and the state: `bash scripts/mutants.sh` (not in CI: it takes
minutes by design; the score is in docs/DEVELOPERS.md, "Test strength").

    bash scripts/mutants.sh                          # every mutant of mutants.py
    bash scripts/mutants.sh --only NAME [--only ...] # some of them
    bash scripts/mutants.sh --harness-only           # the property harness alone, no fast lane
    bash scripts/mutants.sh --list                   # the mutants, one line each

First a copy of the repository (copies.py: the working tree's files and the built extension) whose property
harness must pass unmutated (else it stops: exit status 2). Then, for each mutant, a fresh copy of that copy
with the mutant applied, and in it:

1. the property harness: `pytest tests/properties -m "not slow"` with the hypothesis profile "mutants" (the
   suite's examples, a failure not shrunk), one process, one thread;
2. where no harness test caught it (in its selection or not), the fast lane: `pytest tests -m "not slow"`
   (scripts/test.sh --fast without xdist), but tests/properties, which just ran on the same copy with the same
   examples. The first time a mutant needs it, the unmutated copy's whole fast lane runs: the tests it fails
   (someone's work in progress) are left out of the mutants' fast lanes, and named in the output (else every
   mutant would count as caught).

A mutant is caught by a test whose failure is an assertion (catches.py: AssertionError or pytest's Failed; a
property test fails with its first failing example's exception), in the mutant's `harness` selection where it
has one. Each lane runs on past crashes (any other exception: a shape error, an import, a hang) to the first
such catch, and stops there; a crash is reported apart, never counted as caught.

Each mutant's line says: caught by the harness (the test whose assertion failed), caught by the fast lane only
(its test), caught outside its selection (the harness caught it, but only by tests its `harness` selection leaves
out), crashed (no assertion failed; the first crash's exception and test), equivalent (the catalog's reason:
nothing caught it, and mutants.py says why nothing can), survived, or stale (its text is no longer in the file it
changes). Flagged beside: a mutant whose `harness` selection says the harness must catch it and that it missed
(the harness needs strengthening), and one marked equivalent that a test caught or crashed on (its reason is
wrong). The table at the end gives the totals and the time. Exit status 0 when every mutant is caught (in its
selection) or equivalent, and the harness caught every one it must; 1 otherwise (crashed and caught outside its
selection included).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from catches import first, said  # noqa: E402
from copies import apply, copy_of_the_repository, pytest_in  # noqa: E402
from mutants import MUTANTS  # noqa: E402

HARNESS = ("tests/properties", "-m", "not slow", "--continue-on-collection-errors")
FAST_LANE = ("tests", "-m", "not slow", "--continue-on-collection-errors", "--ignore=tests/properties")
TIMEOUT = {"harness": 1800, "fast lane": 3600}  # a run that hangs on a mutant ends as a crash, "timed out"


def run_lane(copy, lane, args, selection=None):
    """(lane, its failures (catches.py's records), seconds) of one lane in the copy, run to its first catch in the
    `selection` (-k's syntax; None: any test)."""
    start = time.monotonic()
    run = pytest_in(copy, *args, selection=selection, stop_at_catch=True, timeout=TIMEOUT[lane])
    if run.status == 5:
        raise RuntimeError(f"{lane}: no tests collected in {copy}:\n{run.output[-3000:]}")
    return lane, run.failures, time.monotonic() - start


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
    start = time.monotonic()
    failures = pytest_in(path, *HARNESS, timeout=TIMEOUT["harness"]).failures
    copies.done(path)
    if failures:
        print(f"[mutants] the unmutated copy fails its harness: {'; '.join(map(said, failures))}\nStopped: fix that "
              "first (a failure there would count every mutant as caught).", flush=True)
        sys.exit(2)
    print(f"[mutants] unmutated copy: its harness passes ({time.monotonic() - start:.0f} s)", flush=True)


def baseline_fast_lane(copies):
    """The tests the unmutated copy's fast lane fails (the whole lane run, not stopped at the first), which the
    mutants' fast lanes leave out (--deselect): a failure there would count every mutant as caught. Said, with
    the failures, in the output and the table; a failure without a test to name (a module that does not import,
    a run that died) stops it (exit status 2)."""
    path = copies.fresh("unmutated-fast-lane")
    start = time.monotonic()
    failures = pytest_in(path, *FAST_LANE, timeout=TIMEOUT["fast lane"]).failures
    copies.done(path)
    unnamed = [failure for failure in failures if failure["when"] in ("collect", "run")]
    if unnamed:
        print(f"[mutants] the unmutated copy's fast lane fails: {'; '.join(map(said, unnamed))}\n"
              "Stopped: fix that first.", flush=True)
        sys.exit(2)
    failing = sorted({failure["test"] for failure in failures})
    told = f"{len(failing)} tests fail, left out of the mutants' fast lanes: {', '.join(failing)}" if failing \
        else "passes"
    print(f"[mutants] unmutated copy: its fast lane {told} ({time.monotonic() - start:.0f} s)", flush=True)
    return failing


def verdict(lanes):
    """(result, the failure it names) of a mutant's lanes [(lane, failures, seconds), ...] in the order they ran: the
    first lane with a catch in its selection (catches are assertions; the selection is the mutant's `harness` in
    the harness, every test in the fast lane), a lane whose catches all lie outside it, the first crash, or
    (None, None) where nothing failed."""
    for lane, failures, _ in lanes:
        caught, outside = first(failures, catch=True, selected=True), first(failures, catch=True, selected=False)
        if caught or outside:
            return (lane, caught) if caught else ("outside its selection", outside)
    crash = first([failure for _, failures, _ in lanes for failure in failures], catch=False)
    return ("crashed", crash) if crash else (None, None)


def judged(mutant, lanes, harness_only):
    """{"result", "test", "type", "message", "seconds", "notes", "failures"} of a mutant from its lanes (verdict):
    "failures" holds every lane's, in the order they happened."""
    result, failure = verdict(lanes)
    notes = []
    if result is None:  # nothing failed (with --harness-only: in the harness)
        result = "equivalent" if mutant.equivalent else "not caught" if harness_only else "survived"
        failure = {"test": "", "type": "", "message": mutant.equivalent or ""}
    elif mutant.equivalent:
        what = "a test crashed on it" if result == "crashed" else "a test caught it"
        notes.append(f"marked equivalent, but {what}: its reason is wrong")
    if mutant.harness and result == "outside its selection":
        notes.append(f"caught by a test outside its selection -k {mutant.harness!r}, and by none in it")
    elif mutant.harness and result != "harness":
        crash = first(lanes[0][1], catch=False)
        notes.append(f"the harness must catch it (-k {mutant.harness!r}) and missed it"
                     + (f" (it crashed: {said(crash)})" if crash else ""))
    return {"result": result, "test": failure["test"], "type": failure["type"], "message": failure["message"],
            "seconds": sum(seconds for _, _, seconds in lanes), "notes": notes,
            "failures": [failure for _, failures, _ in lanes for failure in failures]}


def run_mutant(mutant, copies, harness_only, fast_lane_failing):
    """(the result of one mutant (judged), the tests the unmutated copy's fast lane fails: None until a mutant
    needs the fast lane)."""
    why = stale(mutant, copies.base)
    if why is not None:
        return {"result": "stale", "test": "", "type": "", "message": why, "seconds": 0.0,
                "notes": ["its text moved: rewrite it against the code"], "failures": []}, fast_lane_failing
    path = copies.fresh(mutant.name)
    try:
        apply(mutant, path)
        lanes = [run_lane(path, "harness", HARNESS, mutant.harness)]
        if not harness_only and first(lanes[0][1], catch=True) is None:
            if fast_lane_failing is None:
                fast_lane_failing = baseline_fast_lane(copies)
            left_out = [f"--deselect={test}" for test in fast_lane_failing]
            lanes.append(run_lane(path, "fast lane", (*FAST_LANE, *left_out)))
    finally:
        copies.done(path)
    return judged(mutant, lanes, harness_only), fast_lane_failing


def short(test):
    """A test id without its folder: file::name[id]."""
    path, found, rest = test.partition("::")
    return f"{os.path.basename(path)}::{rest}" if found else test


def shown(r):
    """What a result's line names: the catch's test, the crash's exception and test, or the reason."""
    if not r["test"]:
        return r["message"]
    return f"{r['type']} in {short(r['test'])}" if r["result"] == "crashed" else short(r["test"])


KINDS = ("harness", "fast lane", "equivalent", "survived", "crashed", "outside its selection", "not caught",
         "stale")  # "not caught": --harness-only


def table(results, elapsed):
    lines = [f"{'mutant':<52} {'result':<21} {'time':>6}  test (or reason)"]
    for name, r in results.items():
        lines.append(f"{name:<52} {r['result']:<21} {r['seconds']:>5.0f}s  {shown(r)}")
        lines += [f"{'':<52} ! {note}" for note in r["notes"]]
    counts = {kind: sum(r["result"] == kind for r in results.values()) for kind in KINDS}
    lines.append(f"[mutants] {len(results)} mutants: caught by the harness {counts['harness']}, by the fast lane only "
                 f"{counts['fast lane']}, equivalent {counts['equivalent']}, survived {counts['survived']}, crashed "
                 f"{counts['crashed']}" + "".join(f", {kind} {counts[kind]}" for kind in KINDS[5:] if counts[kind])
                 + f"; {elapsed / 60:.1f} min")
    return "\n".join(lines)


def to_look_at(results):
    """The mutants that make the exit status 1: neither caught in their selection nor equivalent (survived,
    crashed, caught outside its selection, stale), or flagged."""
    return [name for name, r in results.items()
            if r["result"] in ("survived", "crashed", "outside its selection", "stale") or r["notes"]]


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
            crashes = [said(failure) for failure in r["failures"] if not failure["catch"]]
            print(f"[mutants] {i}/{len(chosen)} {mutant.name}: {r['result']} {r['seconds']:.0f} s {shown(r)}"
                  + (f" {r['message'][:200]}" if r["test"] else "")
                  + (f" (crashes: {', '.join(crashes[:5])}{' ...' if len(crashes) > 5 else ''})" if crashes else ""),
                  flush=True)
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
    bad = to_look_at(results)
    if bad:
        print(f"[mutants] to look at: {', '.join(bad)}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
