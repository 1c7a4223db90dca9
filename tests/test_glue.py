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
from fairseq_fwp.modules.layouts import project, project_all, to_batch_first, unfused
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


@pytest.mark.parametrize("dtype, autocast", [(torch.float32, torch.bfloat16), (torch.float32, None),
                                             (torch.float16, None), (torch.bfloat16, None)],
                         ids=["amp", "float32", "fp16", "bf16"])
def test_to_batch_first_casts_and_lays_out_in_one_pass_each_way(dtype, autocast):
    """Under autocast (--amp) and in the model's own dtype (float32, and fairseq's --fp16 and --bf16, which cast
    the model): one pass each way, whether or not it casts."""
    x = torch.randn(7, 3, 16).to(dtype).requires_grad_()  # [T, B, C]
    with OpNames() as forward, torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y = to_batch_first(x)
    want = autocast or dtype
    assert y.shape == x.shape and y.dtype == want and y.transpose(0, 1).is_contiguous()
    assert torch.equal(y, x.detach().to(want))
    g = torch.randn(3, 7, 16).to(want).transpose(0, 1)  # as the projections give it: batch-first
    with OpNames() as backward:
        y.backward(g)
    assert x.grad.is_contiguous() and x.grad.dtype == dtype and torch.equal(x.grad, g.to(dtype))
    writes = {"_to_copy", "copy_", "clone", "contiguous"}
    assert len([n for n in forward.names if n in writes]) == 1, forward.names
    assert len([n for n in backward.names if n in writes]) == 1, backward.names


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


@pytest.mark.parametrize("dtype, autocast", [(torch.float32, torch.float16), (torch.float16, None),
                                             (torch.float32, None)], ids=["amp", "fp16", "float32"])
def test_the_causal_layer_hands_fla_its_own_layout(monkeypatch, dtype, autocast):
    """q, k, v and beta reach fla's kernel contiguous in [B, T, H, D] (its input guard copies nothing), and its
    output reaches the output projection without a copy: the forward pass lays x out once and copies nothing
    else; under autocast (--amp) as with the model cast (fairseq's --fp16; --bf16 the same in bfloat16, which
    fla.py refuses on the CPU) and in float32."""
    seen = {}

    def kernel(q, k, v, beta, *args, **kwargs):  # fla's chunk kernel, or its recurrent one (float32)
        seen.update(q=q, k=k, v=v, beta=beta)
        return q + k + v * beta.unsqueeze(-1), q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])

    monkeypatch.setattr(fla, "kernels", lambda: {("delta", "chunk"): kernel, ("delta", "recurrent"): kernel})
    monkeypatch.setattr(fla, "INTERPRETER_OPEN", [True])  # fla's backend takes these CPU tensors
    layer = FastWeightAttention(AttentionOptions(32, 4, update_rule="delta", backend="fla")).to(dtype)
    x = torch.randn(9, 3, 32).to(dtype)
    with OpNames() as forward, torch.autocast("cpu", dtype=autocast or torch.float16, enabled=autocast is not None):
        out, _ = layer(x, x, x)
    assert all(seen[name].is_contiguous() for name in ("q", "k", "v", "beta"))
    assert [seen[name].shape for name in ("q", "beta")] == [(3, 9, 4, 8), (3, 9, 4)]
    casts = 2 * 5 if autocast else 0  # autocast's casts of each of the 5 linears' weight and bias
    assert forward.names.count("copy_") == 1 and forward.names.count("_to_copy") == casts  # x, laid out once
    assert "clone" not in forward.names
    assert out.shape == x.shape


def test_a_projection_with_a_hook_runs_as_a_module():
    """project_all computes the linears itself; a hook on one (a user's, or pruning's) still sees its call."""
    layer = FastWeightAttention(AttentionOptions(32, 4, update_rule="delta", backend="chunked"))
    calls = []
    layer.k_proj.register_forward_hook(lambda module, inputs, output: calls.append(output.shape))
    x = torch.randn(9, 3, 32, requires_grad=True)
    layer(x, x, x)[0].sum().backward()
    assert calls == [(9, 3, 32)] and x.grad is not None


# -- the fused glue against its composition (layouts.unfused): maps of a user's own, hooks, higher-order autograd --


def glue_layer(feature_map="linear", qk_norm="sum", backend="reference", seed=0, update_rule="delta"):
    torch.manual_seed(seed)
    return FastWeightAttention(AttentionOptions(32, 4, update_rule=update_rule, feature_map=feature_map,
                                                qk_norm=qk_norm, backend=backend)).double()


def test_a_subclass_of_the_linear_map_runs_its_own_forward():
    """The fused elu + 1 is the built-in map's: a subclass's own forward runs, under every normalisation."""
    from fairseq_fwp.modules.feature_maps import LinearFeatureMap

    class Doubled(LinearFeatureMap):
        def forward(self, x):
            return super().forward(2 * x)

    x = torch.randn(9, 3, 32, dtype=torch.float64)
    for qk_norm, rule in (("sum", "delta"), ("l2", "delta"), ("none", "sum")):
        plain, own = glue_layer(qk_norm=qk_norm, update_rule=rule), glue_layer(qk_norm=qk_norm, update_rule=rule)
        own.feature_map = Doubled(own.head_dim)
        with unfused():
            want = own(x, x, x)[0]
        got = own(x, x, x)[0]
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert (got - plain(x, x, x)[0]).abs().max() > 1e-3, f"{qk_norm}: the subclass's forward did not run"


def test_hooks_see_every_projection_called_on_fairseqs_shape():
    """A full backward hook on k_proj and a global forward hook see the projections' calls, on [T, B, C] even
    where the input lies batch-first in memory; the outputs and gradients are the fused glue's."""
    layer = glue_layer()
    x = torch.randn(3, 6, 32, dtype=torch.float64).transpose(0, 1).requires_grad_()  # [T=6, B=3, C], batch-first
    want_out = layer(x, x, x)[0]
    want_grad = torch.autograd.grad(want_out.sum(), x)[0]
    backward, shapes = [], []
    handles = [layer.k_proj.register_full_backward_hook(lambda module, gi, go: backward.append(1)),
               torch.nn.modules.module.register_module_forward_hook(
                   lambda module, inputs, output: shapes.append(tuple(inputs[0].shape))
                   if isinstance(module, nn.Linear) else None)]
    try:
        out = layer(x, x, x)[0]
        grad = torch.autograd.grad(out.sum(), x)[0]
    finally:
        for handle in handles:
            handle.remove()
    assert backward == [1] and shapes == [(6, 3, 32)] * 5  # q, k, v, beta, the output projection
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("feature_map, qk_norm", [("linear", "sum"), ("dpfp", "sum"), ("silu", "l2")])
def test_a_gradient_penalty_is_its_compositions(feature_map, qk_norm):
    """Second derivatives through the fused glue (its Functions differentiate twice) in float64: those of its
    composition."""
    x = torch.randn(7, 2, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True)

    def penalty_gradient(layer):
        g = torch.autograd.grad(layer(x, x, x)[0].pow(2).sum(), [x, *layer.parameters()], create_graph=True)
        return torch.autograd.grad(sum(t.pow(2).sum() for t in g), [x, *layer.parameters()])

    layer = glue_layer(feature_map, qk_norm)
    with unfused():
        want = penalty_gradient(layer)
    for got, expected in zip(penalty_gradient(layer), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def test_forward_mode_and_torch_func_run_the_composition_and_the_reference():
    """Forward-mode AD, torch.func.grad and per-sample gradients (vmap of grad) through the layer, with --fwp-backend
    auto: the glue's composition and the reference backend run, and give what reverse-mode autograd gives."""
    import torch.autograd.forward_ad as forward_ad
    from torch.func import functional_call, grad, vmap

    layer = glue_layer(backend="auto")
    x = torch.randn(6, 3, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    tangent = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(x, tangent)
        jvp = forward_ad.unpack_dual(layer(dual, dual, dual)[0]).tangent
    reference = glue_layer(backend="reference")  # the same parameters; reverse mode twice needs its backward
    want_jvp = torch.autograd.functional.jvp(lambda t: reference(t, t, t)[0], x, tangent)[1]
    torch.testing.assert_close(jvp, want_jvp, rtol=1e-9, atol=1e-12)

    parameters = {name: p.detach() for name, p in layer.named_parameters()}
    got = grad(lambda p: functional_call(layer, p, (x, x, x))[0].sum())(parameters)
    want = torch.autograd.grad(layer(x, x, x)[0].sum(), list(layer.parameters()))
    for name, expected in zip(parameters, want, strict=True):
        torch.testing.assert_close(got[name], expected, rtol=1e-9, atol=1e-12)

    per_sample = vmap(grad(lambda p, row: functional_call(layer, p, (row.unsqueeze(1),) * 3)[0].sum()),
                      in_dims=(None, 1))(parameters, x)
    first = torch.autograd.grad(layer(x[:, :1], x[:, :1], x[:, :1])[0].sum(), layer.q_proj.weight)[0]
    torch.testing.assert_close(per_sample["q_proj.weight"][0], first, rtol=1e-9, atol=1e-12)


def test_a_kernel_asked_for_a_second_derivative_says_which_backend_gives_it():
    from fairseq_fwp.ops import BackendUnavailableError

    layer = glue_layer(backend="chunked")
    x = torch.randn(6, 2, 32, dtype=torch.float64, requires_grad=True)
    with pytest.raises(BackendUnavailableError, match=r"'chunked' cannot differentiate this call twice.*"
                                                      r"--fwp-backend reference"):
        torch.autograd.grad(layer(x, x, x)[0].pow(2).sum(), x, create_graph=True)  # its backward, recorded
    with pytest.raises(BackendUnavailableError, match=r"--fwp-backend chunked.*forward-mode AD or a torch.func"):
        torch.func.jvp(lambda t: layer(t, t, t)[0], (x.detach(),), (torch.ones_like(x),))
