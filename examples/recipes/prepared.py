"""A prepared corpus folder, made once however many runs start preparing it at the same time.

Two recipe runs pointed at one --out (rows trained side by side) both find the corpus missing and
prepare it. Writing into the same folder at once gave a corpus that looked finished and was not: BPE
codes read while the other run was still writing them split the text into characters. So a
preparation holds a lock on OUT (a second run says that it waits, waits, then finds the corpus done),
writes into a staging folder of its own inside OUT (named by its host and process: where the file
system's locks are local to each host, two hosts still never write into, or delete, each other's), and
moves its folders into OUT and writes the PREPARED marker only when it has finished. An interrupted
preparation leaves only its staging folder, which the next one on the same host clears. Nothing
half-written is ever read.
"""
import contextlib
import fcntl
import glob
import os
import shutil
import socket
import time

MARKER = "PREPARED"
STAGING = ".staging"
WAIT_REPORT_SECONDS = 300  # how often a waiting run says that it still waits


def is_prepared(out):
    return os.path.exists(os.path.join(out, MARKER))


def _locked(lock, out):
    """Takes the lock on OUT, saying so while another run holds it."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    started = time.time()
    print(f"waiting for another run that prepares {out} (it holds {lock.name}); this run goes on when it has "
          "finished", flush=True)
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(1)
        waited = time.time() - started
        if waited // WAIT_REPORT_SECONDS != (waited - 1) // WAIT_REPORT_SECONDS:
            print(f"still waiting for the preparation of {out} ({waited / 60:.0f} min)", flush=True)


def _clear_stale_staging(out, host):
    """Staging folders of this host's preparations whose process has ended (others' are left alone)."""
    for folder in glob.glob(os.path.join(out, f"{STAGING}-{glob.escape(host)}-*")):
        pid = folder.rsplit("-", 1)[1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def preparing(out):
    """Yields a staging folder to prepare OUT's corpus in (its folders then move into OUT), or None
    where OUT holds a finished corpus, perhaps one that another run finished while this one waited."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, ".prepare.lock"), "a") as lock:
        _locked(lock, out)  # released when the file closes, also when the process dies
        if is_prepared(out):
            yield None
            return
        host = socket.gethostname()
        _clear_stale_staging(out, host)
        staging = os.path.join(out, f"{STAGING}-{host}-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        yield staging
        for name in os.listdir(staging):
            target = os.path.join(out, name)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(os.path.join(staging, name), target)
        os.rmdir(staging)
        open(os.path.join(out, MARKER), "w").close()
