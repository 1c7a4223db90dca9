"""A copy of the repository with one mutant applied (mutants.py), and pytest run in it: how the test suite's
strength is measured (scripts/mutants.sh runs run.py over every mutant; tests/properties/test_harness_strength.py
holds a few of them to the harness in the suite's slow lane).

The copy holds the tracked files and the built extension (fairseq_fwp/_C*.so: the mutants change Python
only), and its tests import the copy's fairseq_fwp (tests/conftest.py puts the tests' repository first on
sys.path); the virtual environment is this checkout's.
"""
import os
import shutil
import subprocess
import sys
import typing

import catches

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def tracked_files(root=ROOT):
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            check=True, capture_output=True).stdout.decode()
    return [path for path in listed.split("\0") if path and os.path.isfile(os.path.join(root, path))]


def copy_of_the_repository(dest, root=ROOT):
    """The tracked (and untracked, not ignored) files of `root`, and its built extensions, under `dest`."""
    built = [name for name in os.listdir(os.path.join(root, "fairseq_fwp")) if name.startswith("_C") and
             name.endswith(".so")]
    for path in [*tracked_files(root), *(os.path.join("fairseq_fwp", name) for name in built)]:
        target = os.path.join(dest, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(root, path), target)
    return dest


def apply(mutant, copy):
    """Writes the mutant into the copy: each edit's original text, which its file holds exactly once, replaced."""
    for path, original, mutated in mutant.edits:
        path = os.path.join(copy, path)
        with open(path) as f:
            text = f.read()
        found = text.count(original)
        if found != 1:
            raise ValueError(f"mutant {mutant.name}: {path} holds the text it changes {found} times, not once")
        with open(path, "w") as f:
            f.write(text.replace(original, mutated))


class Run(typing.NamedTuple):
    status: object  # pytest's exit status, or "timed out"
    output: str
    failures: list  # catches.py's records, in the order they happened


def pytest_in(copy, *args, selection=None, stop_at_catch=False, timeout=1800):
    """pytest run in the copy with this interpreter (one thread, no xdist; the property harness's "mutants"
    profile: the suite's examples, a failure not shrunk) and the plugin catches.py: a Run whose failures end with
    one for a run that ended without a test to blame (a timeout, the interpreter's crash, pytest's own error, no
    tests collected)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "FWP_PROPERTIES": "mutants",
           "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))}
    env.pop("PYTEST_XDIST_WORKER", None)
    records = os.path.normpath(copy) + ".failures.jsonl"  # beside the copy: its tests see only the repository
    if os.path.exists(records):
        os.remove(records)
    options = ["-p", "catches", f"--failures-to={records}", *([f"--selection={selection}"] if selection else []),
               *(["--stop-at-catch"] if stop_at_catch else [])]
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                               *options, *args], cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
        status, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:  # the run hung on the mutant
        status, output = "timed out", f"{err}"
    failures = catches.read(records)
    if status not in (0, 1) or (status == 1 and not failures):  # 5: no tests collected
        end = "timed out" if status == "timed out" else f"pytest exit status {status}"
        tail = " | ".join(line for line in output.strip().splitlines()[-3:] if line.strip())
        failures.append(catches.record(f"({end})", "run", end, False, True, tail))
    return Run(status, output, failures)
