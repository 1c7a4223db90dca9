"""The GPU check: what must pass on a GPU before `auto` may choose a GPU path.

    bash scripts/gpu_check.sh          # on the GPU machine (installs the carried wheels, then runs this)
    python scripts/gpu_check.py        # where everything is installed already

Runs, in this order, and writes docs/gpu_check_<date>.md (and a copy into
$OUT when that is set) after each part, so a run cut short still reports:
1. every GPU test: the cuda and fla backends against the reference (float32
   tight, half types loose, every gradient, D = 512), decoding on the GPU;
2. fairseq-train of the tiny translation and language models for 50 updates
   with each of --fp16, --bf16 and --amp: the loss must stay finite and fall;
3. the GPU op benchmark (python -m fairseq_fwp.ops.benchmark --device cuda).
Without CUDA (a dry run) it runs what a CPU can: the test files (their GPU
tests skip) and --bf16 training on the CPU.
"""
import argparse
import datetime
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "quickstart"))

import torch  # noqa: E402

TEST_FILES = ["tests/test_kernels.py", "tests/test_fla.py", "tests/test_ops.py", "tests/test_gated_ops.py",
              "tests/test_attention.py"]
PRECISIONS = ("--fp16", "--bf16", "--amp")
OUTCOMES = {True: "passed", False: "FAILED", None: "skipped (needs CUDA)"}


def versions():
    def version(module):
        try:
            return __import__(module).__version__
        except Exception as err:  # not installed, or no version attribute
            return f"not available ({type(err).__name__})"

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (dry run on the CPU)"
    return [("date", datetime.datetime.now().isoformat(timespec="minutes")), ("device", device),
            ("commit", commit.stdout.strip() or "unknown"), ("python", platform.python_version()),
            ("torch", torch.__version__), ("CUDA", str(torch.version.cuda)), ("triton", version("triton")),
            ("fla", version("fla")), ("fairseq", version("fairseq"))]


def run_tests(report):
    """The test files under pytest; a table of outcomes per file and the failures' messages."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        start = time.time()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                               *TEST_FILES], cwd=ROOT, capture_output=True, text=True)
        if not os.path.exists(xml):
            report.add(f"pytest did not run (exit {proc.returncode}):\n```\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}\n```")
            return False
        cases = ElementTree.parse(xml).getroot().iter("testcase")
        counts, failures = {}, []
        for case in cases:
            name = case.get("classname", "").split(".")[-1] + ".py"
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome = "failed"
                    failures.append(f"- `{case.get('name')}` ({name}): {(child.get('message') or '')[:300]}")
                elif child.tag == "skipped":
                    outcome = "skipped"
            row = counts.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0})
            row[outcome] += 1
    report.add(f"pytest exit status {proc.returncode}, {time.time() - start:.0f} s. GPU tests skip without CUDA.\n")
    report.add("| file | passed | failed | skipped |\n|---|---|---|---|")
    for name, row in counts.items():
        report.add(f"| {name} | {row['passed']} | {row['failed']} | {row['skipped']} |")
    if failures:
        report.add("\nFailures:\n" + "\n".join(failures))
    return proc.returncode == 0


def losses(log):
    return [float(x) for x in re.findall(r"train_inner \| .*? loss=([-+0-9.einfa]+)", log)]


def run_training(report, updates):
    """Tiny translation and LM models, 50 updates per precision; loss finite and falling."""
    from fairseq_fwp.ops.fast_weight import resolve_backend
    from fairseq_fwp.synthetic_data import write_corpora
    from pipeline import preprocess_lm, preprocess_translation, train_lm, train_translation

    cuda = torch.cuda.is_available()
    work = tempfile.mkdtemp(prefix="gpu_check_")
    mt_raw, lm_raw = write_corpora(os.path.join(work, "raw"), n_train=2000, n_eval=100)
    mt_bin, lm_bin = os.path.join(work, "bin-mt"), os.path.join(work, "bin-lm")
    preprocess_translation(mt_raw, mt_bin)
    preprocess_lm(lm_raw, lm_bin)
    models = {"translation (linear, sum)": lambda save, *flags: train_translation(
                  mt_bin, save, *flags, max_update=updates, lr=0.002, warmup=10),
              "language model (linear, delta)": lambda save, *flags: train_lm(
                  lm_bin, save, *flags, max_update=updates)}
    half = {"--fp16": torch.float16, "--bf16": torch.bfloat16, "--amp": torch.float16}
    report.add(f"{updates} updates each, `--fwp-backend auto`, feature size D = 16 (4 heads of 16).\n")
    report.add("| model | precision | auto runs | first 10 losses (mean) | last 10 (mean) | finite, falling | time |")
    report.add("|---|---|---|---|---|---|---|")
    ok = True
    for name, train in models.items():
        for precision in PRECISIONS:
            if not cuda and precision != "--bf16":
                report.add(f"| {name} | {precision} | | | | skipped: needs CUDA | |")
                continue
            device = "cuda" if cuda else "cpu"
            backend = resolve_backend("auto", torch.zeros(1, 1, 2, 16, device=device, dtype=half[precision]), 16)
            start = time.time()
            try:
                values = losses(train(os.path.join(work, re.sub(r"\W", "", name + precision)), precision))
            except RuntimeError as err:
                report.add(f"| {name} | {precision} | {backend} | | | FAILED: {str(err).splitlines()[-1][:200]} | |")
                ok = False
                continue
            head, tail = values[:10], values[-10:]
            good = (len(values) >= min(updates, 20) and all(math.isfinite(x) for x in values)
                    and sum(tail) / len(tail) < sum(head) / len(head))
            ok &= good
            report.add(f"| {name} | {precision} | {backend} | {sum(head) / len(head):.3f} | {sum(tail) / len(tail):.3f} "
                       f"| {'yes' if good else 'NO'} | {time.time() - start:.0f} s |")
    shutil.rmtree(work, ignore_errors=True)
    return ok


def run_benchmark(report):
    if not torch.cuda.is_available():
        report.add("skipped: needs CUDA")
        return None
    proc = subprocess.run([sys.executable, "-m", "fairseq_fwp.ops.benchmark", "--device", "cuda"], cwd=ROOT,
                          capture_output=True, text=True)
    report.add(proc.stdout + (f"\nexit status {proc.returncode}:\n```\n{proc.stderr[-3000:]}\n```"
                              if proc.returncode else ""))
    return proc.returncode == 0


class Report:
    """A markdown report rewritten after every part (docs/, and $OUT where that is set)."""

    def __init__(self, paths):
        self.paths, self.lines = paths, []

    def add(self, text):
        self.lines.append(text)
        for path in self.paths:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write("\n".join(self.lines) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=50)
    parser.add_argument("--parts", default="tests,training,benchmark", help="comma-separated subset to run")
    parser.add_argument("--report-dir", default=os.path.join(ROOT, "docs"))
    args = parser.parse_args(argv)
    name = f"gpu_check_{datetime.date.today().isoformat()}{'' if torch.cuda.is_available() else '_dry_run'}.md"
    paths = [os.path.join(args.report_dir, name)] + ([os.path.join(os.environ["OUT"], name)] if os.environ.get("OUT") else [])
    report = Report(paths)
    report.add("# GPU check\n\nCommand: `bash scripts/gpu_check.sh` (see docs/DEVELOPERS.md).\n")
    report.add("\n".join(f"- {key}: {value}" for key, value in versions()))
    parts = {"tests": ("Tests", run_tests), "training": ("fairseq-train in half precision",
                                                          lambda r: run_training(r, args.updates)),
             "benchmark": ("Op benchmark", run_benchmark)}
    outcome = {}
    for part in args.parts.split(","):
        title, run = parts[part]
        report.add(f"\n## {title}\n")
        start = time.time()
        outcome[part] = run(report)
        print(f"[gpu check] {part}: {OUTCOMES[outcome[part]]} ({time.time() - start:.0f} s)", flush=True)
    report.add("\n## Outcome\n\n" + "\n".join(f"- {part}: {OUTCOMES[ok]}" for part, ok in outcome.items()))
    print(f"[gpu check] report: {paths[0]}")
    return 1 if False in outcome.values() else 0


if __name__ == "__main__":
    sys.exit(main())
