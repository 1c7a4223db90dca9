"""The glue around the rule's kernel: the fused feature normalisations (feature_maps.normalized_features,
FeatureMap.normalized), the layer's batch-first memory and its shared-input projections (modules/layouts.py),
and the layout the causal layer hands fla (examples/speed/glue.py counts what they save)."""
import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from fairseq_fwp.modules.attention_options import AttentionOptions
from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention
from fairseq_fwp.modules.feature_maps import build_feature_map, normalize_features
from fairseq_fwp.modules.layouts import project, project_all, to_batch_first
from fairseq_fwp.ops import fla

MAPS = [("linear", "sum"), ("linear", "l2"), ("linear", "none"), ("dpfp", "sum"), ("performer", "sum"),
        ("silu", "l2"), ("dpfp", "l2")]


class OpNames(TorchDispatchMode):
    """The names of the aten ops run under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def feature_inputs(name, dtype, seed=0):
    """[B, H, T, d] inputs, with vectors whose features' sum and norm are below the clamp's eps, but not zero
    (where they vanish, so does the gradient that the clamp stops)."""
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    x[0, 0, 0] = x[0, 0, 0] - 20 if name == "linear" else 1e-5 * x[0, 0, 0]  # elu(x) + 1 = exp(x) ~ 2e-9
    x[0, 0, 1] = x[0, 0, 1] - 200  # elu's exp underflows (float32): the features vanish
    return x.to(dtype).requires_grad_()


def values_and_gradient(phi, x, how, fused):
    out = phi.normalized(x, how) if fused else normalize_features(phi(x), how)
    g = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    return out, torch.autograd.grad(out, x, g)[0]


@pytest.mark.parametrize("name, how", MAPS)
def test_the_fused_normalisations_compute_the_reference(name, how):
    phi = build_feature_map(name, 8).double()
    x = feature_inputs(name, torch.float64)
    got, want = values_and_gradient(phi, x, how, True), values_and_gradient(phi, x, how, False)
    for a, b in zip(got, want):  # elu(x) + 1 cancels where the sums are clamped: 1e-10, not float64's 1e-16
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    plain = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)  # finite differences fail at those
    assert torch.autograd.gradcheck(lambda t: phi.normalized(t, how), (plain,))


@pytest.mark.parametrize("name, how", MAPS)
def test_in_float32_the_fused_normalisations_err_as_the_reference(name, how):
    """Their rounding order differs from normalize_features': both are measured against float64."""
    phi = build_feature_map(name, 8)
    wide = values_and_gradient(phi.double(), feature_inputs(name, torch.float64), how, False)
    phi = phi.float()

    def error(fused):
        return max(((a.double() - b).abs().max() / b.abs().max()).item()
                   for a, b in zip(values_and_gradient(phi, feature_inputs(name, torch.float32), how, fused), wide))

    assert error(True) < 4 * error(False) + 2e-7, (error(True), error(False))


@pytest.mark.parametrize("how", ["sum", "l2"])
def test_the_fused_normalisations_write_their_input_dtype_and_memory_order(how):
    """Under autocast too: a float32 result (autocast's sum is float32) would only be cast back for the ops."""
    phi = build_feature_map("linear" if how == "sum" else "silu", 8)
    x = torch.randn(3, 5, 2, 8).to(torch.bfloat16).permute(0, 2, 1, 3)  # [B, H, T, d] in [B, T, H, d] memory
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = phi.normalized(x, how)
    assert out.dtype == torch.bfloat16 and out.stride() == x.stride()
    torch.testing.assert_close(out.float(), normalize_features(phi(x.float()), how), rtol=1e-2, atol=1e-3)


def test_to_batch_first_casts_and_lays_out_in_one_pass_each_way():
    x = torch.randn(7, 3, 16, requires_grad=True)  # [T, B, C]
    with OpNames() as forward, torch.autocast("cpu", dtype=torch.bfloat16):
        y = to_batch_first(x)
    assert y.shape == x.shape and y.dtype == torch.bfloat16 and y.transpose(0, 1).is_contiguous()
    assert torch.equal(y, x.detach().to(torch.bfloat16))
    g = torch.randn(3, 7, 16).to(torch.bfloat16).transpose(0, 1)  # as the projections give it: batch-first
    with OpNames() as backward:
        y.backward(g)
    assert x.grad.is_contiguous() and x.grad.dtype == torch.float32 and torch.equal(x.grad, g.float())
    writes = {"_to_copy", "copy_", "clone"}
    assert [n for n in forward.names if n in writes] == ["_to_copy"]
    assert [n for n in backward.names if n in writes] == ["_to_copy"]


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_projections_of_one_input_compute_what_linears_compute(batch_first, autocast):
    """project_all's GEMMs sum the input gradient: no elementwise add of one gradient per linear."""
    torch.manual_seed(0)
    linears = [nn.Linear(16, 16), nn.Linear(16, 24), nn.Linear(16, 4, bias=False)]
    x0 = torch.randn(5, 3, 16)
    x0 = x0.transpose(0, 1).contiguous().transpose(0, 1) if batch_first else x0
    grads = [torch.randn(5, 3, linear.out_features) for linear in linears]

    def run(projected):
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outs = projected(x)
        with OpNames() as backward:
            torch.autograd.backward(outs, [g.to(y.dtype) for g, y in zip(grads, outs)])
        return [y.float() for y in outs], [x.grad] + [p.grad.clone() for lin in linears for p in lin.parameters()], \
            backward.names

    got, got_grads, names = run(lambda x: project_all(linears, x))
    for linear in linears:
        linear.zero_grad()
    want, want_grads, _ = run(lambda x: [project(linear, x) for linear in linears])
    tolerance = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(got + got_grads, want + want_grads):
        torch.testing.assert_close(a, b, **tolerance)
    assert got_grads[0].dtype == torch.float32 and "add" not in names and "add_" not in names


def test_the_causal_layer_hands_fla_its_own_layout(monkeypatch):
    """q, k, v and beta reach fla's kernel contiguous in [B, T, H, D] (its input guard copies nothing), and its
    output reaches the output projection without a copy: the forward pass casts x once and copies nothing."""
    seen = {}

    def kernel(q, k, v, beta, scale, initial_state, output_final_state):
        seen.update(q=q, k=k, v=v, beta=beta)
        return q + k + v * beta.unsqueeze(-1), q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])

    monkeypatch.setattr(fla, "kernels", lambda: {("delta", "chunk"): kernel})
    monkeypatch.setattr(fla, "INTERPRETER_OPEN", [True])  # fla's backend takes these CPU tensors
    layer = FastWeightAttention(AttentionOptions(32, 4, update_rule="delta", backend="fla"))
    x = torch.randn(9, 3, 32)
    with OpNames() as forward, torch.autocast("cpu", dtype=torch.float16):
        out, _ = layer(x, x, x)
    assert all(seen[name].is_contiguous() for name in ("q", "k", "v", "beta"))
    assert [seen[name].shape for name in ("q", "beta")] == [(3, 9, 4, 8), (3, 9, 4)]
    assert [n for n in forward.names if n in ("_to_copy", "copy_", "clone")].count("_to_copy") == \
        1 + 2 * 5  # x once; each of the 5 linears' weight and bias (autocast's casts)
    assert "clone" not in forward.names and "copy_" not in forward.names
    assert out.shape == x.shape


def test_a_projection_with_a_hook_runs_as_a_module():
    """project_all computes the linears itself; a hook on one (a user's, or pruning's) still sees its call."""
    layer = FastWeightAttention(AttentionOptions(32, 4, update_rule="delta", backend="chunked"))
    calls = []
    layer.k_proj.register_forward_hook(lambda module, inputs, output: calls.append(output.shape))
    x = torch.randn(9, 3, 32, requires_grad=True)
    layer(x, x, x)[0].sum().backward()
    assert calls == [(9, 3, 32)] and x.grad is not None
