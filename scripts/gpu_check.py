"""The GPU check: the first evidence that the GPU paths work, and what must pass before `auto` may
choose the csrc `cuda` backend.

    bash scripts/gpu_check.sh                 # on the GPU machine: installs the carried wheels, then runs this
    python scripts/gpu_check.py [--parts P]   # where everything is installed already

Parts, in this order; each runs in a child process under its own time limit (shortened to end before
--deadline), and the report (docs/gpu_check_<date>[_dry_run].md, and a copy in $OUT when that is set)
is rewritten as each part writes, so a run cut short still reports:
- tests: the GPU tests (named test_gpu_*: every test that needs CUDA) of the files that have them (or of
  --tests); each outcome, and each failure with its message, goes into the report as pytest reports it
  (gpu_check_plugin.py). The CPU tests are CI's;
- benchmark: one decoder layer's decoding step (examples/speed/layer_step.py --device cuda: the fused step's
  CUDA kernel and each rule's own step against softmax attention's), then examples/speed/op_benchmark.py
  --device cuda --quick, printed as they run;
- training: fairseq-train of the tiny translation and language models, --updates updates with each
  of --fp16, --bf16 and --amp, loss finite and falling; the translation model is launched as the
  console script fairseq-train, the language model as `python -m fairseq_cli.train`;
- train-step: examples/speed/train_step.py, training steps of a GPT-2-small-sized LM, fairseq's own
  transformer_lm against the fwp rows of --train-step-rows;
- profile: one training step of PROFILE_ROWS at T = 2048 under torch.profiler (train_step.py --profile).
On a GPU a warm-up compiles the train-step and profile rows' Triton kernels beside the earlier parts
(start_warm_up). Every part reports when it wrote its first row, and what Triton's compile and autotune cost it: its first
call against the later ones. One Triton cache folder (TRITON_CACHE_DIR, which gpu_check.sh sets) serves
the whole check, so a part finds what an earlier one compiled.
Without CUDA (a dry run, e.g. scripts/gpu_rehearsal.sh) the GPU tests skip, train-step and profile run their
tiny shape on the CPU, the benchmark skips, and the trainings use --bf16 on the CPU.
"""
import argparse
import datetime
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

PRECISIONS = ("--fp16", "--bf16", "--amp")
# Seconds per part on a GPU machine: with the install (about 30 s), the check ends within its default
# budget of 480 s (GPU_CHECK_BUDGET, gpu_check.sh).
LIMITS = {"tests": 130, "benchmark": 40, "training": 55, "train-step": 150, "profile": 45,
          "warm-up": 150}  # the warm-up runs beside the parts before train-step (start_warm_up)
TRAIN_STEP_ROWS = "all"  # or a comma-separated subset of examples/speed/train_step.py's rows
PROFILE_ROWS = ("fairseq-softmax", "linear-delta")  # the profile part: one step of each at T = 2048
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
    # A copied tree can carry an older .git than its files (the device tool's copy did): say when they differ.
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip()
    device = (f"{torch.cuda.get_device_name()} (compute capability {'.'.join(map(str, torch.cuda.get_device_capability()))})"
              if cuda() else "none (dry run on the CPU)")
    return [("date", datetime.datetime.now().isoformat(timespec="minutes")), ("device", device),
            ("commit", (commit.stdout.strip() or "unknown") + (
                f" with {len(changed.splitlines())} files changed since (the report's tree is not that commit's)"
                if changed else "")), ("python", platform.python_version()),
            ("torch", torch.__version__), ("CUDA", str(torch.version.cuda)), ("triton", version("triton")),
            ("numpy", version("numpy")), ("fla", version("fla")), ("fairseq", version("fairseq")),
            ("Triton cache", os.environ.get("TRITON_CACHE_DIR", "Triton's default"))]


class Section:
    """A part's text, rewritten to a file as it grows (the parent reads it into the report)."""

    def __init__(self, path):
        self.path, self.lines = path, []

    def add(self, text):
        self.lines.append(text)
        self.flush()

    def flush(self, extra=()):
        with open(self.path + ".part", "w") as f:
            f.write("\n".join([*self.lines, *extra]) + "\n")
        os.replace(self.path + ".part", self.path)  # the parent reads it while it is written


def stream(section, argv):
    """Runs argv, adding each line of its standard output to the section as it comes; returns its exit
    status (and, if that is not 0, the last lines of its standard error)."""
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=errors, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        for line in proc.stdout:
            section.add(line.rstrip())
        code = proc.wait()
        if code:
            errors.seek(0)
            tail = errors.read().strip().splitlines()[-20:]
            section.add(f"\nexit status {code}:\n```\n" + "\n".join(tail) + "\n```")
    return code


# -- tests ---------------------------------------------------------------------------


def gpu_test_files():
    """The test files that have GPU tests (test_gpu_*), as paths from the repository root."""
    folder = os.path.join(ROOT, "tests")
    return [f"tests/{name}" for name in sorted(os.listdir(folder))
            if name.startswith("test_") and name.endswith(".py")
            and "def test_gpu_" in open(os.path.join(folder, name)).read()]


def part_tests(section, args):
    files = args.tests.split(",") if args.tests else gpu_test_files()
    header = (f"The GPU tests (`pytest -m gpu`: the tests named test_gpu_*, marked gpu by tests/conftest.py) of "
              f"{', '.join(files)}; they skip without CUDA. Outcomes as pytest reports them.")
    argv = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "gpu_check_plugin", "-p", "no:cacheprovider",
            *files]
    try:
        import xdist  # noqa: F401  (in the GPU image: Triton compiles one kernel at a time per process, and
        # the fla tests spend 10-13 s each compiling: as many workers as cores, 12 at most, share the GPU)
        argv += ["-n", str(min(12, os.cpu_count() or 1))]
    except ImportError:
        pass
    env = dict(os.environ, GPU_CHECK_SECTION=section.path, GPU_CHECK_HEADER=header,
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "scripts"), os.environ.get("PYTHONPATH", "")]))
    code = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    try:
        with open(section.path + ".counts.json") as f:
            counts = json.load(f)
    except FileNotFoundError:
        counts = {}
    ran = sum(row["passed"] + row["failed"] for row in counts.values())
    on_gpu = [f"{row['gpu passed']} GPU tests of {name} passed" for name, row in counts.items() if row["gpu passed"]]
    # exit status 5: no test selected (a dry run skips them at collection)
    return (code == 0 if ran or code not in (0, 5) else None), on_gpu


# -- the training-step and op benchmarks ----------------------------------------------


def part_train_step(section, args):
    rows = [] if args.train_step_rows == "all" else ["--rows", *args.train_step_rows.split(",")]
    argv = [sys.executable, os.path.join(ROOT, "examples", "speed", "train_step.py"), *rows,
            "--row-limit", str(args.row_limit)]
    if not cuda():
        argv += ["--tiny", "--device", "cpu"]
    code = stream(section, argv)
    rows = [line for line in section.lines if line.startswith("| ") and "tokens/s" not in line]
    ran = [row for row in rows if re.match(r"\| \d+ \| \S+ \| [\d,]+ \|", row)]
    return code == 0 and len(ran) == len(rows), [f"the training-step benchmark above ({len(ran)} rows)"] if cuda() and ran else []


def part_profile(section, args):
    """One training step of each of PROFILE_ROWS at T = 2048 under torch.profiler: the ops that took the most
    GPU time (train_step.py --profile)."""
    argv = [sys.executable, os.path.join(ROOT, "examples", "speed", "train_step.py"), "--rows", *PROFILE_ROWS,
            "--steps", "2", "--profile", "25", "--row-limit", str(args.row_limit)]
    argv += ["--lengths", "2048"] if cuda() else ["--tiny", "--device", "cpu", "--lengths", "64"]
    code = stream(section, argv)
    profiled = sum(line.startswith("### Profile") for line in section.lines)
    return code == 0 and profiled == len(PROFILE_ROWS), [f"the profile above ({profiled} rows)"] if cuda() and profiled else []


def part_benchmark(section, args):
    if not cuda():
        section.add("skipped: needs CUDA")
        return None, []
    # a decoding step, fused (the extension's CUDA kernel) and each rule's own, against softmax attention's
    step = stream(section, [sys.executable, os.path.join(ROOT, "examples", "speed", "layer_step.py"), "--device",
                            "cuda"])
    section.add("")
    code = stream(section, [sys.executable, os.path.join(ROOT, "examples", "speed", "op_benchmark.py"), "--device",
                            "cuda", "--quick"])
    ran = ["the op benchmark above"] * (code == 0) + ["the decoding step above"] * (step == 0)
    return code == 0 and step == 0, ran


def start_warm_up(parts, args):
    """On a GPU, where train-step or profile will run: train_step.py --warm-up of their fast-weight rows, in
    the background from the start (beside the tests), so that their Triton kernels compile on several cores
    at once instead of one row at a time inside the rows' limits. Returns (the process, its output file), or
    None."""
    if not cuda() or not {"train-step", "profile"} & set(parts):
        return None
    from examples.speed.train_step import ROWS

    rows = list(ROWS) if args.train_step_rows == "all" else args.train_step_rows.split(",")
    rows = [row for row in dict.fromkeys(rows + list(PROFILE_ROWS)) if "softmax" not in row]
    output = tempfile.NamedTemporaryFile("w+", suffix=".warm-up")
    argv = [sys.executable, os.path.join(ROOT, "examples", "speed", "train_step.py"), "--warm-up", "--rows", *rows,
            "--row-limit", str(LIMITS["warm-up"])]
    return subprocess.Popen(argv, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT), output


def finish_warm_up(warm, deadline):
    """Waits for the warm-up (until the deadline at most); returns what it said."""
    process, output = warm
    try:
        process.wait(timeout=max(1.0, deadline - time.time() - 30))
    except subprocess.TimeoutExpired:
        process.kill()
        return "stopped before the deadline"
    output.seek(0)
    lines = output.read().strip().splitlines()
    return lines[-1][:500] if lines else f"exit status {process.returncode}"


# -- training --------------------------------------------------------------------------


def losses(log):
    return [float(x) for x in re.findall(r"train_inner \| .*? loss=([-+0-9.einfa]+)", log)]


def update_times(log):
    """(seconds from the start of training to the first update, median seconds of a later update), from
    fairseq-train's --log-interval 1 lines: the first update pays for compiling (its wall clock is in whole
    seconds), a later one's time is 1 / ups."""
    walls = re.findall(r"train_inner \| .*?num_updates=1,.*? wall=([0-9.]+)", log)
    later = [1 / float(x) for x in re.findall(r"train_inner \| .*? ups=([0-9.]+)", log)[1:] if float(x) > 0]
    return (float(walls[0]) if walls else math.nan), (statistics.median(later) if later else math.nan)


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
    section.add(f"{args.updates} updates each, `--fwp-backend auto`, feature size D = 16 (4 heads of 16). The "
                "first update (from the start of training, whole seconds) pays for Triton's compile and autotune.\n")
    section.add("| model | launched as | precision | auto runs | first 10 losses (mean) | last 10 (mean) | "
                "finite, falling | first update (s) | later updates (ms) | time |")
    section.add("|---|---|---|---|---|---|---|---|---|---|")
    ok, on_gpu = True, []
    for name, launcher, train in models:
        for precision in PRECISIONS:
            if not cuda() and precision != "--bf16":
                section.add(f"| {name} | {launcher} | {precision} | | | | skipped: needs CUDA | | | |")
                continue
            device = "cuda" if cuda() else "cpu"
            backend = resolved_name("auto", torch.zeros(1, 1, 2, 16, device=device, dtype=half[precision]), 16)
            start = time.time()
            try:
                log = train(os.path.join(work, re.sub(r"\W", "", name + precision)), precision)
            except RuntimeError as err:
                section.add(f"| {name} | {launcher} | {precision} | {backend} | | | FAILED: "
                            f"{' '.join(str(err).splitlines()[-3:])[:300]} | | | |")
                ok = False
                continue
            values, (first, later) = losses(log), update_times(log)
            head, tail = values[:10], values[-10:]
            good = (len(values) >= min(args.updates, 20) and all(math.isfinite(x) for x in values)
                    and sum(tail) / len(tail) < sum(head) / len(head))
            ok &= good
            section.add(f"| {name} | {launcher} | {precision} | {backend} | {sum(head) / len(head):.3f} | "
                        f"{sum(tail) / len(tail):.3f} | {'yes' if good else 'NO'} | {first:.0f} | {1e3 * later:.0f} | "
                        f"{time.time() - start:.0f} s |")
            if good and cuda():
                on_gpu.append(f"fairseq-train, {name}, {precision} ({launcher}): {len(values)} updates with "
                              f"backend {backend}, loss {sum(head) / len(head):.2f} -> {sum(tail) / len(tail):.2f}")
    return ok, on_gpu


PARTS = {"tests": ("GPU tests", part_tests), "benchmark": ("Op benchmark", part_benchmark),
         "training": ("fairseq-train in half precision", part_training),
         "train-step": ("Training steps, GPT-2 small", part_train_step),
         "profile": ("Profile of one training step, T = 2048", part_profile)}
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


def triton_cache_entries():
    """How many compiled kernels Triton's cache folder holds (one folder each), or None without one."""
    folder = os.environ.get("TRITON_CACHE_DIR")
    return len(os.listdir(folder)) if folder and os.path.isdir(folder) else None


def first_row_line(text):
    """The index of the first row of a markdown table in `text` below its header, or None."""
    lines = text.splitlines()
    for i, line in enumerate(lines[2:], 2):
        if line.startswith("| ") and lines[i - 1].startswith("|---"):
            return i
    return None


def run_part(part, limit, report, args, tmp):
    """Runs `part` in a child process for at most `limit` seconds; returns its outcome."""
    title = PARTS[part][0]
    path = os.path.join(tmp, part + ".md")
    argv = [sys.executable, os.path.abspath(__file__), "--child", part, "--section", path, "--updates",
            str(args.updates), "--train-step-rows", args.train_step_rows, "--row-limit", str(args.row_limit)]
    argv += ["--tests", args.tests] if args.tests else []
    start, cached = time.time(), triton_cache_entries()
    child = subprocess.Popen(argv, cwd=ROOT, start_new_session=True)  # its own group: stopped with its children
    stopped, first_row = False, None
    while True:
        running = child.poll() is None
        if running and time.time() - start > limit:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            stopped, running = True, False
        text = _read(path)
        if first_row is None and first_row_line(text) is not None:
            first_row = time.time() - start
        if not running:
            break
        report.sections[part] = (title, text)
        report.write()
        time.sleep(1)
    if stopped:
        outcome, on_gpu = f"stopped at its time limit ({limit:.0f} s)", []
    elif os.path.exists(path + ".json"):
        with open(path + ".json") as f:
            result = json.load(f)
        outcome, on_gpu = result["outcome"], result["on_gpu"]
    else:
        outcome, on_gpu = f"FAILED (the part's process exited with status {child.returncode})", []
    seconds = time.time() - start
    first = f"first row after {first_row:.0f} s" if first_row is not None else "no row"
    compiled = ("" if cached is None else
                f" Triton's cache: {triton_cache_entries() - cached} kernels compiled in this part, "
                f"{triton_cache_entries()} in all.")
    report.sections[part] = (title, text.rstrip() + f"\n\n{outcome}, {seconds:.0f} s ({first}).{compiled}")
    report.outcomes[part] = f"{outcome} ({seconds:.0f} s; {first})"
    report.on_gpu += on_gpu
    report.write()
    print(f"[gpu check] {part}: {outcome} ({seconds:.0f} s; {first})", flush=True)
    return outcome


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=30, help="updates of each half-precision training")
    parser.add_argument("--train-step-rows", default=TRAIN_STEP_ROWS,
                        help="'all', or comma-separated rows of examples/speed/train_step.py, for the train-step part")
    parser.add_argument("--row-limit", type=float, default=40, help="seconds per row of the train-step part")
    parser.add_argument("--tests", help="comma-separated test files for the tests part (default: every file with "
                                        "GPU tests)")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset to run, in this order")
    parser.add_argument("--report-dir", default=os.path.join(ROOT, "docs"))
    parser.add_argument("--report-name", default=None, help="default: gpu_check_<date>[_dry_run].md")
    parser.add_argument("--deadline", type=float, default=None, help="Unix time by which every part has ended")
    parser.add_argument("--started", type=float, default=None, help="Unix time at which gpu_check.sh started")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiplies every part's time limit and --row-limit (a dry run on a small CPU machine "
                             "needs more)")
    parser.add_argument("--child", choices=list(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--section", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_child(args)
    args.row_limit *= args.time_scale
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    name = args.report_name or f"gpu_check_{datetime.date.today().isoformat()}{'' if cuda() else '_dry_run'}.md"
    paths = [os.path.join(args.report_dir, name)] + ([os.path.join(os.environ["OUT"], name)]
                                                      if os.environ.get("OUT") else [])
    report = Report(paths)
    start = time.time()
    if args.started:
        report.header.append(f"- install: {start - args.started:.0f} s (gpu_check.sh, before the first part)")
    report.write()
    deadline = args.deadline or math.inf
    outcomes = []
    warm = start_warm_up(parts, args)
    with tempfile.TemporaryDirectory() as tmp:
        for part in parts:
            if part in ("train-step", "profile") and warm is not None:
                report.outcomes["warm-up"] = finish_warm_up(warm, deadline)
                report.write()
                warm = None
            limit = min(LIMITS[part] * args.time_scale, deadline - time.time() - 5)
            if limit < 10:
                report.outcomes[part] = "not run: no time left before the deadline"
                report.write()
                continue
            outcomes.append(run_part(part, limit, report, args, tmp))
    if warm is not None:
        warm[0].kill()
    report.outcomes["all parts"] = f"{time.time() - start:.0f} s" + (
        f"; the whole check {time.time() - args.started:.0f} s" if args.started else "")
    report.write()
    print(f"[gpu check] report: {paths[0]}")
    return 1 if any(o.startswith("FAILED") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
