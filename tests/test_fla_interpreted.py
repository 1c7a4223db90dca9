"""backend="fla" on CPU tensors, through Triton's interpreter, against a float64 recurrence.

Every kernel form that ``auto`` sends CUDA tensors to runs here, as it
runs on a GPU but interpreted (fairseq_fwp.testing.triton_interpreter):
- the chunkwise kernels, float16 over several steps (what half-precision
  training runs): sum, delta, gated sum, gated delta;
- the recurrent kernels, float32;
- one decoding step (T = 1).
Outputs, final state and every gradient (q, k, v, beta, decay, initial
state) are compared. The interpreter needs TRITON_INTERPRET=1 before triton
is imported: conftest.py sets it on machines without CUDA, and the GPU check
runs this file in a process of its own with it set.
"""
import pytest
import torch

from fairseq_fwp.ops import BackendUnavailableError, fast_weight_delta, fla
from fairseq_fwp.testing import triton_interpreter
from helpers import make_decay, make_inputs, outputs_and_grads, recurrence, relative_errors, with_full_forgets

pytestmark = pytest.mark.skipif(not fla.interpreting(), reason="needs TRITON_INTERPRET=1 set before triton is "
                                "imported (conftest.py does so without CUDA; the GPU check runs this file so)")

RULES = ["sum", "delta", "gated-sum", "gated-delta"]
# (B, H, T, D, Dv), D != Dv: two chunks of 64 with a partial second one; one partial chunk.
SHAPES = [(1, 2, 70, 16, 8), (2, 1, 37, 8, 12)]


@pytest.fixture(autouse=True)
def interpreter():
    with triton_interpreter():
        yield


def inputs_for(rule, shape, dtype, with_state):
    """The op's inputs in `dtype` (the state in float32) and the gate for the gated rules."""
    inputs = [None if x is None else x.detach().to(dtype).requires_grad_()
              for x in make_inputs(*shape, dtype=torch.float32, with_state=with_state)]
    if with_state:
        inputs[4] = inputs[4].detach().float().requires_grad_()  # the state is carried in float32
    gate = {"decay": make_decay(*shape[:3], dtype=torch.float32, low=0.8)} if rule.startswith("gated") else {}
    return inputs, gate


def against_float64(rule, inputs, gate):
    """outputs_and_grads of fla and of the float64 reference recurrence on the same (rounded) inputs."""
    base = rule.removeprefix("gated-")
    got = outputs_and_grads(base, inputs, "fla", **gate)
    wide = [None if x is None else x.detach().double().requires_grad_(x.requires_grad) for x in inputs]
    wide_gate = {name: x.detach().double().requires_grad_(x.requires_grad) for name, x in gate.items()}
    return got, outputs_and_grads(base, wide, "reference", **wide_gate)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_kernels_float16(rule, shape, with_state):
    assert fla.kernel_form(torch.float16, shape[2]) == "chunk"
    got, want = against_float64(rule, *inputs_for(rule, shape, torch.float16, with_state))
    assert got["out"].dtype == torch.float16 and got["state"].dtype == torch.float32
    errors = relative_errors(got, want)
    assert max(errors.values()) < 5e-3, errors


@pytest.mark.parametrize("rule", ["sum", "delta", "gated-sum"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_kernels_float32(rule, shape, with_state):
    assert fla.kernel_form(torch.float32, shape[2]) == "recurrent"
    got, want = against_float64(rule, *inputs_for(rule, shape, torch.float32, with_state))
    errors = relative_errors(got, want)
    assert max(errors.values()) < 1e-5, errors


def test_recurrent_gated_delta_rule_float32_has_no_backward():
    """fla's recurrent gated delta rule is forward-only: inference runs it, training is refused (auto
    trains with chunked instead)."""
    inputs, gate = inputs_for("gated-delta", SHAPES[0], torch.float32, True)
    with torch.no_grad():
        got, want = against_float64("gated-delta", [x.detach() for x in inputs], {"decay": gate["decay"].detach()})
    errors = relative_errors(got, want)
    assert max(errors.values()) < 1e-5, errors
    with pytest.raises(BackendUnavailableError, match="no backward"):
        q, k, v, beta, W0 = inputs
        fast_weight_delta(q, k, v, beta, W0, decay=gate["decay"], backend="fla")


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_one_decoding_step(rule, dtype):
    """T = 1 takes the recurrent kernels in every dtype; no gradients (decoding)."""
    assert fla.kernel_form(dtype, 1) == "recurrent"
    inputs, gate = inputs_for(rule, (2, 2, 1, 16, 8), dtype, True)
    with torch.no_grad():
        got, want = against_float64(rule, [x.detach() for x in inputs], {k: x.detach() for k, x in gate.items()})
    errors = relative_errors(got, want)
    assert max(errors.values()) < (1e-3 if dtype == torch.float16 else 1e-6), errors


def test_bfloat16_chunks_are_refused_in_the_interpreter():
    """The interpreter computes bfloat16 chunks wrongly, silently: refused, not run."""
    inputs, _ = inputs_for("delta", SHAPES[0], torch.bfloat16, False)
    q, k, v, beta, _ = inputs
    with pytest.raises(BackendUnavailableError, match="bfloat16"):
        fast_weight_delta(q, k, v, beta, backend="fla")


@pytest.mark.parametrize("rule", ["sum", "delta"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_carried_state_without_gradient(rule, dtype):
    """Training with carry-over: the state is detached, q, k, v (and beta) need gradients."""
    inputs, _ = inputs_for(rule, SHAPES[0], dtype, True)
    inputs[4] = inputs[4].detach()
    got, want = against_float64(rule, inputs, {})
    assert "dstate" not in got
    errors = relative_errors(got, want)
    assert max(errors.values()) < 5e-3, errors


@pytest.mark.parametrize("rule", ["sum", "delta", "gated-sum", "gated-delta"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_state_only_ops(rule, dtype):
    """The final state alone (fla runs the full kernels and drops the outputs), and its gradient."""
    from fairseq_fwp.ops import fast_weight_delta_state, fast_weight_sum_state

    (q, k, v, beta, W0), gate = inputs_for(rule, SHAPES[1], dtype, True)
    if rule.startswith("gated") and dtype == torch.float32:
        gate = {name: x.detach() for name, x in gate.items()}  # fla's recurrent gated delta rule: no backward
        k, v, beta, W0 = (x.detach() for x in (k, v, beta, W0))
    delta = rule.endswith("delta")

    def final_state(backend, *tensors):
        k, v, beta, W0, gate = tensors
        if delta:
            return fast_weight_delta_state(k, v, beta, W0, backend=backend, **gate)
        return fast_weight_sum_state(k, v, W0, backend=backend, **gate)

    got = final_state("fla", k, v, beta, W0, gate)
    wide = [x.detach().double().requires_grad_(x.requires_grad) for x in (k, v, beta, W0)]
    wide_gate = {name: x.detach().double() for name, x in gate.items()}
    want = final_state("reference", *wide, wide_gate)
    assert (got.double() - want).abs().max() / want.abs().max() < 5e-3
    if W0.requires_grad:
        (g_got,), (g_want,) = torch.autograd.grad(got.sum(), W0), torch.autograd.grad(want.sum(), wide[3])
        assert (g_got.double() - g_want).abs().max() / g_want.abs().max() < 5e-3


@pytest.mark.parametrize("rule", ["sum", "delta"])
def test_mixed_dtypes_are_computed_in_float32(rule):
    """float32 features beside float16 values and beta (what autocast makes): the recurrent kernels."""
    q, k, v, beta, W0 = make_inputs(1, 2, 9, 8, 6, dtype=torch.float32)
    mixed = [q, k, v.detach().half().requires_grad_(), beta.detach().half().requires_grad_(), W0]
    got = outputs_and_grads(rule, mixed, "fla")
    want = outputs_and_grads(rule, [q, k, mixed[2].float(), mixed[3].float(), W0], "reference")
    assert got["out"].dtype == torch.float32
    errors = relative_errors(got, want)
    assert max(errors.values()) < 1e-3, errors


@pytest.mark.parametrize("rule", ["gated-sum", "gated-delta"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
# (a lone zero: "subnormal" has one, after a subnormal decay, and each row of zeros starts as one; the
# property harness draws lone zeros on fla in float32 too)
@pytest.mark.parametrize("pattern", ["zeros in a row", "subnormal"])
@pytest.mark.parametrize("given", ["decay", "log_decay"])
def test_full_forgets(rule, dtype, pattern, given):
    """Decays of exactly zero (fla gets a finite g whose exp is 0), in rows across chunk borders, alone and
    below float32's smallest normal: against the step-by-step loops in float64, every gradient where the
    kernel has one."""
    base = rule.removeprefix("gated-")
    trains = not (base == "delta" and dtype == torch.float32)  # fla's recurrent gated delta rule: no backward
    inputs, _ = inputs_for(rule, (1, 2, 70, 16, 8), dtype, True)
    decay = with_full_forgets(make_decay(1, 2, 70, dtype=torch.float32, low=0.8), pattern)
    if not trains:
        inputs, decay = [x.detach() for x in inputs], decay.detach()
    gate = {"decay": decay} if given == "decay" else {"log_decay": decay.detach().log().requires_grad_(trains)}
    got = outputs_and_grads(base, inputs, "fla", **gate)
    wide = [x.detach().double().requires_grad_(trains) for x in inputs]
    wide_decay = decay.detach().double().requires_grad_(trains)
    want = outputs_and_grads(base, wide, recurrence(base), decay=wide_decay)
    if given == "log_decay" and trains:
        want["ddecay"] = want["ddecay"] * wide_decay.detach()
    assert all(torch.isfinite(x).all() for x in got.values())
    errors = relative_errors(got, want)
    assert max(errors.values()) < (5e-3 if dtype == torch.float16 else 1e-5), errors


def zero_decay_call(requires_grad):
    """float32 gated delta rule inputs with one decay of exactly zero (the op's exact-gradient path)."""
    inputs, gate = inputs_for("gated-delta", SHAPES[0], torch.float32, True)
    decay = with_full_forgets(gate["decay"], "one zero")
    return [x.detach().requires_grad_(requires_grad) for x in inputs], decay.detach().requires_grad_(requires_grad)


def test_a_call_that_needs_gradients_is_refused_before_its_forward():
    """A zero decay runs the forward without autograd (decay.py), but the call will need gradients: fla's
    recurrent gated delta rule, which has none, is refused at the call, not in backward()."""
    (q, k, v, beta, W0), decay = zero_decay_call(requires_grad=True)
    with pytest.raises(BackendUnavailableError, match="no backward"):
        fast_weight_delta(q, k, v, beta, W0, decay=decay, backend="fla")


def test_auto_runs_forward_and_backward_of_one_call_on_one_backend(monkeypatch):
    """With fla first in auto's order for CPU tensors (as on CUDA), a call with a zero decay that needs
    gradients runs its forward and its backward on the same backend."""
    from fairseq_fwp.ops import backends

    monkeypatch.setattr(backends, "AUTO", (("fla", None), ("chunked", None)))
    (q, k, v, beta, W0), decay = zero_decay_call(requires_grad=True)
    chosen = []
    out, W = fast_weight_delta(q, k, v, beta, W0, decay=decay, on_choice=lambda c: chosen.append(c.name))
    forward = list(chosen)
    (out.sum() + W.sum()).backward()
    assert forward and set(chosen) == set(forward) == {"chunked"}, chosen


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_every_backends_decoding_step_returns_the_dtype_it_computes_in(dtype):
    """One rule for the step's output dtype: the inputs' (as the sequence ops), whichever backend runs."""
    from fairseq_fwp.ops import Memory, fast_weight_step_

    q, k, v, beta, W0 = (x.detach().to(dtype) for x in make_inputs(2, 2, 1, 8, 6, dtype=torch.float32))
    outs = {}
    for backend in ("reference", "chunked", "fla"):
        memory = Memory(fast_weight=W0[..., :0, :0].new_zeros(2, 2, 6, 8, dtype=torch.float32))
        outs[backend] = fast_weight_step_(memory, q[:, :, 0], k[:, :, 0], v[:, :, 0], beta[:, :, 0], backend=backend)
    assert {out.dtype for out in outs.values()} == {dtype}, {name: out.dtype for name, out in outs.items()}
    for out in outs.values():
        torch.testing.assert_close(out.float(), outs["reference"].float(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_deltaproduct_chunk_kernel_float16(gated, with_state):
    """fla's chunk_gated_delta_product (N = 2 writes per token, beta in (0, 2)), interleaved as ours, against
    the float64 recurrence; float32 and decoding steps have no fla kernel and are refused."""
    from test_delta_product import outputs_and_grads as product_grads
    from test_delta_product import product_inputs, recurrence

    from fairseq_fwp.ops import fast_weight_delta_product

    inputs = product_inputs(1, 2, 37, 2, 16, 8, with_state=with_state, gated=gated, dtype=torch.float32)
    half = [None if x is None else x.detach().to(torch.float16 if i < 4 else torch.float32).requires_grad_()
            for i, x in enumerate(inputs)]
    got = product_grads(lambda *x: fast_weight_delta_product(*x[:5], log_decay=x[5], backend="fla"), half)
    wide = [None if x is None else x.detach().double().requires_grad_() for x in half]
    want = product_grads(recurrence, wide)
    errors = relative_errors(got, want)
    assert got["out"].dtype == torch.float16 and max(errors.values()) < 5e-3, errors
    with pytest.raises(BackendUnavailableError, match="DeltaProduct's chunkwise kernel only"):
        fast_weight_delta_product(*[None if x is None else x.detach() for x in inputs[:5]], backend="fla")
