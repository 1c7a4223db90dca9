"""The GPU check: the first evidence that the GPU paths work, and what must pass before `auto` may
choose the csrc `cuda` backend.

    bash scripts/gpu_check.sh                 # on the GPU machine: installs the carried wheels, then runs this
    python scripts/gpu_check.py [--parts P]   # where everything is installed already

Parts, the most important first; each runs in a child process under its own time limit (shortened
to end before --deadline), and the report (docs/gpu_check_<date>[_dry_run].md, and a copy in $OUT
when that is set) is rewritten every few seconds, so a run cut short still reports:
- tests: the GPU tests of TEST_FILES (the csrc kernels and fla's kernels against the reference,
  decoding on the GPU) and their CPU tests, under this machine's software;
- training: fairseq-train of the tiny translation and language models, --updates updates with each
  of --fp16, --bf16 and --amp, loss finite and falling; the translation model is launched as the
  console script fairseq-train, the language model as `python -m fairseq_cli.train`;
- benchmark: examples/speed/op_benchmark.py --device cuda;
- interpreter: tests/test_fla_interpreted.py in a process of its own with TRITON_INTERPRET=1 (fla's
  kernels on CPU tensors, as CI runs them).
Without CUDA (a dry run, e.g. scripts/gpu_rehearsal.sh) the GPU tests skip, the trainings use --bf16
on the CPU, and the benchmark skips.
"""
import argparse
import datetime
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

TEST_FILES = ["tests/test_kernels.py", "tests/test_fla.py", "tests/test_ops.py", "tests/test_gated_ops.py",
              "tests/test_attention.py"]
INTERPRETER_FILES = ["tests/test_fla_interpreted.py"]
# What each file's GPU tests (test_gpu_*) run on the GPU.
GPU_TESTS_RUN = {"test_kernels.py": "the csrc CUDA kernels against the reference",
                 "test_fla.py": "fla's Triton kernels against the reference",
                 "test_attention.py": "incremental decoding against the full forward",
                 "test_ops.py": "the ops on CUDA tensors", "test_gated_ops.py": "the gated ops on CUDA tensors"}
PRECISIONS = ("--fp16", "--bf16", "--amp")
# Seconds per part on a GPU machine; the sum fits one 10-minute device call with the install.
LIMITS = {"tests": 210, "training": 150, "benchmark": 75, "interpreter": 60}
HOW_TO_READ = ("How to read this report: every part ends with one of passed, FAILED, skipped (with the reason) "
               "or stopped at its time limit (it ran out of time; that is not a failure of what it checks). "
               "A FAILED part lists each failing test or training with the first lines of its message; "
               '"What ran on the GPU" lists only what finished on the GPU. Rerun one part alone with '
               "`bash scripts/gpu_check.sh --parts NAME`.")


def cuda():
    return torch.cuda.is_available()


def versions():
    def version(module):
        try:
            return __import__(module).__version__
        except Exception as err:  # not installed, or no version attribute
            return f"not available ({type(err).__name__})"

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    device = torch.cuda.get_device_name() if cuda() else "none (dry run on the CPU)"
    return [("date", datetime.datetime.now().isoformat(timespec="minutes")), ("device", device),
            ("commit", commit.stdout.strip() or "unknown"), ("python", platform.python_version()),
            ("torch", torch.__version__), ("CUDA", str(torch.version.cuda)), ("triton", version("triton")),
            ("numpy", version("numpy")), ("fla", version("fla")), ("fairseq", version("fairseq"))]


class Section:
    """A part's text, rewritten to a file as it grows (the parent reads it into the report)."""

    def __init__(self, path):
        self.path, self.lines = path, []

    def add(self, text):
        self.lines.append(text)
        self.flush()

    def flush(self, extra=()):
        with open(self.path, "w") as f:
            f.write("\n".join([*self.lines, *extra]) + "\n")


# -- tests ---------------------------------------------------------------------------


RESULT_LINE = re.compile(r"(?:(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR))|(?:(PASSED|FAILED|SKIPPED|ERROR) "
                         r"(tests/\S+::\S+))")


def run_pytest(section, files, env=None):
    """pytest -v on `files`, a table of outcomes per file kept current in `section`; returns
    (passed?, {file: {outcome: count}}, failure lines, GPU tests passed per file)."""
    argv = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", *files]
    try:
        import xdist  # noqa: F401  (in the GPU image: its CPU cores run the CPU tests side by side)
        argv += ["-n", str(min(8, os.cpu_count() or 1))]
    except ImportError:
        pass
    counts, gpu_passed, failures = {}, {}, []
    env = dict(env or os.environ, COLUMNS="400")  # pytest cuts its summary lines to the terminal's width
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    tail, last = [], 0.0
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        match = RESULT_LINE.search(line)
        if match:
            nodeid = match.group(1) or match.group(4)
            outcome = (match.group(2) or match.group(3)).lower()
            name = nodeid.split("::")[0].split("/")[-1]
            row = counts.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0, "error": 0})
            row[outcome] += 1
            if outcome == "passed" and "::test_gpu_" in nodeid:
                gpu_passed[name] = gpu_passed.get(name, 0) + 1
        if line.startswith(("FAILED ", "ERROR ")) and " - " in line:
            failures.append(f"- `{line.split(' ')[1]}`: {line.split(' - ', 1)[1].strip()[:300]}")
        if time.time() - last > 5:
            last = time.time()
            section.flush(_test_table(counts))
    code = proc.wait()
    lines = _test_table(counts)
    if failures:
        lines += ["", "Failures:", *failures]
    if not counts:
        lines += ["pytest ran no test:", "```", *[x.rstrip() for x in tail], "```"]
    section.lines += [f"pytest exit status {code}.", *lines]
    section.flush()
    return code == 0, counts, gpu_passed


def _test_table(counts):
    rows = [f"| {name} | {r['passed']} | {r['failed'] + r['error']} | {r['skipped']} |" for name, r in counts.items()]
    return ["| file | passed | failed | skipped |", "|---|---|---|---|", *rows]


def part_tests(section, args):
    section.add("GPU tests are the test_gpu_* ones; they skip without CUDA. The other tests of these files are "
                "CI's CPU tests, run here under this machine's software.\n")
    ok, _, gpu_passed = run_pytest(section, TEST_FILES)
    on_gpu = [f"{count} GPU tests of {name} passed: {GPU_TESTS_RUN.get(name, 'GPU tests')}"
              for name, count in gpu_passed.items()]
    return ok, on_gpu


def part_interpreter(section, args):
    env = dict(os.environ, TRITON_INTERPRET="1")
    section.add("fla's kernels (chunk kernels in float16, recurrent kernels in float32, one decoding step) on CPU "
                "tensors through Triton's interpreter, in a process of its own with TRITON_INTERPRET=1.\n")
    ok, counts, _ = run_pytest(section, INTERPRETER_FILES, env=env)
    return ok and sum(r["passed"] for r in counts.values()) > 0, []


# -- training --------------------------------------------------------------------------


def losses(log):
    return [float(x) for x in re.findall(r"train_inner \| .*? loss=([-+0-9.einfa]+)", log)]


def part_training(section, args):
    """Tiny translation and LM models, `updates` updates per precision; loss finite and falling."""
    from fairseq_fwp.ops.backends import resolved_name
    from examples.recipes.synthetic_data import write_corpora
    from examples.recipes.pipeline import preprocess_lm, preprocess_translation, train_lm, train_translation

    work = tempfile.mkdtemp(prefix="gpu_check_")
    mt_raw, lm_raw = write_corpora(os.path.join(work, "raw"), n_train=2000, n_eval=100)
    mt_bin, lm_bin = os.path.join(work, "bin-mt"), os.path.join(work, "bin-lm")
    preprocess_translation(mt_raw, mt_bin)
    preprocess_lm(lm_raw, lm_bin)
    # (model, launcher, train): the translation model through the console script, the LM as a module.
    models = [("translation (linear, sum)", "fairseq-train", lambda save, *flags: train_translation(
                  mt_bin, save, *flags, max_update=args.updates, lr=0.002, warmup=10)),
              ("language model (linear, delta)", "python -m fairseq_cli.train", lambda save, *flags: train_lm(
                  lm_bin, save, *flags, max_update=args.updates, as_module=True))]
    half = {"--fp16": torch.float16, "--bf16": torch.bfloat16, "--amp": torch.float16}
    section.add(f"{args.updates} updates each, `--fwp-backend auto`, feature size D = 16 (4 heads of 16).\n")
    section.add("| model | launched as | precision | auto runs | first 10 losses (mean) | last 10 (mean) | "
                "finite, falling | time |")
    section.add("|---|---|---|---|---|---|---|---|")
    ok, on_gpu = True, []
    for name, launcher, train in models:
        for precision in PRECISIONS:
            if not cuda() and precision != "--bf16":
                section.add(f"| {name} | {launcher} | {precision} | | | | skipped: needs CUDA | |")
                continue
            device = "cuda" if cuda() else "cpu"
            backend = resolved_name("auto", torch.zeros(1, 1, 2, 16, device=device, dtype=half[precision]), 16)
            start = time.time()
            try:
                values = losses(train(os.path.join(work, re.sub(r"\W", "", name + precision)), precision))
            except RuntimeError as err:
                section.add(f"| {name} | {launcher} | {precision} | {backend} | | | FAILED: "
                            f"{' '.join(str(err).splitlines()[-3:])[:300]} | |")
                ok = False
                continue
            head, tail = values[:10], values[-10:]
            good = (len(values) >= min(args.updates, 20) and all(math.isfinite(x) for x in values)
                    and sum(tail) / len(tail) < sum(head) / len(head))
            ok &= good
            section.add(f"| {name} | {launcher} | {precision} | {backend} | {sum(head) / len(head):.3f} | "
                        f"{sum(tail) / len(tail):.3f} | {'yes' if good else 'NO'} | {time.time() - start:.0f} s |")
            if good and cuda():
                on_gpu.append(f"fairseq-train, {name}, {precision} ({launcher}): {len(values)} updates with "
                              f"backend {backend}, loss {sum(head) / len(head):.2f} -> {sum(tail) / len(tail):.2f}")
    return ok, on_gpu


# -- benchmark ---------------------------------------------------------------------------


def part_benchmark(section, args):
    if not cuda():
        section.add("skipped: needs CUDA")
        return None, []
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "speed", "op_benchmark.py"), "--device",
                           "cuda"], cwd=ROOT, capture_output=True, text=True)
    section.add(proc.stdout + (f"\nexit status {proc.returncode}:\n```\n{proc.stderr[-3000:]}\n```"
                               if proc.returncode else ""))
    return proc.returncode == 0, ["the op benchmark above"] if proc.returncode == 0 else []


PARTS = {"tests": ("Tests", part_tests), "training": ("fairseq-train in half precision", part_training),
         "benchmark": ("Op benchmark", part_benchmark), "interpreter": ("fla through Triton's interpreter",
                                                                        part_interpreter)}
OUTCOMES = {True: "passed", False: "FAILED", None: "skipped"}


def run_child(args):
    """One part, in this (child) process: its text into --section, its outcome into --section.json."""
    section = Section(args.section)
    ok, on_gpu = PARTS[args.child][1](section, args)
    with open(args.section + ".json", "w") as f:
        json.dump({"outcome": OUTCOMES[ok], "on_gpu": on_gpu}, f)


# -- the parent: parts under time limits, and the report ------------------------------


class Report:
    """The report, rewritten whole whenever a part's text grows."""

    def __init__(self, paths):
        self.paths = paths
        self.header = [HOW_TO_READ, "", "# GPU check", "",
                       "Command: `bash scripts/gpu_check.sh` (docs/DEVELOPERS.md: the GPU check).", "",
                       *(f"- {key}: {value}" for key, value in versions())]
        self.sections, self.outcomes, self.on_gpu = {}, {}, []

    def write(self):
        ran = self.on_gpu or ["nothing yet" if cuda() else "nothing: there is no GPU here (a dry run)"]
        lines = [*self.header, "", "## What ran on the GPU", "", *(f"- {x}" for x in ran)]
        for title, text in self.sections.values():
            lines += ["", f"## {title}", "", text.rstrip()]
        lines += ["", "## Outcome", "", *(f"- {part}: {outcome}" for part, outcome in self.outcomes.items())]
        for path in self.paths:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write("\n".join(lines) + "\n")


def run_part(part, limit, report, args, tmp):
    """Runs `part` in a child process for at most `limit` seconds; returns its outcome."""
    title = PARTS[part][0]
    path = os.path.join(tmp, part + ".md")
    argv = [sys.executable, os.path.abspath(__file__), "--child", part, "--section", path,
            "--updates", str(args.updates)]
    start = time.time()
    child = subprocess.Popen(argv, cwd=ROOT, start_new_session=True)  # its own group: stopped with its children
    stopped = False
    while child.poll() is None:
        if time.time() - start > limit:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            stopped = True
            break
        time.sleep(2)
        report.sections[part] = (title, _read(path))
        report.write()
    text = _read(path)
    if stopped:
        outcome, on_gpu = f"stopped at its time limit ({limit:.0f} s)", []
    elif os.path.exists(path + ".json"):
        with open(path + ".json") as f:
            result = json.load(f)
        outcome, on_gpu = result["outcome"], result["on_gpu"]
    else:
        outcome, on_gpu = f"FAILED (the part's process exited with status {child.returncode})", []
    report.sections[part] = (title, text + f"\n{outcome}, {time.time() - start:.0f} s.")
    report.outcomes[part] = outcome
    report.on_gpu += on_gpu
    report.write()
    print(f"[gpu check] {part}: {outcome} ({time.time() - start:.0f} s)", flush=True)
    return outcome


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=50)
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset to run, in this order")
    parser.add_argument("--report-dir", default=os.path.join(ROOT, "docs"))
    parser.add_argument("--report-name", default=None, help="default: gpu_check_<date>[_dry_run].md")
    parser.add_argument("--deadline", type=float, default=None, help="Unix time by which every part has ended")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiplies every part's time limit (a dry run on a small CPU machine needs more)")
    parser.add_argument("--child", choices=list(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--section", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_child(args)
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    name = args.report_name or f"gpu_check_{datetime.date.today().isoformat()}{'' if cuda() else '_dry_run'}.md"
    paths = [os.path.join(args.report_dir, name)] + ([os.path.join(os.environ["OUT"], name)]
                                                      if os.environ.get("OUT") else [])
    report = Report(paths)
    report.write()
    deadline = args.deadline or math.inf
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        for part in parts:
            limit = min(LIMITS[part] * args.time_scale, deadline - time.time() - 5)
            if limit < 10:
                report.outcomes[part] = "not run: no time left before the deadline"
                report.write()
                continue
            outcomes.append(run_part(part, limit, report, args, tmp))
    print(f"[gpu check] report: {paths[0]}")
    return 1 if any(o.startswith("FAILED") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
