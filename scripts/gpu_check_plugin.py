"""The GPU check's pytest plugin: each test's outcome goes into the report the moment pytest reports it.

    pytest -p gpu_check_plugin ...     (scripts/ on PYTHONPATH; GPU_CHECK_SECTION=PATH names the section,
                                        GPU_CHECK_HEADER its first lines; GPU_CHECK_SELECTION=check runs
                                        only the GPU cases of tests/gpu_check_cases.py)

The section (markdown) is rewritten whole at every report: a table per test file, then every failure with
its test id and pytest's message. A run cut at its time limit therefore still says what failed and why.
Each file's first test is timed against the median of its others: the first one pays for Triton's
compile and autotune (and the csrc extension's build), which the later ones find cached. Under
pytest-xdist only the controller writes; it sees every worker's reports.
"""
import importlib.util
import json
import os
import statistics

MESSAGE_CHARACTERS = 600
CASES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "gpu_check_cases.py")


class SectionWriter:
    def __init__(self, path, header):
        self.path, self.header = path, header
        self.counts, self.durations, self.failures, self.skips = {}, {}, [], {}
        self.exit_status = None

    def record(self, report):
        name = report.nodeid.split("::")[0].split("/")[-1]
        row = self.counts.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0, "gpu passed": 0})
        self.durations.setdefault(name, {}).setdefault(report.nodeid, 0.0)
        self.durations[name][report.nodeid] += report.duration
        if report.failed:
            row["failed"] += 1
            self.failures.append(f"- `{report.nodeid}` ({report.when}): {crash_message(report)}")
        elif report.skipped and report.when in ("setup", "call"):
            row["skipped"] += 1
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            key = reason.removeprefix("Skipped: ")
            self.skips[key] = self.skips.get(key, 0) + 1
        elif report.passed and report.when == "call":
            row["passed"] += 1
            row["gpu passed"] += "::test_gpu_" in report.nodeid
        self.write()

    def write(self):
        lines = [self.header, "", "| file | passed | failed | skipped | first test (s) | later tests, median (s) |",
                 "|---|---|---|---|---|---|"]
        for name, row in self.counts.items():
            times = list(self.durations[name].values())
            later = f"{statistics.median(times[1:]):.2f}" if len(times) > 1 else ""
            lines.append(f"| {name} | {row['passed']} | {row['failed']} | {row['skipped']} | {times[0]:.1f} | {later} |")
        if self.failures:
            lines += ["", "Failures, as pytest reported them:", *self.failures]
        if self.skips:
            lines += ["", "Skipped:", *(f"- {count} x {reason}" for reason, count in self.skips.items())]
        if self.exit_status is not None:
            lines += ["", f"pytest exit status {self.exit_status}."]
        with open(self.path + ".part", "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(self.path + ".part", self.path)  # the check reads it while it is written
        with open(self.path + ".counts.json", "w") as f:
            json.dump(self.counts, f)


def crash_message(report):
    """pytest's own message for a failure: the exception's line, or the last lines of the report."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else " ".join(str(report.longrepr).strip().splitlines()[-3:])
    text = " ".join(text.split())
    return text if len(text) <= MESSAGE_CHARACTERS else text[:MESSAGE_CHARACTERS] + " ..."


_writer = None


def pytest_configure(config):
    global _writer
    if os.environ.get("GPU_CHECK_SECTION") and not hasattr(config, "workerinput"):  # not an xdist worker
        _writer = SectionWriter(os.environ["GPU_CHECK_SECTION"], os.environ.get("GPU_CHECK_HEADER", ""))
        _writer.write()


def check_cases():
    """tests/gpu_check_cases.py, the check's selection of GPU cases."""
    spec = importlib.util.spec_from_file_location("gpu_check_cases", CASES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_collection_modifyitems(config, items):
    """With GPU_CHECK_SELECTION=check: of the GPU cases (the `gpu` fixture's "cuda"), those of
    tests/gpu_check_cases.py only; every other case stays."""
    if os.environ.get("GPU_CHECK_SELECTION", "all") != "check":
        return
    selected = check_cases().selected
    on_gpu = lambda item: getattr(item, "callspec", None) and item.callspec.params.get("gpu") == "cuda"  # noqa
    dropped = [item for item in items if on_gpu(item) and not selected(item.path, item.callspec.params)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in dropped]


def pytest_runtest_logreport(report):
    if _writer is not None:
        _writer.record(report)


def pytest_sessionfinish(session, exitstatus):
    if _writer is not None:
        _writer.exit_status = int(exitstatus)
        _writer.write()
