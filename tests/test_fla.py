"""backend="fla" (flash-linear-attention): what it refuses, and on a GPU its real kernels against the
step-by-step reference.

Every kernel form also runs on CPU tensors through Triton's interpreter, in
test_fla_interpreted.py. fla is installed in the test environment: these
tests must not skip on the CPU, but the GPU ones, whose own code runs on
the CPU's stand-in of CUDA instead (tests/cuda_stand_in.py: each rule's
chunked form computing for fla).
"""
import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

from fairseq_fwp.ops import BackendUnavailableError, fast_weight_delta, fast_weight_sum
from fairseq_fwp.ops import fla, fla_guards
from fairseq_fwp.ops.backends import resolved_name
from fairseq_fwp.testing import triton_interpreter
from cuda_stand_in import on_gpu_and_stand_in
from helpers import make_decay, make_inputs, outputs_and_grads, relative_errors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_RULES = ["sum", "delta", "gated-sum", "gated-delta"]


def test_the_fla_kernels_are_installed_and_interpreted_here():
    assert fla.kernels()  # raises if fla is missing: CI must run these tests, not skip them
    assert torch.cuda.is_available() or fla.interpreting()


def test_half_types_over_several_steps_take_the_chunk_kernels():
    assert fla.kernel_form(torch.bfloat16, 2) == fla.kernel_form(torch.float16, 512) == "chunk"
    assert fla.kernel_form(torch.float32, 512) == "recurrent"


def test_auto_never_sends_cpu_tensors_to_fla():
    q = torch.rand(1, 1, 4, 8)
    assert resolved_name("auto", q, 8) == "chunked"


@pytest.mark.parametrize("make, message", [
    (lambda: torch.rand(1, 1, 4, 8, dtype=torch.float64), "float32, float16 or bfloat16"),
    (lambda: torch.rand(1, 1, 4, fla.MAX_FEATURES + 1), f"D <= {fla.MAX_FEATURES}"),
])
def test_what_fla_cannot_take_is_refused_clearly(make, message):
    q = make()
    with triton_interpreter() if not torch.cuda.is_available() else contextlib.nullcontext():
        with pytest.raises(BackendUnavailableError, match=message):
            fast_weight_sum(q, q, q, backend="fla")


def test_fla_on_cpu_tensors_needs_the_interpreter_open():
    """Outside fairseq_fwp.testing.triton_interpreter() a call on CPU tensors is refused before Triton sees it
    (with TRITON_INTERPRET=1 set, Triton itself would fail for want of a GPU driver)."""
    q = torch.rand(1, 1, 4, 8)
    with pytest.raises(BackendUnavailableError, match=r"CUDA tensors.*only inside fairseq_fwp.testing.triton_interpreter"):
        fast_weight_delta(q, q, q, q[..., 0], backend="fla")


# -- fla's own refusals, on a faked device -------------------------------------------

ON_A_FAKED_GPU = """
import json, sys, torch, triton
name, major, minor, version = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
# What fla reads of the device and of Triton when it is imported: the GPU's name and compute capability
# from torch, the platform from Triton's active driver, Triton's version.
triton.__version__ = version
torch.cuda.get_device_capability = lambda *args, **kwargs: (major, minor)
torch.cuda.get_device_name = lambda *args, **kwargs: name
class Target:
    backend, arch = "cuda", 10 * major + minor
class Driver:
    def get_current_target(self):
        return Target()
triton.runtime.driver.set_active(Driver())

from fairseq_fwp.ops import BackendUnavailableError, fast_weight_delta, fla, update_rule
from fairseq_fwp.ops.backends import Call, resolve
report = {}
for rule in ("sum", "delta", "gated-sum", "gated-delta", "delta-product", "gated-delta-product"):
    for needs_grad in (True, False):
        call = Call(rule=update_rule(rule), dtype=torch.bfloat16, device=torch.device("cuda"), D=64, Dv=64, T=512,
                    needs_grad=needs_grad)
        choice = resolve("auto", call)
        try:
            resolve("fla", call)
            named = "runs"
        except BackendUnavailableError as err:
            named = str(err)
        report[f"{rule} {needs_grad}"] = {"auto": choice.name, "why": choice.reason, "named": named}
# The op itself, on CPU tensors through the interpreter: refused before any of fla's kernels runs, or run.
from fairseq_fwp.testing import triton_interpreter
runs = []
fla_run = fla._run
fla._run = lambda *args: runs.append(1) or fla_run(*args)
q = torch.rand(1, 2, 64, 16, dtype=torch.float16, requires_grad=True)
try:
    with triton_interpreter():
        fast_weight_delta(q, q, q, q[..., 0], decay=torch.full((1, 2, 64), 0.9), backend="fla")
    report["op"] = "ran"
except BackendUnavailableError as err:
    report["op"] = str(err)
report["kernel calls"] = len(runs)
print(json.dumps(report))
"""


def on_a_faked_gpu(name, capability, triton_version):
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([ROOT] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    proc = subprocess.run([sys.executable, "-c", ON_A_FAKED_GPU, name, *map(str, capability), triton_version],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


GATED_RULES = ("gated-sum", "gated-delta", "gated-delta-product")


@pytest.mark.slow  # a new process
@pytest.mark.parametrize("name, capability, triton_version", [
    ("NVIDIA H200", (9, 0), "3.6.0"),  # torch 2.11's Triton
    ("NVIDIA GH200 480GB", (9, 0), "3.7.0"),  # torch 2.12.0's; Hopper by its compute capability alone
])
def test_auto_routes_around_fla_where_fla_refuses_its_gated_backward_on_hopper(name, capability, triton_version):
    report = on_a_faked_gpu(name, capability, triton_version)
    for rule in GATED_RULES:
        refused = report[f"{rule} True"]
        # fla's own words, which say what to install
        assert "fla refuses the gated chunk kernels' backward on this device (chunk_bwd_dqkwg)" in refused["why"]
        assert "upgrade Triton to >= 3.7.1" in refused["why"]
        assert refused["auto"] == "chunked" and f"rule {rule}; not fla: fla refuses" in refused["why"]
        reason = refused["why"].split("; not fla: ")[1]
        assert refused["named"] == f"backend 'fla' cannot run this call: {reason}; backend='auto' runs every call"
        assert report[f"{rule} False"]["auto"] == "fla"  # the forward alone is not refused
    for rule in ("sum", "delta", "delta-product"):
        assert report[f"{rule} True"]["auto"] == "fla"
    assert "fla refuses the gated chunk kernels' backward" in report["op"]
    assert report["kernel calls"] == 0


@pytest.mark.slow  # a new process
@pytest.mark.parametrize("name, capability, triton_version", [
    ("NVIDIA H100 80GB HBM3", (9, 0), "3.7.1"),  # a Triton that fla trusts on Hopper (torch 2.12.1's)
    ("NVIDIA A100-SXM4-80GB", (8, 0), "3.6.0"),  # not Hopper
])
def test_auto_keeps_fla_where_fla_takes_the_gated_backward(name, capability, triton_version):
    report = on_a_faked_gpu(name, capability, triton_version)
    assert all(report[f"{rule} True"]["auto"] == "fla" for rule in GATED_RULES), report
    assert report["op"] == "ran" and report["kernel calls"] == 1


# -- on a GPU: fla's real kernels (on the stand-in: the chunked form) ----------------


def on_gpu(inputs, gate, dtype):
    """The inputs on CUDA in `dtype` (the state and the decay in float32), needing gradients."""
    cast = [None if x is None else x.detach().to("cuda", dtype).requires_grad_() for x in inputs]
    if cast[4] is not None:
        cast[4] = cast[4].detach().float().requires_grad_()
    return cast, {name: x.detach().cuda().float().requires_grad_() for name, x in gate.items()}


def against_reference(rule, inputs, gate):
    refusal = fla_guards.refusal("the gated chunk kernels' backward")
    if rule.startswith("gated") and inputs[0].dtype != torch.float32 and refusal:
        pytest.skip(refusal)  # auto runs chunked there (test_auto_routes_around_fla_where_fla_refuses...)
    base = rule.removeprefix("gated-")
    got = outputs_and_grads(base, inputs, "fla", **gate)
    wide = [None if x is None else x.detach().double().requires_grad_() for x in inputs]
    return got, outputs_and_grads(base, wide, "reference",
                                  **{name: x.detach().double().requires_grad_() for name, x in gate.items()})


def gate_for(rule, shape):
    return {"decay": make_decay(*shape[:3], dtype=torch.float32, low=0.8)} if rule.startswith("gated") else {}


# The first shape has the heads and head size of examples/speed/train_step.py's GPT-2-small rows, whose
# training then finds these kernels compiled in the GPU check's Triton cache (H and D are compile-time).
GPU_SHAPES = [(2, 12, 200, 64, 64), (1, 2, 77, 256, 32), (2, 2, 1, 128, 128)]
# On the stand-in (the chunked form computing for fla): two chunks of 64, the second partial; one step.
STAND_IN_SHAPES = [(1, 2, 70, 16, 8), (2, 1, 1, 8, 12)]


@on_gpu_and_stand_in("rule, dtype, shape",
                     [(r, d, s) for r in GPU_RULES for d in (torch.float16, torch.bfloat16) for s in GPU_SHAPES],
                     [("gated-delta", torch.bfloat16, STAND_IN_SHAPES[0]), ("sum", torch.float16, STAND_IN_SHAPES[0]),
                      ("delta", torch.float16, STAND_IN_SHAPES[1])])
def test_gpu_half_types_match_reference(gpu, rule, dtype, shape):
    """fla's half-type kernels against float64 on the same rounded inputs, as fla's own tests judge them: the root
    mean square of the error, relative to the reference's (a few times the dtype's rounding; fla's tests allow 5e-3
    to 8e-3 in bfloat16, and a 1% error fails), and its largest element relative to the largest value."""
    inputs, gate = on_gpu(make_inputs(*shape, dtype=torch.float32), gate_for(rule, shape), dtype)
    got, want = against_reference(rule, inputs, gate)
    assert got["out"].dtype == dtype
    errors, tolerance = rms_errors(got, want), {torch.bfloat16: 8e-3, torch.float16: 2e-3}[dtype]
    assert max(errors.values()) < tolerance, errors
    assert max(relative_errors(got, want).values()) < 3e-2, relative_errors(got, want)


def rms_errors(got, want):
    """{name: the root mean square of got - want, relative to want's}, fla's measure (fla.utils.testing)."""
    return {name: ((got[name].double() - want[name].double()).pow(2).mean().sqrt()
                   / want[name].double().pow(2).mean().sqrt().clamp_min(1e-12)).item() for name in want}


@on_gpu_and_stand_in("rule, with_state, shape",
                     [(r, w, (2, 4, 333, 64, 48)) for r in ("sum", "delta", "gated-sum") for w in (False, True)],
                     [("gated-sum", True, (1, 2, 20, 16, 8)), ("delta", False, (1, 2, 20, 16, 8))])
def test_gpu_float32_matches_reference(gpu, rule, with_state, shape):
    inputs, gate = on_gpu(make_inputs(*shape, dtype=torch.float32, with_state=with_state), gate_for(rule, shape),
                          torch.float32)
    got, want = against_reference(rule, inputs, gate)
    errors = relative_errors(got, want)
    assert max(errors.values()) < 1e-4, errors


def test_gpu_auto_uses_fla_where_it_fits_and_chunked_elsewhere(gpu):
    q = torch.rand(1, 1, 4, 64, device="cuda", dtype=torch.bfloat16)
    assert resolved_name("auto", q, 64) == "fla"
    assert resolved_name("auto", q.double(), 64) == "chunked"
    assert resolved_name("auto", torch.rand(1, 1, 4, 512, device="cuda"), 64) == "chunked"


# -- fairseq_fwp.testing.triton_interpreter ---------------------------------------------

TRY_THE_INTERPRETER = """
import os, sys, torch
import fla.ops.delta_rule  # the kernels are compiled (or interpreted) as triton decorates them
os.environ["TRITON_INTERPRET"] = sys.argv[1]
from fairseq_fwp.testing import TritonInterpreterUnavailable, triton_interpreter
try:
    with triton_interpreter():
        pass
except TritonInterpreterUnavailable as err:
    print(err)
else:
    print("opened")
"""


@pytest.mark.slow  # a new process
@pytest.mark.parametrize("at_import, later, expected", [
    ("1", "1", "opened"),
    ("0", "0", "needs TRITON_INTERPRET=1 in the environment before triton is imported"),
    ("0", "1", "TRITON_INTERPRET=1 was set after triton compiled fla's kernels"),
])
def test_triton_interpreter_says_when_it_cannot_open(at_import, later, expected):
    env = dict(os.environ, TRITON_INTERPRET=at_import,
               PYTHONPATH=os.pathsep.join([ROOT] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    proc = subprocess.run([sys.executable, "-c", TRY_THE_INTERPRETER, later], env=env, capture_output=True,
                          text=True, timeout=120)
    assert expected in proc.stdout, proc.stdout + proc.stderr
