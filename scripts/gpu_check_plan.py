"""The GPU check's plan, made on the CPU: the Triton kernels each part will compile on a cold GPU machine,
and how long that takes there.

    python scripts/gpu_check_plan.py [--gpu "NVIDIA H200"] [--parts tests,training,...] [--calls FILE]

Triton compiles a kernel once for each specialization of its arguments (their dtypes, which integers are 1
or multiples of 16, which pointers are 16-byte aligned, its constexprs) and launch options. An autotuned
kernel, the first time it sees a key (its `key` arguments and every tensor's dtype), compiles and times
every config of its list that its pruning keeps, then runs the fastest; fla's config lists are picked at
import from the device (shared memory, Hopper or not). A key recorded in fairseq_fwp/ops/fla_configs/ for
the GPU compiles only its recorded config.

How it is counted: this process pretends to be the GPU machine before fla is imported (Triton's active
driver, torch.cuda's device queries, Triton's version as the GPU image has it); each part's own code runs on
the CPU with `auto` choosing fla where it would on that GPU, each rule's chunked kernel computing the values;
and each distinct call that reaches fla is replayed once through fla's own kernels under Triton's
interpreter, where a launch is recorded instead of run. --calls writes those calls (scripts/gpu_check.py's
autotune part replays them on the GPU).

Time on the GPU machine: SECONDS_PER_COMPILE a compiled kernel in one process (2026-11-28, H200: the
half-precision trainings, one process, 101 kernels in 124 s), MACHINE_COMPILES_PER_SECOND with every core
compiling (the tests part's 12 workers with the warm-up's 5 processes beside them: 738 kernels in 130 s),
plus each part's own work (FIXED_SECONDS).
"""
import argparse
import collections
import contextlib
import dataclasses
import os
import re
import sys
from unittest.mock import patch

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: fla's kernels become Python functions
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "tests")]

import torch  # noqa: E402

SECONDS_PER_COMPILE = 124 / 101
MACHINE_COMPILES_PER_SECOND = 738 / 130
# The GPU machines the check meets: (name as torch says it, capability, opt-in shared memory per block, SMs).
GPUS = {"NVIDIA H200": ((9, 0), 232448, 132), "NVIDIA H100 80GB HBM3": ((9, 0), 232448, 132)}
IMAGE_TRITON = "3.6.0"  # the GPU image's Triton (fla picks kernels and guards by its version)


# -- the GPU machine, as fla sees it -----------------------------------------------------------------------


def pretend_gpu(name, triton_version=IMAGE_TRITON):
    """From now on in this process, Triton's active driver and torch.cuda's device queries answer as on GPU
    `name` (a key of GPUS), and triton.__version__ is the image's; call it before fla is imported."""
    import triton
    from triton.backends.compiler import GPUTarget

    capability, shared_memory, sms = GPUS[name]

    class Utils:
        def get_device_properties(self, device):
            return {"max_shared_mem": shared_memory, "multiprocessor_count": sms, "max_num_regs": 65536,
                    "warpSize": 32}

    class Driver:
        utils = Utils()

        def get_current_target(self):
            return GPUTarget("cuda", capability[0] * 10 + capability[1], 32)

        def get_current_device(self):
            return 0

    triton.runtime.driver.set_active(Driver())
    torch.cuda.get_device_name = lambda *args: name
    torch.cuda.get_device_capability = lambda *args: capability
    torch.cuda.device_count = lambda: 1
    triton.__version__ = triton_version


# -- what Triton compiles ------------------------------------------------------------------------------------


def _specialization(value, specialize=True):
    """How Triton 3 specializes an argument: a tensor by dtype and 16-byte alignment, an integer by its width
    and whether it is 1 (then a constant) or a multiple of 16, None and constexprs by value."""
    if value is None or isinstance(value, (str, type)):
        return value
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        width = "i32" if -2**31 <= value < 2**31 else "i64"
        if not specialize:
            return width
        return 1 if value == 1 else width + ("D" if value % 16 == 0 else "")
    if isinstance(value, float):
        return "fp32"
    if hasattr(value, "data_ptr"):
        return f"*{value.dtype}" + ("D" if value.data_ptr() % 16 == 0 else "")
    if isinstance(value, (tuple, list)):
        return tuple(_specialization(v, specialize) for v in value)
    return repr(value)


OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _compiled_variant(function, args, kwargs):
    """What identifies one compiled kernel: the function, its arguments' specializations, the constexprs
    and the launch options."""
    import inspect

    import triton.language as tl

    parameters = inspect.signature(function.fn).parameters
    bound = dict(zip(function.arg_names, args), **{k: v for k, v in kwargs.items() if k in parameters})
    unspecialized = set(function.kwargs.get("do_not_specialize") or ())
    key = []
    for name, parameter in parameters.items():
        value = bound.get(name, parameter.default)
        constexpr = parameter.annotation is tl.constexpr or parameter.annotation == "tl.constexpr"
        key.append(value if constexpr else _specialization(value, name not in unspecialized))
    options = tuple(kwargs.get(option) for option in OPTIONS)
    return function.fn.__qualname__, function.fn.__module__, tuple(map(repr, key)), options


class Ledger:
    """Every kernel launch under Triton's interpreter, recorded instead of run: the kernels it compiles cold,
    and with the recorded configs of `recorded` ((kernel name, key) pairs)."""

    def __init__(self, recorded=frozenset()):
        self.recorded = recorded
        self.cold, self.warm = set(), set()  # compiled kernels: cold, and with the recorded configs
        self.keys = collections.defaultdict(set)  # kernel name -> the keys it is autotuned for
        self._into = (self.cold, self.warm)

    @contextlib.contextmanager
    def recording(self):
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.interpreter import InterpretedFunction

        ledger = self

        def autotuned_run(tuner, *args, **kwargs):
            tuner.nargs = dict(zip(tuner.arg_names, args))
            named = {k: v for k, v in {**tuner.nargs, **kwargs}.items() if k in tuner.arg_names}
            key = tuple([named[k] for k in tuner.keys if k in named] +
                        [str(v.dtype) for v in named.values() if hasattr(v, "dtype")])
            configs = tuner.prune_configs(kwargs) if len(tuner.configs) > 1 else tuner.configs
            name = tuner.base_fn.__name__
            first = key not in ledger.keys[name]
            ledger.keys[name].add(key)
            recorded = (name, key) in ledger.recorded
            # every config the first time a key is seen, the winner (any one, for the count) after it; with a
            # recorded config, only that one
            ledger._into = (ledger.cold,) if recorded else (ledger.cold, ledger.warm)
            for config in configs if first else configs[:1]:
                tuner.fn.run(*args, **kwargs, **config.all_kwargs())
            if recorded:
                ledger._into = (ledger.warm,)
                tuner.fn.run(*args, **kwargs, **configs[0].all_kwargs())
            ledger._into = (ledger.cold, ledger.warm)
            tuner.nargs = None

        def launch(function, *args, grid, warmup, **kwargs):
            variant = _compiled_variant(function, args, kwargs)
            for compiled in ledger._into:
                compiled.add(variant)

        with patch.object(Autotuner, "run", autotuned_run), patch.object(InterpretedFunction, "run", launch):
            yield self

    def kernels(self):
        """[(kernel, keys it is autotuned for, compiled cold, compiled with the recorded configs)], costliest
        first."""
        cold, warm = collections.Counter(v[0] for v in self.cold), collections.Counter(v[0] for v in self.warm)
        return sorted(((name, len(self.keys.get(name, ())), cold[name], warm[name]) for name in cold),
                      key=lambda row: (-row[2], row[0]))


# -- the calls that reach fla ---------------------------------------------------------------------------------


class FlaRouting:
    """While open: `auto` chooses fla for CPU tensors wherever it would on the GPU (fla's own refusals stand,
    asked as for a CUDA call), each rule's fla kernel records its calls and computes them by the rule's
    chunked kernel, and each new call is replayed once through fla's own kernel (under the ledger).
    batch: the batch the replays have (a part that runs its model at batch 1 here to save time); values:
    False where no call's values matter (a training step: zeros, with gradients to every input);
    bfloat16_as: the dtype the replays have where the call has bfloat16 (a part run in bfloat16 here, in
    float16 on the GPU)."""

    def __init__(self, ledger):
        from fairseq_fwp.ops.rules import UPDATE_RULES

        self.ledger, self.batch, self.values, self.bfloat16_as = ledger, None, True, None
        self.calls = {}  # part -> [gpu_check_calls.FlaCall], distinct, in order
        self.part = None
        # each rule's own fla kernel (the CPU's stand-in of CUDA swaps them while it is open)
        self.kernels = {rule: rule.kernels["fla"] for rule in UPDATE_RULES.values() if "fla" in rule.kernels}

    def record(self, form, kernel, call, tensors):
        from gpu_check_calls import FlaCall

        fla_call = FlaCall.of(form, call, tensors)
        if self.batch is not None:
            fla_call = fla_call.with_batch(self.batch)
        if self.bfloat16_as is not None:
            fla_call = fla_call.with_dtype("bfloat16", self.bfloat16_as)
        calls = self.calls.setdefault(self.part, [])
        if fla_call not in calls:
            calls.append(fla_call)
            if self.part == "probe":  # only whether fla is reached (train_step_rows)
                return
            with torch.enable_grad(), self.ledger.recording():
                fla_call.replay(kernel, "cpu")

    @contextlib.contextmanager
    def open(self):
        from cuda_stand_in import fla_computed_by_chunked

        from fairseq_fwp.ops import backends, fla
        from fairseq_fwp.ops.protocol import Backend, Kernel

        def as_on_the_gpu(call):
            return fla.unfit_reason(dataclasses.replace(call, device=torch.device("cuda")))

        def recording(kernel, computed):
            def sequence(call, q, k, v, beta, state, log_decay):
                self.record("sequence", kernel, call, (q, k, v, beta, state, log_decay))
                return computed.sequence(call, q, k, v, beta, state, log_decay)

            def final_state(call, k, v, beta, state, log_decay):
                self.record("final_state", kernel, call, (k, k, v, beta, state, log_decay))
                return computed.final_state(call, k, v, beta, state, log_decay)

            def step_(call, memory, q, k, v, beta, log_decay):
                self.record("step", kernel, call, (q, k, v, beta, None, log_decay))
                return computed.step_(call, memory, q, k, v, beta, log_decay)

            return Kernel(sequence, final_state, step_, kernel.unfit_reason)

        saved = {rule: rule.kernels["fla"] for rule in self.kernels}
        saved_auto, saved_backend = backends.AUTO, backends.REGISTRY["fla"]
        backends.AUTO = tuple((name, None if name == "fla" else device) for name, device in backends.AUTO)
        backends.REGISTRY["fla"] = Backend("fla", saved_backend.reads_half_types, as_on_the_gpu)
        for rule, kernel in self.kernels.items():
            computed = fla_computed_by_chunked(rule.kernels["chunked"], kernel) if self.values else _zeros_kernel()
            rule.kernels["fla"] = recording(kernel, computed)
        try:
            yield self
        finally:
            for rule, kernel in saved.items():
                rule.kernels["fla"] = kernel
            backends.AUTO, backends.REGISTRY["fla"] = saved_auto, saved_backend


def _zeros_like_fla(call, q, k, v, *inputs):
    """fla's outputs (out in q's dtype, W in the accumulation dtype) as zeros that depend on every input:
    gradients reach them as fla's would."""
    anchor = sum(x.float().sum() for x in (q, k, v, *inputs) if x is not None and x.is_floating_point()) * 0
    out = q.new_zeros(*q.shape[:-1], v.shape[-1]) + anchor.to(q.dtype)
    W = q.new_zeros(*q.shape[:2], v.shape[-1], k.shape[-1], dtype=call.accumulation_dtype) + anchor
    return out, W


def _zeros_kernel():
    from fairseq_fwp.ops.protocol import Kernel

    return Kernel(lambda call, q, k, v, beta, state, log_decay: _zeros_like_fla(call, q, k, v, beta, state, log_decay),
                  lambda call, k, v, beta, state, log_decay: _zeros_like_fla(call, k, k, v, beta, state, log_decay)[1],
                  lambda call, memory, q, k, v, beta, log_decay: _zeros_like_fla(call, q, k, v, beta, log_decay)[0])


# -- each part's calls, as the part makes them on the GPU ------------------------------------------------------


def train_step_rows(routing, rows, lengths):
    """examples/speed/train_step.py's rows at GPT-2 small, one layer and batch 1 here (the attention sees the
    same shapes; the replays have the row's batch), a step each; a row that does not reach fla at T = 64
    (where auto routes it does not depend on T) is not run at its lengths."""
    from examples.speed import train_step

    _, dim, heads, _, _, _, tokens = train_step.SHAPES["gpt2-small"]
    part = routing.part
    for row in rows:
        for length in (64, *lengths):
            train_step.SHAPES["plan"] = (1, dim, heads, 64, 1000, (length,), length)
            routing.batch, routing.part = tokens // length, part if length in lengths else "probe"
            train_step.run_row(row, "plan", length, 0, torch.device("cpu"), small=True)
            if length not in lengths and not routing.calls.pop("probe", None):
                break
    routing.batch, routing.part = None, part


def gpu_tests(routing, files, selection):
    """The GPU tests' own code (their GPU cases, as the check selects them: scripts/gpu_check_plugin.py),
    run on the CPU's stand-in of CUDA (tests/cuda_stand_in.py), with fla's calls recorded: {test id: kernels
    it adds to what the tests before it compiled}."""
    import pytest
    from cuda_stand_in import cuda_stood_in_for

    added = {}

    class OnTheStandIn:
        @pytest.hookimpl(trylast=True)
        def pytest_collection_modifyitems(self, items):
            for item in items:  # the GPU cases, which conftest.py skips without CUDA
                item.own_markers = [m for m in item.own_markers if m.name != "skip"]

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_protocol(self, item):
            before = len(routing.ledger.cold)
            with pytest.MonkeyPatch.context() as monkeypatch, cuda_stood_in_for(monkeypatch), routing.open():
                yield
            added[item.nodeid] = len(routing.ledger.cold) - before

    env = {"GPU_CHECK_SELECTION": selection}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", "-p", "gpu_check_plugin", "-p", "no:randomly",
                     *files], plugins=[OnTheStandIn()])
    finally:
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
    return added


def _fairseq_in_this_process(run_elsewhere):
    """examples.recipes.commands.fairseq, with fairseq-train run in this process on the CPU (the routing and
    the ledger see its calls); --amp's autocast, CUDA's only, becomes the CPU's in float16."""
    def fairseq(command, *args, **run):
        if command != "train":
            return run_elsewhere(command, *args, **run)
        from fairseq import options
        from fairseq_cli import train

        parser = options.get_training_parser()
        arguments = options.parse_args_and_arch(parser, [*map(str, args), "--cpu"])
        arguments.tpu = False  # fairseq_fwp.compat keeps --bf16 off the TPU in fairseq-train
        cfg = train.convert_namespace_to_omegaconf(arguments)
        amp = lambda enabled=True, **kwargs: torch.autocast("cpu", dtype=torch.float16, enabled=enabled)  # noqa
        with patch.object(torch.cuda.amp, "autocast", amp):
            train.main(cfg)
        return ""

    return fairseq


def trainings(routing, updates):
    """scripts/gpu_check.py's half-precision trainings (TRAININGS), in this process: --bf16
    as it is; --fp16 and --amp, which need CUDA in fairseq, as --bf16 with float16 calls (--fp16 halves the
    model, --amp casts its projections to float16, where --bf16 has bfloat16)."""
    import tempfile

    import gpu_check
    from examples.recipes import pipeline

    work = tempfile.mkdtemp(prefix="gpu_check_plan_")
    with patch.object(pipeline, "fairseq", _fairseq_in_this_process(pipeline.fairseq)):
        models = gpu_check.training_models(work, updates)
        for name, precision in gpu_check.TRAININGS:
            routing.bfloat16_as = None if precision == "--bf16" else "float16"
            models[name][1](os.path.join(work, re.sub(r"\W", "", name + precision)), "--bf16")
    routing.bfloat16_as = None


def decoding_step(routing):
    """The benchmark part: examples/speed/layer_step.py's models (a float32 encoder pass, then decoding steps),
    one run."""
    from examples.speed import layer_step

    layer_step.main(["--runs", "1", "--device", "cpu"])


def op_benchmark(routing):
    """The op-benchmark part: examples/speed/op_benchmark.py --quick's fla rows, forward and backward."""
    from examples.speed import op_benchmark as benchmark

    methods = [method for method in benchmark.GPU_METHODS if method.startswith("fla-")]
    for B, H, D in benchmark.GPU_CONFIGS.values():
        for method in methods:
            inputs = benchmark._inputs(B, H, benchmark.GPU_LENGTHS[0], D, dtype=torch.bfloat16)
            benchmark._forward(method, *inputs).float().sum().backward()
            with torch.no_grad():
                benchmark._forward(method, *inputs)


# -- the plan ----------------------------------------------------------------------------------------------


def part_workloads(updates):
    """{part: what it runs, as a function of the routing}: scripts/gpu_check.py's parts with their defaults."""
    import gpu_check

    first_row, first_length = gpu_check.FIRST_STEP
    return {"tests": lambda routing: gpu_tests(routing, gpu_check.gpu_test_files(), "check"),
            "training": lambda routing: trainings(routing, updates),
            "train-step": lambda routing: train_step_rows(routing, gpu_check.TRAIN_STEP_ROWS.split(","), (2048, 8192)),
            "profile": lambda routing: train_step_rows(routing, gpu_check.PROFILE_ROWS, (2048,)),
            "first-step": lambda routing: train_step_rows(routing, (first_row,), (first_length,)),
            "benchmark": decoding_step, "op-benchmark": op_benchmark}


# Each part's own work on the GPU machine apart from compiling, in seconds: from the 2026-11-28 H200 report
# where it shows it, else estimated. tests: pytest's 12 workers start in about 15 s (estimated), a test takes
# 2.5 s (test_fused_step.py's median; the extension's nvcc build, begun with the install, is done by then),
# about 100 tests on 12 workers;
# training: a fairseq-train process about 10 s (start, data, 30 updates, a validation; estimated), 4 of them,
# 2 preprocessings of 4 s; train-step and profile: a row's process about 10 s (estimated), its steps 0.15-0.7 s
# (the report's rows); first-step: one process; benchmark: the decoding step's rows came after 17 s.
FIXED_SECONDS = {"compile": 15, "tests": 15 + 100 * 2.5 / 12, "training": 4 * 10 + 8,
                 "train-step": 3 * (10 + 2 * 4 * 0.5), "profile": 2 * 12 + 5, "first-step": 12, "benchmark": 20,
                 "op-benchmark": 40}
INSTALL_SECONDS = 49  # the 2026-11-28 call's install, from a cold machine
BUDGET, CALL_LIMIT = 480, 600  # the whole check's plan, and one device call's limit


class _Every(frozenset):
    """Every autotune key, as recorded: what a machine compiles once the check has recorded the winners."""

    def __contains__(self, item):
        return True


def alone(part, compiles):
    """The part's seconds alone on a GPU machine with `compiles` kernels to compile: the tests' workers and the
    machine's other cores compile at MACHINE_COMPILES_PER_SECOND, one process at SECONDS_PER_COMPILE."""
    if part == "tests":
        return FIXED_SECONDS[part] + compiles / MACHINE_COMPILES_PER_SECOND
    return FIXED_SECONDS[part] + compiles * SECONDS_PER_COMPILE


def replayed(calls, recorded, kernels):
    """The ledger of `calls` replayed in a fresh one through kernels ({rule name: its fla kernel})."""
    ledger = Ledger(recorded)
    with torch.enable_grad(), ledger.recording():
        for call in calls:
            call.replay(kernels[call.rule], "cpu")
    return ledger


def main(argv=None):
    import gpu_check

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", choices=list(GPUS), default="NVIDIA H200")
    parser.add_argument("--parts", default=",".join(p for p in gpu_check.DEFAULT_PARTS if p != "compile"),
                        help="the parts to plan (compile replays the others' calls)")
    parser.add_argument("--updates", type=int, default=30, help="the trainings' updates (scripts/gpu_check.py's)")
    parser.add_argument("--calls", help="write each part's calls into fla here (scripts/gpu_check_calls.json)")
    args = parser.parse_args(argv)
    pretend_gpu(args.gpu)
    import fla
    import fla.ops  # noqa: F401  (every kernel, with the config lists the pretended GPU gets)
    import gpu_check_calls

    from fairseq_fwp.ops import fla_configs

    folder = fla_configs.folder_for(args.gpu, GPUS[args.gpu][0], fla.__version__)
    recorded = frozenset((kernel, key) for kernel, entries in (fla_configs.load(folder) if folder else {}).items()
                         for key, _ in entries)
    workloads = part_workloads(args.updates)
    routing, plans, calls_by_part = FlaRouting(Ledger()), {}, {}
    kernels = {rule.name: kernel for rule, kernel in routing.kernels.items()}  # each rule's fla kernel, by name
    for part in args.parts.split(","):
        routing.ledger, routing.part = Ledger(_Every()), part
        routing.values = part == "tests"  # a test compares values; elsewhere zeros do
        with routing.open():
            workloads[part](routing)
        calls = routing.calls.get(part, [])
        calls_by_part[part] = [(call, len(replayed([call], frozenset(), kernels).cold)) for call in calls]
        unrecorded = sum(len({k for k in keys if (name, k) not in recorded})
                         for name, keys in routing.ledger.keys.items())
        plans[part] = (len(calls), routing.ledger, unrecorded)
    union = replayed([call for part, calls in calls_by_part.items() if part != "op-benchmark" for call, _ in calls],
                     _Every(), kernels)
    if args.calls:
        gpu_check_calls.write(args.calls, calls_by_part)
    print_plan(args.gpu, folder, plans, union, gpu_check)


def print_plan(gpu, folder, plans, union, gpu_check):
    where = os.path.relpath(str(folder), ROOT) if folder else None
    print(f"\n# The GPU check's plan: {gpu}, Triton {IMAGE_TRITON} (the image's); fla's autotune winners "
          f"{'recorded in ' + where if where else 'not recorded for this GPU yet'}\n")
    print("Triton kernels each part compiles on a cold GPU machine (an empty Triton cache), counted from fla's "
          "autotune config lists and the calls the part makes: cold (every config of a new key), and with the "
          "winners recorded (one config a key). Seconds alone: the part's own work (FIXED_SECONDS) and "
          f"{SECONDS_PER_COMPILE:.2f} s a compile in one process, {MACHINE_COMPILES_PER_SECOND:.1f} compiles a "
          "second on all cores (the tests' workers), both from the 2026-11-28 H200 report "
          "(scripts/gpu_check_plan.py).\n")
    print("| part | calls into fla | kernels cold | with winners | keys not recorded yet | limit (s) | "
          "alone cold (s) | alone with winners (s) | costliest kernels (cold) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for part, (calls, ledger, unrecorded) in plans.items():
        cold, warm = len(ledger.cold), len(ledger.warm)
        costliest = ", ".join(f"{name} {count}" for name, _, count, _ in ledger.kernels()[:3])
        alone_warm = alone(part, cold if part == "first-step" else warm)  # first-step also runs without them
        print(f"| {part} | {calls} | {cold} | {warm} | {unrecorded} | {gpu_check.PARTS[part].limit:.0f} | "
              f"{alone(part, cold):.0f} | {alone_warm:.0f} | {costliest} |")
    default = [part for part in plans if part in gpu_check.DEFAULT_PARTS]
    compile_cold = FIXED_SECONDS["compile"] + len(union.cold) / MACHINE_COMPILES_PER_SECOND
    compile_warm = FIXED_SECONDS["compile"] + len(union.warm) / MACHINE_COMPILES_PER_SECOND
    print(f"\ncompile (every part's calls but op-benchmark's, replayed by 16 processes that share each autotuning): "
          f"{len(union.cold)} kernels cold, {compile_cold:.0f} s; {len(union.warm)} with the winners recorded, "
          f"{compile_warm:.0f} s (limit {gpu_check.PARTS['compile'].limit:.0f} s). The parts after it find their "
          "kernels compiled in Triton's cache; first-step's run without the winners "
          f"({len(plans['first-step'][1].cold) if 'first-step' in plans else 0} kernels, one process) compiles "
          "beside the parts between them.")
    with_first = {part: FIXED_SECONDS[part] for part in default}
    if "first-step" in with_first:  # its run with the winners, in a fresh Triton cache
        with_first["first-step"] += len(plans["first-step"][1].warm) * SECONDS_PER_COMPILE
    after = sum(with_first.values())
    print("\nThe whole check (" + ", ".join(["compile", *default]) + "), from a cold machine:\n")
    for name, compile_seconds in (("no winners recorded (the first GPU call records them)", compile_cold),
                                  ("the winners recorded", compile_warm)):
        total = INSTALL_SECONDS + compile_seconds + after
        print(f"- {name}: install {INSTALL_SECONDS} s + compile {compile_seconds:.0f} s + the parts "
              f"{after:.0f} s = {total:.0f} s ({total / 60:.1f} min; "
              f"{'within' if total <= BUDGET else 'over'} the plan's {BUDGET} s, one call's limit {CALL_LIMIT} s)")
    print("\nThe parts' own work after compile: " + ", ".join(f"{p} {s:.0f} s" for p, s in with_first.items()))


if __name__ == "__main__":
    main()
