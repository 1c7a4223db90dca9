"""The rules with a decay per key channel (GLA, KDA, GDN-2; rules/channels.py) against their recurrences written
out here in float64, on every backend that runs them: outputs, final state and the gradient of every input
(the decay and the gates included), with and without a state, at odd sizes, full forgets included."""
import pytest
import torch

from fairseq_fwp.ops import fast_weight, fast_weight_state, fast_weight_step_, fla, Memory
from fairseq_fwp.testing import triton_interpreter
from cuda_stand_in import on_gpu_and_stand_in
from helpers import assert_all_close, build_lm_model, relative_errors

RULES = ("gla", "kda", "gdn2")
# (B, H, T, D, Dv): D != Dv, T not a multiple of the chunks (16; 8 in float64), one step
SHAPES = [(2, 3, 37, 8, 5), (1, 2, 70, 16, 12), (2, 1, 1, 4, 4)]


def recurrence(rule, q, k, v, beta, log_decay, W0):
    """recurrence_of the decay a_t = exp(log a_t), 0 at -inf."""
    return recurrence_of(rule, q, k, v, beta, log_decay.exp(), W0)


def recurrence_of(rule, q, k, v, beta, decay, W0):
    """W [Dv, D] per row and head: W <- W Diag(a_t), then GLA W += v k^T; KDA vbar = W k, W += beta (v - vbar)
    k^T; GDN-2 vbar = W (b * k), W += (w * v - vbar) k^T; out_t = W q_t; the decay a_t a plain multiplier."""
    B, H, T, D = q.shape
    W = q.new_zeros(B, H, v.shape[-1], D) if W0 is None else W0
    outs = []
    for t in range(T):
        qt, kt, vt = q[:, :, t], k[:, :, t], v[:, :, t]
        W = W * decay[:, :, t].unsqueeze(-2)
        if rule == "gla":
            u = vt
        elif rule == "kda":
            u = beta[:, :, t, None] * (vt - (W @ kt.unsqueeze(-1))[..., 0])
        else:
            b, w = beta[:, :, t, :D], beta[:, :, t, D:]
            u = w * vt - (W @ (b * kt).unsqueeze(-1))[..., 0]
        W = W + u.unsqueeze(-1) * kt.unsqueeze(-2)
        outs.append((W @ qt.unsqueeze(-1))[..., 0])
    return torch.stack(outs, 2), W


def make(rule, B, H, T, D, Dv, dtype=torch.float64, with_state=True, forgets=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, H, T, D, generator=g), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=g)
    beta = None if rule == "gla" else torch.rand(B, H, T, *((D + Dv,) if rule == "gdn2" else ()), generator=g)
    log_decay = -torch.rand(B, H, T, D, generator=g) * 0.5
    if forgets and T > 30:
        log_decay[..., 5, 1] = -float("inf")  # a full forget of one channel
        log_decay[..., 20:24, 2] = -1e4  # far below log(eps^2): full forgets in a row
        log_decay[..., 30, :] = -40.0  # strong, in every channel
    W0 = torch.randn(B, H, Dv, D, generator=g) if with_state else None
    return [None if x is None else x.to(dtype if x is not log_decay else torch.float32 if dtype != torch.float64
                                          else dtype).requires_grad_() for x in (q, k, v, beta, log_decay, W0)]


def results(rule, inputs, run):
    """{"out", "state", "d<name>"} of run(q, k, v, beta, log_decay, W0): fresh gradients of a random loss."""
    out, W = run(*inputs)
    g = torch.Generator().manual_seed(1)
    loss = sum((y.double() * torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.device)).sum()
               for y in (out, W))
    names = [n for n, x in zip(("dq", "dk", "dv", "dbeta", "ddecay", "dstate"), inputs) if x is not None]
    grads = torch.autograd.grad(loss, [x for x in inputs if x is not None])
    return {"out": out.detach(), "state": W.detach(), **dict(zip(names, grads))}


def op(rule, backend):
    return lambda q, k, v, beta, log_decay, W0: fast_weight(rule, q, k, v, beta, W0, log_decay=log_decay,
                                                            backend=backend)


def widened(inputs):
    return [None if x is None else x.detach().double().requires_grad_() for x in inputs]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_float64_equals_the_recurrence(rule, shape, with_state, backend):
    inputs = make(rule, *shape, with_state=with_state, forgets=True)
    got = results(rule, inputs, op(rule, backend))
    want = results(rule, inputs, lambda *x: recurrence(rule, *x))
    assert_all_close(got, want, rtol=1e-10, atol=1e-12)


def test_kda_with_n_writes_per_token_is_deltaproduct_with_a_decay_per_channel():
    B, H, T, N, D, Dv = 2, 2, 21, 2, 8, 5
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, H, T, N, D, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, T, N, Dv, generator=g, dtype=torch.float64)
    beta = 2 * torch.rand(B, H, T, N, generator=g, dtype=torch.float64)  # negative eigenvalues
    log_decay = -torch.rand(B, H, T, D, generator=g, dtype=torch.float64)
    out, W = fast_weight("kda-product", q, k, v, beta, log_decay=log_decay, backend="chunked")
    # the same as KDA over the interleaved writes, the decay at each token's first, the read at its last
    inter = lambda x: x.flatten(2, 3)  # noqa: E731
    queries = torch.cat([torch.zeros_like(q).unsqueeze(3), q.unsqueeze(3)], 3)
    decays = torch.cat([log_decay.unsqueeze(3), torch.zeros_like(log_decay).unsqueeze(3)], 3)
    want, W_want = recurrence("kda", inter(queries), inter(k), inter(v), inter(beta), inter(decays), None)
    torch.testing.assert_close(out, want[:, :, 1::2])
    torch.testing.assert_close(W, W_want)
    torch.testing.assert_close(fast_weight_state("kda-product", k, v, beta, log_decay=log_decay), W_want)


def with_small_decays(log_decay, dtype):
    """log_decay's decays, given as decay= (a leaf), with decays below the exactness threshold of decay.py
    (sqrt(eps)) in different channels at different steps, some exactly 0, and one step small in every channel."""
    decay = log_decay.detach().exp().to(dtype)
    tiny = torch.finfo(dtype).eps ** 0.5 / 3
    decay[..., 1, 0] = 0
    decay[..., 3, 1] = 0
    decay[..., 4, 2] = tiny
    decay[..., 7, 0] = tiny
    decay[..., 7, 3] = 0  # two small channels of one step
    decay[..., 9, :] = tiny  # a step small in every channel
    decay[..., 11, 1] = 0
    return decay.requires_grad_()


@pytest.mark.parametrize("rule", [*RULES, "kda-product"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_small_decays_in_different_channels_get_exact_gradients(rule, dtype):
    """decay= with small decays in different channels: the rules whose writes mix channels (KDA, GDN-2) have no
    channel of their own that such a decay cuts, and still get the gradient of the decay as a plain
    multiplier (as the float64 recurrence gives it)."""
    B, H, T, D, Dv, N = 2, 2, 13, 4, 3, 2
    base = "kda" if rule == "kda-product" else rule
    q, k, v, beta, log_decay, W0 = (None if x is None else x.detach() for x in make(base, B, H, T * N, D, Dv))
    if rule == "kda-product":  # N writes per token: each token's keys, values and strengths in a row
        q, log_decay = q[:, :, :T], log_decay[:, :, :T]
        k, v, beta = (x.unflatten(2, (T, N)) for x in (k, v, beta))
    decay = with_small_decays(log_decay, torch.float64)
    inputs = [None if x is None else x.to(dtype).requires_grad_() for x in (q, k, v, beta, decay, W0)]
    got = results(rule, inputs, lambda q, k, v, beta, a, W0: fast_weight(rule, q, k, v, beta, W0, decay=a,
                                                                         backend="chunked"))
    wide = widened(inputs)
    if rule == "kda-product":  # KDA over the interleaved writes, the decay at each token's first, the read at its last
        def run(q, k, v, beta, a, W0):
            inter = lambda x: x.flatten(2, 3)  # noqa: E731
            out, W = recurrence_of("kda", inter(torch.stack([torch.zeros_like(q), q], 3)), inter(k), inter(v),
                                   inter(beta), inter(torch.stack([a, torch.ones_like(a)], 3)), W0)
            return out[:, :, 1::2], W
    else:
        def run(*x):
            return recurrence_of(rule, *x)
    want = results(rule, wide, run)
    errors = relative_errors(got, want)
    assert max(errors.values()) < (1e-5 if dtype == torch.float32 else 1e-10), errors


@pytest.mark.parametrize("rule", RULES)
def test_the_decoding_step_equals_the_sequence_and_reorders(rule):
    B, H, T, D, Dv = 3, 2, 9, 8, 5
    q, k, v, beta, log_decay, W0 = (None if x is None else x.detach() for x in make(rule, B, H, T, D, Dv))
    out, W = fast_weight(rule, q, k, v, beta, W0, log_decay=log_decay, backend="reference")
    memory = Memory(fast_weight=W0.clone())
    for t in range(T):
        step = fast_weight_step_(memory, q[:, :, t], k[:, :, t], v[:, :, t], None if beta is None else beta[:, :, t],
                                 log_decay=log_decay[:, :, t], rule=rule)
        torch.testing.assert_close(step, out[:, :, t])
    torch.testing.assert_close(memory.materialized(), W)
    empty = Memory()  # from an empty memory: its factors, decayed per channel, then W
    _, W_empty = fast_weight(rule, q, k, v, beta, log_decay=log_decay, backend="reference")
    for t in range(T):
        fast_weight_step_(empty, q[:, :, t], k[:, :, t], v[:, :, t], None if beta is None else beta[:, :, t],
                          log_decay=log_decay[:, :, t], rule=rule)
    torch.testing.assert_close(empty.materialized(), W_empty)
    empty.reorder_(torch.tensor([2, 0, 1]))
    torch.testing.assert_close(empty.materialized(), W_empty[[2, 0, 1]])


@pytest.mark.parametrize("rule", RULES)
def test_fla_through_the_interpreter(rule):
    """fla's chunk kernels in float16 over several steps (with every gradient), and its recurrent kernels in
    float32 (GLA's with gradients; KDA's and GDN-2's are forward only) and for one step."""
    if not fla.interpreting():
        pytest.skip("fla on CPU tensors needs TRITON_INTERPRET=1 (conftest.py sets it without CUDA)")
    with triton_interpreter():
        inputs = make(rule, 1, 2, 37, 16, 8, dtype=torch.float16, forgets=True)
        inputs[5] = inputs[5].detach().float().requires_grad_()  # the state is carried in float32
        got = results(rule, inputs, op(rule, "fla"))
        want = results(rule, widened(inputs), lambda *x: recurrence(rule, *x))
        assert max(relative_errors(got, want).values()) < 5e-3, relative_errors(got, want)
        inputs = make(rule, 1, 2, 21, 16, 8, dtype=torch.float32, forgets=True)
        if rule == "gla":
            got = results(rule, inputs, op(rule, "fla"))
            want = results(rule, widened(inputs), lambda *x: recurrence(rule, *x))
        else:
            with torch.no_grad():
                got = dict(zip(("out", "state"), op(rule, "fla")(*inputs)))
            want = dict(zip(("out", "state"), recurrence(rule, *widened(inputs))))
        assert max(relative_errors(got, want).values()) < 1e-5, relative_errors(got, want)


@pytest.mark.parametrize("rule, flags", [
    ("gla", []), ("kda", []), ("gdn2", []),
    ("kda", ["--fwp-householder-steps", "2", "--fwp-qk-norm", "l2", "--fwp-negative-eigenvalues", "on"]),
    ("gdn2", ["--fwp-qk-norm", "l2", "--fwp-negative-eigenvalues", "on"]),
])
def test_a_language_model_decodes_as_its_full_forward(rule, flags):
    model, d = build_lm_model("--fwp-update-rule", rule, *flags)
    model.eval()
    tokens = torch.randint(d.nspecial, len(d), (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)[0]
        state, steps = {}, []
        for t in range(tokens.shape[1]):
            steps.append(model.decoder(tokens[:, :t + 1], incremental_state=state)[0][:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rule", ["gla", "kda", "gdn2"])
def test_uptraining_starts_as_the_matching_ungated_rule(rule):
    """start_as_ungated: the decay per channel at exp(-1e-4), GDN-2's gates as one write strength per head;
    the layer then computes what the same layer with the ungated rule computes."""
    ungated = {"gla": "sum", "kda": "delta", "gdn2": "delta"}[rule]
    model, d = build_lm_model("--fwp-update-rule", rule)
    twin, _ = build_lm_model("--fwp-update-rule", ungated)
    for layer in model.decoder.layers:
        layer.self_attn.start_as_ungated()
    state = {name: x for name, x in model.state_dict().items()}
    twin_state = twin.state_dict()
    for name in twin_state:  # the twin takes every shared parameter, beta's from GDN-2's first channel of a head
        twin_state[name] = state[name] if state[name].shape == twin_state[name].shape else \
            state[name].view(twin_state[name].shape[0], -1, *state[name].shape[1:])[:, 0]
    twin.load_state_dict(twin_state)
    tokens = torch.randint(d.nspecial, len(d), (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model.eval()(tokens)[0], twin.eval()(tokens)[0]
    assert (got - want).abs().max() / want.abs().max() < 1e-3


@on_gpu_and_stand_in("rule, dtype, shape",
                     [(r, d, (2, 12, 200, 64, 64)) for r in RULES for d in (torch.float16, torch.bfloat16)],
                     [("gla", torch.bfloat16, (1, 2, 40, 16, 8)), ("gdn2", torch.float16, (1, 2, 40, 16, 8))])
def test_gpu_fla_matches_the_recurrence(gpu, rule, dtype, shape):
    """fla's chunk kernels on a GPU, in half types, with every gradient (and auto picks them there)."""
    from fairseq_fwp.ops.backends import resolved_name

    inputs = [None if x is None else x.detach().cuda().requires_grad_()
              for x in make(rule, *shape, dtype=dtype, forgets=True)]
    inputs[5] = inputs[5].detach().float().requires_grad_()
    got = results(rule, inputs, op(rule, "fla"))
    want = results(rule, widened(inputs), lambda *x: recurrence(rule, *x))
    assert max(relative_errors(got, want).values()) < 3e-2, relative_errors(got, want)
    assert resolved_name("auto", inputs[0], shape[-1], rule=rule) == "fla"
