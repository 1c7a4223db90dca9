"""The quickstart's job runner: order, concurrency, progress lines and failures."""
import os
import sys
import threading
import time

import pytest

from examples.recipes.parallel import Job, JobFailed, clock, run_jobs
from helpers import ROOT


def sleeper(name, seconds, log, running, peak):
    def run(progress):
        with peak["lock"]:
            running.add(name)
            peak["most"] = max(peak["most"], len(running))
        log.append(("start", name))
        for step in range(4):
            progress(step / 4, f"{name} step {step}")
            time.sleep(seconds / 4)
        with peak["lock"]:
            running.discard(name)
        log.append(("end", name))
        return f"{name} done"
    return run


def jobs_of(spec, log):
    running, peak = set(), {"most": 0, "lock": threading.Lock()}
    return [Job(name, sleeper(name, seconds, log, running, peak), seconds, after)
            for name, seconds, after in spec], peak


def test_jobs_wait_for_theirs_and_never_exceed_the_workers():
    log, lines = [], []
    jobs, peak = jobs_of([("prepare", 0.05, ()), ("a", 0.1, ("prepare",)), ("b", 0.1, ("prepare",)),
                          ("c", 0.1, ("a",)), ("free", 0.1, ())], log)
    results = run_jobs(jobs, workers=2, every=5, echo=lines.append)
    assert results == {name: f"{name} done" for name in ("prepare", "a", "b", "c", "free")}
    assert peak["most"] == 2
    for before, later in (("prepare", "a"), ("prepare", "b"), ("a", "c")):
        assert log.index(("end", before)) < log.index(("start", later))
    assert sorted(line.split("] ")[1] for line in lines) == sorted(results.values())


def test_a_quiet_stretch_prints_what_runs_and_the_time_left():
    log, lines = [], []
    jobs, _ = jobs_of([("slow", 0.6, ())], log)
    run_jobs(jobs, workers=1, every=0.1, echo=lines.append)
    progress = [line for line in lines if "left" in line]
    assert progress and all("slow step" in line for line in progress)
    assert lines[-1].endswith("slow done")


def test_the_time_left_follows_the_rate_of_the_work_done():
    from examples.recipes.parallel import _Board

    board = _Board([Job("a", None, 100), Job("b", None, 100)])
    board.progress("a")(0.5)  # 50 estimated seconds done in 100 s: half the estimated speed
    assert board.time_left(elapsed=100, workers=2) == pytest.approx(300)
    assert _Board([Job("a", None, 100)]).time_left(elapsed=0, workers=2) == 50  # nothing done: estimates
    assert clock(125.4) == "2:05"


def test_a_failing_job_is_named_and_starts_nothing_that_waits_for_it():
    log = []

    def broken(progress):
        raise ValueError("bad data")

    jobs, _ = jobs_of([("later", 0.05, ("broken",)), ("side", 0.1, ())], log)
    with pytest.raises(JobFailed, match="broken failed: bad data"):
        run_jobs([Job("broken", broken, 1)] + jobs, workers=2, every=5, echo=lambda line: None)
    assert ("start", "later") not in log and ("end", "side") in log


def test_a_job_waiting_for_a_missing_job_is_refused():
    with pytest.raises(JobFailed, match="wait for jobs that do not exist"):
        run_jobs([Job("a", lambda progress: "a", 1, ("nothing",))], echo=lambda line: None)


@pytest.mark.parametrize("flag, value, message", [
    ("--capacity-steps", "50", "must be a positive multiple of 100"), ("--workers", "0", "must be > 0"),
    ("--cost-length", "20", "must be at least 48")])
def test_the_quickstarts_arguments_are_checked_when_parsed(capsys, flag, value, message):
    """A bad value stops the quickstart before any job starts, naming the flag."""
    sys.path.insert(0, os.path.join(ROOT, "examples", "quickstart"))
    import quickstart

    with pytest.raises(SystemExit):
        quickstart.parse_args([flag, value])
    assert f"argument {flag}: {message}" in capsys.readouterr().err
