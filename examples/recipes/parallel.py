"""Jobs run a few at a time, with one progress line at most every few seconds.

A job is a Python callable that does its work in subprocesses (fairseq-train,
a sweep), so that threads suffice to run several side by side. It reports how
far it is with ``progress(fraction, note)`` and returns a one-line result.
The runner starts a job once the jobs it waits for have finished, prints each
result as it comes, and between results a line with every running job's note
and the time left: the jobs' estimated seconds not yet done, at the rate the
finished part was done (so a machine slower than the estimates says so).
"""
import dataclasses
import threading
import time
from typing import Callable, Tuple


@dataclasses.dataclass
class Job:
    name: str
    run: Callable  # run(progress) -> a one-line result; progress(fraction in [0, 1], note)
    estimate: float  # seconds on one core, for the time left
    after: Tuple[str, ...] = ()  # names of jobs that must finish first


class JobFailed(RuntimeError):
    pass


def clock(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class _Board:
    """What every job has done so far, shared by the worker threads and the printer."""

    def __init__(self, jobs):
        self.jobs = {job.name: job for job in jobs}
        self.fraction = {job.name: 0.0 for job in jobs}
        self.note = {}
        self.results, self.errors = {}, {}
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)

    def progress(self, name):
        def report(fraction, note=""):
            with self.lock:
                self.fraction[name] = min(max(fraction, 0.0), 1.0)
                self.note[name] = note
        return report

    def time_left(self, elapsed, workers):
        total = sum(job.estimate for job in self.jobs.values())
        done = sum(job.estimate * self.fraction[name] for name, job in self.jobs.items())
        rate = done / elapsed if done > 0 and elapsed > 0 else workers
        return (total - done) / rate


def run_jobs(jobs, workers=2, every=10.0, echo=print):
    """Run `jobs` (a list of Job), at most `workers` at once; returns {name: result}.

    A failing job lets the running ones finish, starts no new one, and raises JobFailed naming it.
    """
    board, start = _Board(jobs), time.time()
    pending, running = list(jobs), {}

    def work(job):
        try:
            result = job.run(board.progress(job.name))
        except Exception as error:  # reported by the main thread, with the job's name
            with board.changed:
                board.errors[job.name] = error
                board.changed.notify()
            return
        with board.changed:
            board.fraction[job.name] = 1.0
            board.results[job.name] = result
            board.changed.notify()

    with board.changed:
        while pending or running:
            for name in [name for name in running if name in board.results or name in board.errors]:
                running.pop(name).join()
                if name in board.results:
                    echo(f"[{clock(time.time() - start)}] {board.results[name]}")
            if board.errors and not running:
                name, error = next(iter(board.errors.items()))
                raise JobFailed(f"{name} failed: {error}") from error
            ready = [job for job in pending if all(dep in board.results for dep in job.after)]
            while ready and len(running) < workers and not board.errors:
                job = ready.pop(0)
                pending.remove(job)
                running[job.name] = threading.Thread(target=work, args=(job,), daemon=True)
                running[job.name].start()
            if not running and pending and not board.errors:
                raise JobFailed(f"{[job.name for job in pending]} wait for jobs that do not exist")
            if running and not board.changed.wait(timeout=every):
                elapsed = time.time() - start
                notes = "; ".join(board.note.get(name) or name for name in running)
                echo(f"[{clock(elapsed)}] {notes}; about {clock(board.time_left(elapsed, workers))} left")
    return board.results
