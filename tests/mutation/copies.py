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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def pytest_in(copy, *args, timeout=1800):
    """pytest run in the copy with this interpreter (one thread, no xdist; the property harness's "mutants"
    profile: the suite's examples, a failure not shrunk): (exit status, its output)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "FWP_PROPERTIES": "mutants"}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           *args], cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr
