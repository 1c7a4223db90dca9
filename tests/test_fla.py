"""backend="fla" (flash-linear-attention) against the step-by-step reference.

Without a GPU, fla's recurrent kernels run on the CPU through Triton's
interpreter (conftest.py sets TRITON_INTERPRET=1 before triton is imported):
float32 and single decoding steps in every dtype. Its chunkwise kernels
(half types, T > 1) need a GPU; the tests marked GPU run them and skip without
CUDA. fla is installed in the test environment: these tests must not skip on
the CPU.
"""
import pytest
import torch

from fairseq_fwp.ops import BackendUnavailableError, fast_weight_delta, fast_weight_sum
from fairseq_fwp.ops import fla
from fairseq_fwp.ops.fast_weight import resolve_backend
from op_inputs import make_inputs, outputs_and_grads, run_op
from test_ops import assert_all_close

RULES = ["sum", "delta"]
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# (B, H, T, D, Dv): T = 1 (decoding), T not a multiple of any block size, D != Dv both ways,
# D not a power of two (fla pads to one), B * H = 1.
SHAPES = [(2, 3, 1, 8, 8), (1, 2, 37, 6, 5), (2, 1, 19, 16, 24), (1, 1, 70, 32, 7)]


@pytest.fixture(autouse=True)
def first_config_when_interpreting(monkeypatch):
    """Triton's autotuner times its configurations on a GPU; the interpreter has none to time,
    and every configuration computes the same, so take the first."""
    if fla.interpreting():
        from triton.runtime import autotuner

        monkeypatch.setattr(autotuner.Autotuner, "prune_configs", lambda self, kwargs: self.configs[:1])


def test_the_fla_kernels_are_installed_and_interpreted_here():
    assert fla.kernels()  # raises if fla is missing: CI must run these tests, not skip them
    assert torch.cuda.is_available() or fla.interpreting()


def relative_error(got, want):
    return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_float32_matches_reference(rule, shape, with_state):
    inputs = make_inputs(*shape, dtype=torch.float32, with_state=with_state)
    assert fla.kernel_form(torch.float32, shape[2]) == "recurrent"
    want = outputs_and_grads(rule, inputs, "reference")
    got = outputs_and_grads(rule, inputs, "fla")
    assert_all_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rule", RULES)
def test_a_carried_state_without_gradient(rule):
    """Training with carry-over: the state is detached, q, k, v (and beta) need gradients."""
    q, k, v, beta, W0 = make_inputs(1, 2, 11, 8, 4, dtype=torch.float32)
    W0 = W0.detach()
    got = outputs_and_grads(rule, [q, k, v, beta, W0], "fla")
    want = outputs_and_grads(rule, [q, k, v, beta, W0], "reference")
    assert_all_close(got, want, rtol=1e-4, atol=1e-4)
    assert not W0.requires_grad


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_decoding_step_matches_reference(rule, dtype):
    """One step (T = 1) in a half type: the recurrent kernel, state carried in float32."""
    half = [x.detach().to(dtype).requires_grad_() for x in make_inputs(2, 2, 1, 16, 8, dtype=torch.float32)]
    half[4] = half[4].detach().float().requires_grad_()
    assert fla.kernel_form(dtype, 1) == "recurrent"
    got = outputs_and_grads(rule, half, "fla")
    want = outputs_and_grads(rule, [x.detach().float().requires_grad_() for x in half], "reference")
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    for name, a, b in zip(["out", "state", "dq", "dk", "dv", "dbeta", "dstate"], got, want):
        assert relative_error(a, b) < 2e-2, name


def test_half_types_over_several_steps_take_the_chunk_kernels():
    assert fla.kernel_form(torch.bfloat16, 2) == fla.kernel_form(torch.float16, 512) == "chunk"
    assert fla.kernel_form(torch.float32, 512) == "recurrent"


@pytest.mark.parametrize("rule", RULES)
def test_state_only_ops(rule):
    from fairseq_fwp.ops import fast_weight_delta_state, fast_weight_sum_state

    q, k, v, beta, W0 = make_inputs(1, 2, 23, 8, 6, dtype=torch.float32)
    if rule == "sum":
        got = fast_weight_sum_state(k, v, W0, backend="fla")
    else:
        got = fast_weight_delta_state(k, v, beta, W0, backend="fla")
    _, want = run_op(rule, [q, k, v, beta, W0], "reference")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    g_got = torch.autograd.grad(got.sum(), W0)[0]
    torch.testing.assert_close(g_got, torch.autograd.grad(want.sum(), W0)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rule", RULES)
def test_mixed_dtypes_are_computed_in_float32(rule):
    """float32 features beside float16 values and beta (what autocast makes)."""
    q, k, v, beta, W0 = make_inputs(1, 2, 9, 8, 8, dtype=torch.float32)
    mixed = [q, k, v.detach().half().requires_grad_(), beta.detach().half().requires_grad_(), W0]
    out, W = run_op(rule, mixed, "fla")
    want_out, want_W = run_op(rule, [q, k, mixed[2].float(), mixed[3].float(), W0], "reference")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(W, want_W, rtol=1e-4, atol=1e-4)


def test_auto_never_sends_cpu_tensors_to_fla():
    q = torch.rand(1, 1, 4, 8)
    assert resolve_backend("auto", q, 8) == "chunked"


@pytest.mark.parametrize("make, message", [
    (lambda: torch.rand(1, 1, 4, 8, dtype=torch.float64), "float32, float16 or bfloat16"),
    (lambda: torch.rand(1, 1, 4, fla.MAX_FEATURES + 1), f"D <= {fla.MAX_FEATURES}"),
])
def test_what_fla_cannot_take_is_refused_clearly(make, message):
    q = make()
    with pytest.raises(BackendUnavailableError, match=message):
        fast_weight_sum(q, q, q, backend="fla")


def test_fla_on_cpu_tensors_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.rand(1, 1, 4, 8)
    with pytest.raises(BackendUnavailableError, match="CUDA tensors.*TRITON_INTERPRET"):
        fast_weight_delta(q, q, q, q[..., 0], backend="fla")


# -- on a GPU: the chunkwise kernels and auto ---------------------------------------


def on_gpu(inputs, dtype):
    cast = [None if x is None else x.detach().to("cuda", dtype) for x in inputs]
    if cast[4] is not None:
        cast[4] = cast[4].float()  # the state is carried in float32
    return [None if x is None else x.requires_grad_() for x in cast]


@GPU
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 4, 200, 64, 64), (1, 2, 77, 256, 32), (2, 2, 1, 128, 128)])
def test_gpu_half_types_match_reference(rule, dtype, shape):
    inputs = on_gpu(make_inputs(*shape, dtype=torch.float32), dtype)
    got = outputs_and_grads(rule, inputs, "fla")
    want = outputs_and_grads(rule, [None if x is None else x.detach().float().requires_grad_() for x in inputs],
                             "reference")
    assert got[0].dtype == dtype
    for name, a, b in zip(["out", "state", "dq", "dk", "dv", "dbeta", "dstate"], got, want):
        assert relative_error(a, b) < 3e-2, name


@GPU
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("with_state", [False, True])
def test_gpu_float32_matches_reference(rule, with_state):
    inputs = on_gpu(make_inputs(2, 4, 333, 64, 48, dtype=torch.float32, with_state=with_state), torch.float32)
    assert_all_close(outputs_and_grads(rule, inputs, "fla"), outputs_and_grads(rule, inputs, "reference"),
                     rtol=1e-4, atol=1e-4)


@GPU
def test_gpu_auto_uses_fla_where_it_fits_and_chunked_elsewhere():
    q = torch.rand(1, 1, 4, 64, device="cuda", dtype=torch.bfloat16)
    assert resolve_backend("auto", q, 64) == "fla"
    assert resolve_backend("auto", q.double(), 64) == "chunked"
    assert resolve_backend("auto", torch.rand(1, 1, 4, 512, device="cuda"), 64) == "chunked"


# -- the gated rules (decay) -------------------------------------------------------


def test_gated_sum_float32_matches_reference():
    from op_inputs import gated_outputs_and_grads, make_decay

    inputs = make_inputs(1, 2, 29, 8, 6, dtype=torch.float32)
    decay = make_decay(1, 2, 29, dtype=torch.float32)
    got = gated_outputs_and_grads("sum", inputs, decay, "fla")
    want = gated_outputs_and_grads("sum", inputs, decay, "reference")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_gated_delta_float32_forward_matches_reference_and_training_is_refused():
    """fla's recurrent gated delta rule has no backward: inference only; auto runs chunked for training."""
    from op_inputs import make_decay

    q, k, v, beta, W0 = (x.detach() for x in make_inputs(1, 2, 21, 8, 6, dtype=torch.float32))
    decay = make_decay(1, 2, 21, dtype=torch.float32).detach()
    with torch.no_grad():
        out, W = fast_weight_delta(q, k, v, beta, W0, decay=decay, backend="fla")
    want_out, want_W = fast_weight_delta(q, k, v, beta, W0, decay=decay, backend="reference")
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(W, want_W, rtol=1e-4, atol=1e-4)
    with pytest.raises(BackendUnavailableError, match="no backward"):
        fast_weight_delta(q.requires_grad_(), k, v, beta, W0, decay=decay, backend="fla")


@GPU
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_gated_half_types_match_reference(rule, dtype):
    from op_inputs import gated_outputs_and_grads, make_decay

    inputs = on_gpu(make_inputs(2, 4, 200, 64, 64, dtype=torch.float32), dtype)
    decay = make_decay(2, 4, 200, dtype=torch.float32).detach().cuda().requires_grad_()
    got = gated_outputs_and_grads(rule, inputs, decay, "fla")
    reference_inputs = [None if x is None else x.detach().float().requires_grad_() for x in inputs]
    want = gated_outputs_and_grads(rule, reference_inputs, decay, "reference")
    for a, b in zip(got, want):
        assert relative_error(a, b) < 3e-2
