"""The GPU check's report, which several calls complete: each part's last result, kept with its date, commit and
device until the files that the part checks change.

    docs/gpu_check_report.md      the report, rewritten whenever a part's text grows
    docs/gpu_check_report.json    each part's last result, what the report is made from

A part's result carries the digest of its sources (the files whose change can change its outcome: each part's
`sources` in scripts/gpu_check.py). A call reads the results of the calls before it (the JSON beside the
report), drops those whose sources changed since, and replaces the results of the parts it runs; the other
parts keep theirs. So a part runs in any call, on this machine or a later one, and one report shows them all.
"""
import dataclasses
import glob
import hashlib
import json
import os

HOW_TO_READ = ("How to read this report: every part ends with one of passed, FAILED, skipped (with the reason) "
               "or stopped at its time limit (it ran out of time; that is not a failure of what it checks). "
               "A FAILED part lists each failing test or training with the first lines of its message; "
               '"What ran on the GPU" lists only what finished on the GPU. Each part keeps its last result, '
               "with the date, commit and device of the call that ran it, until the files it checks change. "
               "Rerun one part alone with `bash scripts/gpu_check.sh --parts NAME`.")


def source_files(patterns, root):
    """The files that glob `patterns` (relative to root, ** recursive) name, relative, sorted."""
    found = set()
    for pattern in patterns:
        found.update(os.path.relpath(path, root) for path in glob.glob(os.path.join(root, pattern), recursive=True)
                     if os.path.isfile(path) and "__pycache__" not in path)
    return sorted(found)


def digest(patterns, root):
    """One hash of the names and contents of a part's source files."""
    h = hashlib.sha256()
    for name in source_files(patterns, root):
        h.update(name.encode() + b"\0")
        with open(os.path.join(root, name), "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]


@dataclasses.dataclass
class PartResult:
    title: str
    outcome: str  # passed, FAILED ..., skipped ..., stopped at its time limit ...
    summary: str  # the outcome with its seconds and first row, for the report's last section
    text: str  # the part's section
    on_gpu: list  # what finished on the GPU
    date: str
    commit: str
    device: str
    digest: str


class Report:
    """The report at `path` (markdown), with its results beside it (`path` + ".json", read at the start)."""

    def __init__(self, path, header, parts, digests, copies=()):
        """header: the lines about this call; parts: the part names, in the report's order; digests: {part: its
        sources' digest now}; copies: paths of copies of the report (the results beside each too)."""
        self.path, self.header, self.parts, self.copies = path, header, list(parts), copies
        self.results, self.dropped, self.running = {}, {}, {}
        for part, result in _read_results(self.results_path).items():
            if part not in digests:
                continue
            if result.digest == digests[part]:
                self.results[part] = result
            else:
                self.dropped[part] = result

    @property
    def results_path(self):
        return os.path.splitext(self.path)[0] + ".json"

    def show_running(self, part, title, text):
        """A running part's text so far (it replaces the part's last result in the report only once it ends)."""
        self.running[part] = (title, text)
        self.write()

    def finish(self, part, result):
        self.running.pop(part, None)
        self.results[part] = result
        self.dropped.pop(part, None)
        self.write()

    def markdown(self):
        on_gpu = [f"{item} ({result.date}, {result.device})" for part in self.parts if part in self.results
                  for result in [self.results[part]] for item in result.on_gpu]
        lines = [HOW_TO_READ, "", "# GPU check", "", *self.header, "", "## What ran on the GPU", "",
                 *(f"- {item}" for item in on_gpu or ["nothing yet"])]
        outcomes = []
        for part in self.parts:
            if part in self.running:
                title, text = self.running[part]
                lines += ["", f"## {title}", "", "_Running now._", "", text.rstrip()]
                outcomes.append(f"- {part}: running now")
            elif part in self.results:
                result = self.results[part]
                lines += ["", f"## {result.title}", "", f"_Run {result.date} on {result.device}, commit "
                          f"{result.commit}; its sources' digest {result.digest}._", "", result.text.rstrip()]
                outcomes.append(f"- {part}: {result.summary} ({result.date}, commit {result.commit})")
            elif part in self.dropped:
                outcomes.append(f"- {part}: not run since the files it checks changed (its last result: "
                                f"{self.dropped[part].summary}, {self.dropped[part].date}, commit "
                                f"{self.dropped[part].commit})")
            else:
                outcomes.append(f"- {part}: not run yet")
        return "\n".join(lines + ["", "## Outcome", "", *outcomes]) + "\n"

    def write(self):
        text = self.markdown()
        results = {part: dataclasses.asdict(result) for part, result in self.results.items()}
        for path in (self.path, *self.copies):
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            _write(path, text)
            _write(os.path.splitext(path)[0] + ".json", json.dumps(results, indent=1, sort_keys=True) + "\n")


def _read_results(path):
    try:
        with open(path) as f:
            return {part: PartResult(**result) for part, result in json.load(f).items()}
    except FileNotFoundError:
        return {}


def _write(path, text):
    with open(path + ".part", "w") as f:
        f.write(text)
    os.replace(path + ".part", path)
