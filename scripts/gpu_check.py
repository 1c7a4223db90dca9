"""The GPU check: the first evidence that the GPU paths work, and what must pass before `auto` may
choose the csrc `cuda` backend.

    bash scripts/gpu_check.sh [--parts P,...]    # on the GPU machine: installs the carried wheels, then runs this
    python scripts/gpu_check.py [--parts P,...]  # where everything is installed already

Parts, in this order (PARTS); each runs in a child process under its own time limit (shortened to end
before --deadline), within which it ends from a cold machine (an empty Triton cache) once fla's autotune
winners are recorded for the GPU (scripts/gpu_check_plan.py plans each part's compiles and time):
- compile: the calls that the other parts of this call make into fla (scripts/gpu_check_calls.json, which
  the plan writes), replayed on the GPU by several processes at once, so that Triton compiles and autotunes
  them into the one Triton cache (TRITON_CACHE_DIR, which gpu_check.sh sets) that the parts after it find;
- tests: the GPU tests (named test_gpu_*: every test that needs CUDA) of the files that have them (or of
  --tests), the GPU cases of tests/gpu_check_cases.py (--all-cases: every one); each outcome, and each failure
  with its message, goes into the report as pytest reports it (gpu_check_plugin.py). The CPU tests are CI's;
- training: fairseq-train of the tiny translation and language models (the delta rule, 4 heads of 16: their
  kernels share their autotune keys), --updates updates each of TRAININGS (--fp16, --bf16 and --amp; each
  launcher), loss finite and falling; the translation model is launched as the console script fairseq-train,
  the language model as `python -m fairseq_cli.train`;
- train-step: examples/speed/train_step.py, training steps of a GPT-2-small-sized LM, fairseq's own
  transformer_lm against the fwp rows of --train-step-rows;
- profile: one training step of PROFILE_ROWS at T = 2048 under torch.profiler (train_step.py --profile);
- first-step: the first training step of FIRST_STEP's row in a fresh Triton cache, with the autotune winners
  recorded for this GPU, and without them (FLA_CACHE_MODE=disabled: begun after compile, beside the parts
  before it);
- benchmark: one decoder layer's decoding step (examples/speed/layer_step.py --device cuda: the fused step's
  CUDA kernel and each rule's own step against softmax attention's), printed as it runs;
- op-benchmark (only where --parts names it: not part of the whole check, for its cold autotuning):
  examples/speed/op_benchmark.py --device cuda --quick.
Every part reports when it wrote its first row, and how many kernels Triton compiled in it. After each part,
the autotune results in Triton's cache (fla passes cache_results) are recorded as fla's autotune winners for
this GPU into fairseq_fwp/ops/fla_configs/ (fla_configs.record), which the next machine starts from.

The report (docs/gpu_check_report.md, on a GPU) keeps each part's last result until the files it checks
change (gpu_check_report.py); it, its results and the GPU's recorded winners are copied into $OUT, under
their paths in the repository, when $OUT is set. Without CUDA (a dry run, e.g. scripts/gpu_rehearsal.sh)
the GPU tests skip, train-step and profile run their tiny shape on the CPU, compile, first-step and the
benchmark skip, and the trainings use --bf16 on the CPU.
"""
import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

import torch  # noqa: E402

import gpu_check_calls  # noqa: E402
import gpu_check_report  # noqa: E402

PRECISIONS = ("--fp16", "--bf16", "--amp")
TRANSLATION, LM = "translation (linear, delta)", "language model (linear, delta)"
# (model, precision): each precision, each launcher (a bfloat16 run of each, the ones a CPU runs)
TRAININGS = ((TRANSLATION, "--fp16"), (TRANSLATION, "--bf16"), (LM, "--bf16"), (LM, "--amp"))
TRAIN_STEP_ROWS = "fairseq-softmax,linear-delta,gated-deltanet"  # or "all": a row is a process, about 10 s
TRAIN_STEP_STEPS = 3  # timed steps a row, after its first
PROFILE_ROWS = ("fairseq-softmax", "linear-delta")  # the profile part: one step of each at T = 2048
FIRST_STEP = ("linear-delta", 2048)  # the first-step part's row (one layer: the same attention) and length
CALLS = os.path.join(ROOT, "scripts", "gpu_check_calls.json")  # the plan's calls into fla, by part
COMMON_SOURCES = ("fairseq_fwp/**/*.py", "csrc/**/*", "scripts/gpu_check*.py", "scripts/gpu_check*.sh",
                  "requirements.txt")
TRAIN_STEP_SOURCES = ("examples/speed/train_step.py", "examples/recipes/decoding_cost.py")
TEST_SOURCES = ("tests/conftest.py", "tests/helpers.py", "tests/cuda_stand_in.py", "tests/gpu_check_cases.py")


def cuda():
    return torch.cuda.is_available()


def versions_of_this_call():
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
    selection = "all" if args.all_cases else "check"
    header = (f"The GPU tests (`pytest -m gpu`: the tests named test_gpu_*, marked gpu by tests/conftest.py) of "
              f"{', '.join(files)}; they skip without CUDA. "
              + ("Every GPU case. " if args.all_cases else "The GPU cases of tests/gpu_check_cases.py (its shapes "
                 "and dtypes in the files whose GPU tests reach fla's kernels). ") + "Outcomes as pytest reports them.")
    argv = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "gpu_check_plugin", "-p", "no:cacheprovider",
            *files]
    try:
        import xdist  # noqa: F401  (in the GPU image: Triton compiles one kernel at a time per process: as many
        # workers as cores, 12 at most, share the GPU)
        argv += ["-n", str(min(12, os.cpu_count() or 1))]
    except ImportError:
        pass
    env = dict(os.environ, GPU_CHECK_SECTION=section.path, GPU_CHECK_HEADER=header, GPU_CHECK_SELECTION=selection,
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


# -- compiling fla's kernels before the parts that run them --------------------------


def part_compile(section, args):
    """The distinct calls into fla of the parts of this call (of every part, where compile runs alone), replayed on
    the GPU by as many processes as cores (16 at most), each autotuning its shard of every kernel's configs
    (gpu_check_calls.sharded_autotuning): Triton's compiles spread over the cores, where one process would
    compile one config after another."""
    if not cuda():
        section.add("skipped: needs CUDA")
        return None, []
    with open(CALLS) as f:
        planned = json.load(f)
    parts = ",".join([p for p in args.parts.split(",") if p in planned] or list(planned))
    calls = gpu_check_calls.distinct({part: planned[part] for part in parts.split(",")})
    processes = min(16, os.cpu_count() or 1)
    section.add(f"{len(calls)} distinct calls into fla of {parts.replace(',', ', ')} (scripts/gpu_check_calls.json), "
                f"each replayed by {processes} processes at once, each autotuning its shard of every kernel's configs; "
                f"the plan counted {sum(c['compiles'] for c in calls)} kernels compiled cold (the calls one by one), "
                "one config per kernel and key where the check recorded the winners.\n")
    section.add("| process | seconds |")
    section.add("|---|---|")
    start, children = time.time(), []
    for process in range(processes):
        argv = [sys.executable, os.path.join(ROOT, "scripts", "gpu_check_calls.py"), CALLS, parts,
                f"{process}/{processes}"]
        errors = tempfile.TemporaryFile("w+")  # a file, not a pipe: 16 children's warnings would fill pipes
        children.append((subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=errors), errors))
    ok = True
    for process, (child, errors) in enumerate(children):
        child.wait()
        errors.seek(0)
        tail = " ".join(errors.read().strip().splitlines()[-2:])[:300]
        ok &= child.returncode == 0
        section.add(f"| {process} | {time.time() - start:.0f} |" if child.returncode == 0 else
                    f"| {process} | FAILED: {tail} |")
    return ok, [f"fla's kernels of {len(calls)} calls compiled and autotuned"] if ok else []


# -- the training-step and op benchmarks ----------------------------------------------


def train_step_argv(rows, *options):
    return [sys.executable, os.path.join(ROOT, "examples", "speed", "train_step.py"), *(
        [] if rows == "all" else ["--rows", *rows.split(",")]), *options]


def part_train_step(section, args):
    argv = train_step_argv(args.train_step_rows, "--steps", str(TRAIN_STEP_STEPS), "--row-limit", str(args.row_limit))
    if not cuda():
        argv += ["--tiny", "--device", "cpu"]
    code = stream(section, argv)
    rows = [line for line in section.lines if line.startswith("| ") and "tokens/s" not in line]
    ran = [row for row in rows if re.match(r"\| \d+ \| \S+ \| [\d,]+ \|", row)]
    on_gpu = [f"the training-step benchmark above ({len(ran)} rows)"] if cuda() and ran else []
    return code == 0 and len(ran) == len(rows), on_gpu


def part_profile(section, args):
    """One training step of each of PROFILE_ROWS at T = 2048 under torch.profiler: the ops that took the most
    GPU time (train_step.py --profile)."""
    argv = train_step_argv(",".join(PROFILE_ROWS), "--steps", "2", "--profile", "25", "--row-limit",
                           str(args.row_limit))
    argv += ["--lengths", "2048"] if cuda() else ["--tiny", "--device", "cpu", "--lengths", "64"]
    code = stream(section, argv)
    profiled = sum(line.startswith("### Profile") for line in section.lines)
    on_gpu = [f"the profile above ({profiled} rows)"] if cuda() and profiled else []
    return code == 0 and profiled == len(PROFILE_ROWS), on_gpu


def first_step_argv():
    row, length = FIRST_STEP
    return [*train_step_argv(row)[:2], "--case", json.dumps([row, "gpt2-small", [length], 0, "cuda", 0, True])]


def start_first_step_without(tmp):
    """first-step's run without the recorded winners (FLA_CACHE_MODE=disabled, which fla_configs leaves to fla:
    it autotunes every kernel) in a fresh Triton cache, begun after the compile part: it compiles beside the
    parts before first-step. Returns its process, output file and Triton cache."""
    cache, output = os.path.join(tmp, "first-step-without-cache"), os.path.join(tmp, "first-step-without.out")
    env = dict(os.environ, TRITON_CACHE_DIR=cache, FLA_CACHE_MODE="disabled")
    with open(output, "w") as f:
        process = subprocess.Popen(first_step_argv(), cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    return process, output, cache


def part_first_step(section, args):
    """FIRST_STEP's row, its first training step (one layer: the rows' attention kernels) in a fresh Triton cache:
    with the winners recorded for this GPU (run here), and without them (start_first_step_without)."""
    if not cuda():
        section.add("skipped: needs CUDA")
        return None, []
    row, length = FIRST_STEP
    section.add(f"The first training step of {row} (GPT-2 small's attention, one layer, T = {length}, bf16 autocast) "
                "in a fresh Triton cache. Without the winners, the run began after the compile part, beside the "
                "parts before this one (on a busy machine).\n")
    section.add("| autotune winners | first step (s) | kernels compiled | auto runs |")
    section.add("|---|---|---|---|")
    ok = True
    with tempfile.TemporaryDirectory() as cache:
        child = subprocess.run(first_step_argv(), cwd=ROOT, env=dict(os.environ, TRITON_CACHE_DIR=cache),
                               capture_output=True, text=True)
        runs = [("recorded for this GPU", child.stdout + child.stderr, cache)]
        output, without_cache = (args.first_step_without or os.pathsep).split(os.pathsep)
        runs.append(("none (FLA_CACHE_MODE=disabled)", _read(output) or "not run", without_cache))
        for name, out, folder in runs:
            result = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            compiled = len(os.listdir(folder)) if os.path.isdir(folder) else 0
            if not result:
                ok = False
                section.add(f"| {name} | FAILED: {' '.join(out.strip().splitlines()[-2:])[:300]} | {compiled} | |")
            else:
                section.add(f"| {name} | {result[0]['first_step_s']:.1f} | {compiled} | "
                            f"{', '.join(result[0]['backends'])} |")
    return ok, [f"the first training step of {row}, with and without recorded autotune winners"] if ok else []


def part_benchmark(section, args):
    """A decoding step, fused (the extension's CUDA kernel) and each rule's own, against softmax attention's."""
    if not cuda():
        section.add("skipped: needs CUDA")
        return None, []
    code = stream(section, [sys.executable, os.path.join(ROOT, "examples", "speed", "layer_step.py"), "--device",
                            "cuda"])
    return code == 0, ["the decoding step above"] * (code == 0)


def part_op_benchmark(section, args):
    """examples/speed/op_benchmark.py --device cuda --quick: fla's, the csrc kernels' and chunked's ops against
    flash SDPA (its fla rows autotune heads of 64 and of 256 that no other part runs: 500 kernels cold)."""
    if not cuda():
        section.add("skipped: needs CUDA")
        return None, []
    code = stream(section, [sys.executable, os.path.join(ROOT, "examples", "speed", "op_benchmark.py"), "--device",
                            "cuda", "--quick"])
    return code == 0, ["the op benchmark above"] * (code == 0)


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


def training_models(work, updates):
    """The trainings' corpora, written and preprocessed under `work`; returns {model: (launcher, train(save_dir,
    *flags) -> fairseq-train's log)}: the translation model through the console script, the LM as a module."""
    from examples.recipes.synthetic_data import write_corpora
    from examples.recipes.pipeline import preprocess_lm, preprocess_translation, train_lm, train_translation

    mt_raw, lm_raw = write_corpora(os.path.join(work, "raw"), n_train=2000, n_eval=100)
    mt_bin, lm_bin = os.path.join(work, "bin-mt"), os.path.join(work, "bin-lm")
    preprocess_translation(mt_raw, mt_bin)
    preprocess_lm(lm_raw, lm_bin)
    # Both with the delta rule and the LM's heads (4 of 16): their fla kernels share their autotune keys.
    # --no-save: nothing here reads a checkpoint.
    return {TRANSLATION: ("fairseq-train", lambda save, *flags: train_translation(
                mt_bin, save, "--fwp-update-rule", "delta", "--no-save", *flags, max_update=updates, lr=0.002,
                warmup=10)),
            LM: ("python -m fairseq_cli.train", lambda save, *flags: train_lm(
                lm_bin, save, "--no-save", *flags, max_update=updates, as_module=True))}


def part_training(section, args):
    """Tiny translation and LM models, `updates` updates per precision; loss finite and falling."""
    from fairseq_fwp.ops.backends import resolved_name

    work = tempfile.mkdtemp(prefix="gpu_check_")
    models = training_models(work, args.updates)
    half = {"--fp16": torch.float16, "--bf16": torch.bfloat16, "--amp": torch.float16}
    section.add(f"{args.updates} updates each, `--fwp-backend auto`, the delta rule, 4 heads of 16. The "
                "first update (from the start of training, whole seconds) pays for Triton's compile and autotune.\n")
    section.add("| model | launched as | precision | auto runs | first 10 losses (mean) | last 10 (mean) | "
                "finite, falling | first update (s) | later updates (ms) | time |")
    section.add("|---|---|---|---|---|---|---|---|---|---|")
    ok, on_gpu = True, []
    for name, precision in TRAININGS:
        launcher, train = models[name]
        if not cuda() and precision != "--bf16":
            section.add(f"| {name} | {launcher} | {precision} | | | | skipped: needs CUDA | | | |")
            continue
        device = "cuda" if cuda() else "cpu"
        backend = resolved_name("auto", torch.zeros(1, 1, 2, 16, device=device, dtype=half[precision]), 16,
                                rule="delta")
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


@dataclasses.dataclass(frozen=True)
class Part:
    title: str
    run: object  # (section, args) -> (True, False or None for skipped; what finished on the GPU)
    limit: float  # seconds on a GPU machine, from a cold one (scripts/gpu_check_plan.py plans them)
    sources: tuple  # the files whose change can change its outcome (globs from the repository's root)


PARTS = {
    "compile": Part("fla's kernels, compiled and autotuned before the parts", part_compile, 260,
                    COMMON_SOURCES + ("scripts/gpu_check_calls.json",)),
    "tests": Part("GPU tests", part_tests, 110, COMMON_SOURCES + TEST_SOURCES + ("tests/test_*.py",)),
    "training": Part("fairseq-train in half precision", part_training, 110,
                     COMMON_SOURCES + ("examples/recipes/*.py",)),
    "train-step": Part("Training steps, GPT-2 small", part_train_step, 100, COMMON_SOURCES + TRAIN_STEP_SOURCES),
    "profile": Part("Profile of one training step, T = 2048", part_profile, 55, COMMON_SOURCES + TRAIN_STEP_SOURCES),
    "first-step": Part("The first training step, with recorded autotune winners and without", part_first_step, 160,
                       COMMON_SOURCES + TRAIN_STEP_SOURCES),
    "benchmark": Part("Decoding step benchmark", part_benchmark, 40, COMMON_SOURCES + (
        "examples/speed/layer_step.py", "examples/speed/beam_search.py", "examples/recipes/decoding_cost.py")),
    "op-benchmark": Part("Op benchmark", part_op_benchmark, 90, COMMON_SOURCES + ("examples/speed/op_benchmark.py",)),
}
DEFAULT_PARTS = [part for part in PARTS if part != "op-benchmark"]  # the whole check (op-benchmark: --parts)
OUTCOMES = {True: "passed", False: "FAILED", None: "skipped"}


def run_child(args):
    """One part, in this (child) process: its text into --section, its outcome into --section.json."""
    section = Section(args.section)
    ok, on_gpu = PARTS[args.child].run(section, args)
    with open(args.section + ".json", "w") as f:
        json.dump({"outcome": OUTCOMES[ok], "on_gpu": on_gpu}, f)


# -- the parent: parts under time limits, the report, the autotune winners ----------------


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


def record_winners(out):
    """Triton's autotune results so far, as fla's autotune winners for this GPU (fairseq_fwp/ops/fla_configs),
    copied under `out` (None: nowhere) at their path in the repository; returns a line for the report, or
    None (no GPU, or no Triton cache)."""
    folder = os.environ.get("TRITON_CACHE_DIR")
    if not cuda() or not folder:
        return None
    import fla
    import triton

    from fairseq_fwp.ops import fla_configs

    versions = {"fla": fla.__version__, "triton": triton.__version__, "date": datetime.date.today().isoformat(),
                "commit": dict(versions_of_this_call())["commit"]}
    recorded, new = fla_configs.record(folder, torch.cuda.get_device_name(), torch.cuda.get_device_capability(),
                                       versions)
    if out:
        target = os.path.join(out, os.path.relpath(recorded, ROOT))
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(recorded, target)
    kept = sum(len(entries) for entries in fla_configs.load(recorded).values())
    return f"fla's autotune winners for this GPU: {kept} keys in {os.path.relpath(recorded, ROOT)} ({new} new)"


def run_part(part, limit, report, args, tmp):
    """Runs `part` in a child process for at most `limit` seconds; returns its outcome."""
    title = PARTS[part].title
    path = os.path.join(tmp, part + ".md")
    argv = [sys.executable, os.path.abspath(__file__), "--child", part, "--section", path, "--updates",
            str(args.updates), "--train-step-rows", args.train_step_rows, "--row-limit", str(args.row_limit),
            "--parts", args.parts] + (["--all-cases"] if args.all_cases else [])
    argv += ["--first-step-without", args.first_step_without] if args.first_step_without else []
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
        report.show_running(part, title, text)
        try:
            child.wait(timeout=1)  # back at once when the part ends
        except subprocess.TimeoutExpired:
            pass
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
    winners = record_winners(os.environ.get("OUT"))
    about = dict(versions_of_this_call())
    report.finish(part, gpu_check_report.PartResult(
        title=title, outcome=outcome, summary=f"{outcome} ({seconds:.0f} s; {first})",
        text=text.rstrip() + f"\n\n{outcome}, {seconds:.0f} s ({first}).{compiled}" + (
            f" {winners}." if winners else ""),
        on_gpu=on_gpu, date=about["date"], commit=about["commit"], device=about["device"],
        digest=gpu_check_report.digest(PARTS[part].sources, ROOT)))
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
    parser.add_argument("--all-cases", action="store_true",
                        help="the tests part runs every GPU case, not only those of tests/gpu_check_cases.py")
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                        help=f"comma-separated parts to run, in this order (of {', '.join(PARTS)})")
    parser.add_argument("--report-dir", default=os.path.join(ROOT, "docs"))
    parser.add_argument("--report-name", default=None, help="default: gpu_check_report.md, on the CPU "
                                                            "gpu_check_dry_run.md (its results beside it, .json)")
    parser.add_argument("--deadline", type=float, default=None, help="Unix time by which every part has ended")
    parser.add_argument("--started", type=float, default=None, help="Unix time at which gpu_check.sh started")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiplies every part's time limit and --row-limit (a dry run on a small CPU machine "
                             "needs more)")
    parser.add_argument("--child", choices=list(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--first-step-without", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_child(args)
    args.row_limit *= args.time_scale
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    name = args.report_name or ("gpu_check_report.md" if cuda() else "gpu_check_dry_run.md")
    path = os.path.join(args.report_dir, name)
    copies = [os.path.join(os.environ["OUT"], os.path.relpath(path, ROOT))] if os.environ.get("OUT") else []
    start = time.time()
    header = ["Command: `bash scripts/gpu_check.sh` (docs/gpu_check.md). The last call:", "",
              *(f"- {key}: {value}" for key, value in versions_of_this_call())]
    if args.started:
        header.append(f"- install: {start - args.started:.0f} s (gpu_check.sh, before the first part)")
    header.append(f"- parts run in it: {', '.join(parts)}")
    report = gpu_check_report.Report(path, header, PARTS, {p: gpu_check_report.digest(PARTS[p].sources, ROOT)
                                                           for p in PARTS}, copies)
    report.write()
    deadline = args.deadline or math.inf
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        without = None
        for part in parts:
            if without is None and cuda() and "first-step" in parts and part != "compile":
                without = start_first_step_without(tmp)  # after compile, whose processes take every core
            left = deadline - time.time() - 5
            if left < 10:
                print(f"[gpu check] {part}: not run: no time left before the deadline", flush=True)
                report.header.append(f"- {part}: not run in it, no time left before its deadline")
                continue
            limit = min(PARTS[part].limit * args.time_scale, left)
            if part == "first-step" and without is not None:
                waited = time.time()
                try:  # the run without the winners, begun with the check, within this part's limit
                    without[0].wait(timeout=max(1.0, limit - 60))
                except subprocess.TimeoutExpired:
                    without[0].kill()
                limit -= time.time() - waited
                args.first_step_without = os.pathsep.join(without[1:])
            outcomes.append(run_part(part, limit, report, args, tmp))
        if without is not None and without[0].poll() is None:
            without[0].kill()
    report.header.append(f"- all parts: {time.time() - start:.0f} s" + (
        f"; the whole call {time.time() - args.started:.0f} s" if args.started else ""))
    report.write()
    print(f"[gpu check] report: {path}")
    return 1 if any(o.startswith("FAILED") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
