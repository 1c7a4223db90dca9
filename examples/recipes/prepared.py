"""A prepared corpus folder, made once however many runs start preparing it at the same time.

Two recipe runs pointed at one --out (rows trained side by side) both find the corpus missing and
prepare it. Writing into the same folder at once gave a corpus that looked finished and was not: BPE
codes read while the other run was still writing them split the text into characters. So a
preparation holds a lock on OUT (a second run waits for it, then finds the corpus done), writes
into a staging folder inside OUT, and moves its folders into OUT and writes the PREPARED marker only
when it has finished; an interrupted preparation leaves only the staging folder, which the next one
clears. Nothing half-written is ever read.
"""
import contextlib
import fcntl
import os
import shutil

MARKER = "PREPARED"


def is_prepared(out):
    return os.path.exists(os.path.join(out, MARKER))


@contextlib.contextmanager
def preparing(out):
    """Yields a staging folder to prepare OUT's corpus in (its folders then move into OUT), or None
    where OUT holds a finished corpus, perhaps one that another run finished while this one waited."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, ".prepare.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when the process dies
        if is_prepared(out):
            yield None
            return
        staging = os.path.join(out, ".staging")
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        yield staging
        for name in os.listdir(staging):
            target = os.path.join(out, name)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(os.path.join(staging, name), target)
        os.rmdir(staging)
        open(os.path.join(out, MARKER), "w").close()
