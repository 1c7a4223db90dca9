"""The ops beyond what tests/properties/test_op_properties.py holds every call to: gradcheck, chunk sizes, chained calls,
dtypes and autocast, bad input, the choice of backend and the decoding memory."""
import dataclasses

import pytest
import torch

from fairseq_fwp.ops import BACKENDS, BackendUnavailableError, fast_weight_delta, fast_weight_sum
from fairseq_fwp.ops.chunked import DEFAULT_CHUNK_SIZE
from helpers import assert_all_close, make_decay, make_inputs, outputs_and_grads, recurrence, run_op

FAST_BACKENDS = ["chunked"]
RULES = ["sum", "delta"]
C = DEFAULT_CHUNK_SIZE


@pytest.mark.parametrize("backend", ["reference"] + FAST_BACKENDS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("T", [1, 5])
def test_gradcheck(backend, rule, T):
    q, k, v, beta, W0 = make_inputs(1, 2, T, 3, 2)

    def fn(q, k, v, beta, W0):
        return run_op(rule, [q, k, v, beta, W0], backend)

    assert torch.autograd.gradcheck(fn, (q, k, v, beta, W0))


def test_gradcheck_chunked_across_chunks(monkeypatch):
    """A small chunk size so that gradcheck crosses several chunk borders."""
    import fairseq_fwp.ops.chunked as chunked

    q, k, v, beta, W0 = make_inputs(1, 1, 11, 3, 2)
    for rule, fn in [
        ("sum", lambda q, k, v, b, W: chunked.fast_weight_sum_chunked(q, k, v, W, chunk_size=4)),
        ("delta", lambda q, k, v, b, W: chunked.fast_weight_delta_chunked(q, k, v, b, W, chunk_size=4)),
    ]:
        assert torch.autograd.gradcheck(fn, (q, k, v, beta, W0)), rule


@pytest.mark.parametrize("chunk_size", [1, 3, 16])
@pytest.mark.parametrize("rule", RULES)
def test_chunk_sizes(chunk_size, rule):
    import fairseq_fwp.ops.chunked as chunked

    inputs = make_inputs(2, 1, 21, 4, 6)
    want = outputs_and_grads(rule, inputs, "reference")
    q, k, v, beta, W0 = inputs
    if rule == "sum":
        out, W = chunked.fast_weight_sum_chunked(q, k, v, W0, chunk_size=chunk_size)
    else:
        out, W = chunked.fast_weight_delta_chunked(q, k, v, beta, W0, chunk_size=chunk_size)
    torch.testing.assert_close(out, want["out"], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(W, want["state"], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("backend", ["reference"] + FAST_BACKENDS)
@pytest.mark.parametrize("rule", RULES)
def test_chaining_equals_one_call(backend, rule):
    """[0:t] then [t:T] with the carried state == one call, outputs and gradients."""
    T, t = 2 * C + 5, C + 2
    inputs = make_inputs(2, 2, T, 6, 4)
    want = outputs_and_grads(rule, inputs, backend)

    def in_two_calls(q, k, v, beta, W0):
        out1, W1 = run_op(rule, [q[:, :, :t], k[:, :, :t], v[:, :, :t], beta[:, :, :t], W0], backend)
        out2, W2 = run_op(rule, [q[:, :, t:], k[:, :, t:], v[:, :, t:], beta[:, :, t:], W1], backend)
        return torch.cat([out1, out2], dim=2), W2

    assert_all_close(outputs_and_grads(rule, inputs, in_two_calls), want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_accumulate_in_float32(rule, dtype):
    half = [x.detach().to(dtype).requires_grad_() for x in make_inputs(1, 2, C + 9, 8, 8)]
    # The same (rounded) inputs computed in float32: only the output rounding may differ.
    want_out, want_W = run_op(rule, [x.detach().float() for x in half], "reference")
    out, W = run_op(rule, half, "auto")
    assert out.dtype == dtype
    assert W.dtype == torch.float32  # carried state keeps full precision
    torch.testing.assert_close(out.float(), want_out, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(W, want_W, rtol=1e-4, atol=1e-4)
    out.float().sum().backward()
    used = half if rule == "delta" else half[:3] + half[4:]
    assert all(x.grad is not None and x.grad.dtype == dtype for x in used)
    # the returned float32 state can be carried into the next half call
    out2, _ = run_op(rule, [x.detach() for x in half[:4]] + [W.detach()], "auto")
    assert out2.dtype == dtype and torch.isfinite(out2.float()).all()


@pytest.mark.parametrize("backend", ["reference"] + FAST_BACKENDS)
@pytest.mark.parametrize("rule", RULES)
def test_mixed_dtypes_are_computed_in_the_widest(backend, rule):
    """Under autocast phi(q), phi(k) can be float32 beside float16 values and beta:
    computed as if every input had the widest dtype, which the output keeps."""
    q, k, v, beta, W0 = make_inputs(1, 2, C + 3, 8, 6, dtype=torch.float32)
    v16, beta16 = (x.detach().half().requires_grad_() for x in (v, beta))
    out, W = run_op(rule, [q, k, v16, beta16, W0], backend)
    want_out, want_W = run_op(rule, [q, k, v16.float(), beta16.float(), W0], "reference")
    assert out.dtype == torch.float32 and W.dtype == torch.float32
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(W, want_W, rtol=1e-4, atol=1e-4)
    used = [v16, beta16] if rule == "delta" else [v16]
    grads = torch.autograd.grad(out.sum() + W.sum(), used)
    assert [g.dtype for g in grads] == [torch.float16] * len(used)
    # bfloat16 beside float16 has no common half type: float32
    out, _ = run_op(rule, [x.detach().bfloat16() for x in (q, k)] + [v16.detach(), beta16.detach(), None], backend)
    assert out.dtype == torch.float32


@pytest.mark.parametrize("backend", ["reference"] + FAST_BACKENDS)
@pytest.mark.parametrize("rule", RULES)
def test_under_autocast_inputs_take_the_autocast_dtype(backend, rule):
    """Like a matmul under autocast: inputs rounded to bfloat16, accumulated in float32."""
    inputs = make_inputs(1, 2, C + 3, 8, 6, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, W = run_op(rule, inputs, backend)
    rounded = [x.detach().bfloat16().float() for x in inputs[:4]] + [inputs[4].detach()]
    want_out, want_W = run_op(rule, rounded, "reference")
    assert out.dtype == torch.bfloat16 and W.dtype == torch.float32
    torch.testing.assert_close(out.float(), want_out, rtol=1e-2, atol=1e-2 * want_out.abs().max().item())
    torch.testing.assert_close(W, want_W, rtol=1e-4, atol=1e-4)


def test_zero_initial_state_is_default():
    inputs = make_inputs(1, 1, 9, 4, 4, with_state=False)
    out_none, W_none = run_op("delta", inputs, "chunked")
    inputs[4] = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    out_zero, W_zero = run_op("delta", inputs, "chunked")
    torch.testing.assert_close(out_none, out_zero)
    torch.testing.assert_close(W_none, W_zero)


def test_delta_with_beta_one_replaces_the_value():
    """Eq. 24 with beta = 1 and a unit key: reading that key returns the new value exactly."""
    k = torch.zeros(1, 1, 2, 3, dtype=torch.float64)
    k[..., 0] = 1.0
    v = torch.tensor([[[[1.0, 2.0], [5.0, -1.0]]]], dtype=torch.float64)
    beta = torch.ones(1, 1, 2, dtype=torch.float64)
    for backend in ["reference"] + FAST_BACKENDS:
        out, W = fast_weight_delta(k, k, v, beta, backend=backend)
        torch.testing.assert_close(out[0, 0, 1], v[0, 0, 1])
        torch.testing.assert_close(W[0, 0] @ k[0, 0, 1], v[0, 0, 1])


def test_unknown_backend_lists_choices():
    q, k, v, beta, _ = make_inputs(1, 1, 3, 2, 2)
    with pytest.raises(ValueError, match="backend must be one of auto, reference, chunked, cuda, fla"):
        fast_weight_sum(q, k, v, backend="fast")
    assert BACKENDS == ("auto", "reference", "chunked", "cuda", "fla")


def test_cuda_backend_unavailable_says_what_to_do():
    q, k, v, beta, _ = make_inputs(1, 1, 3, 2, 2)
    with pytest.raises(BackendUnavailableError, match="backend='auto' runs every call"):
        fast_weight_delta(q, k, v, beta, backend="cuda")


@pytest.mark.parametrize(
    "bad, name",
    [
        (dict(q=torch.zeros(2, 3, 4)), "q"),
        (dict(k=torch.zeros(1, 2, 5, 3)), "k"),
        (dict(v=torch.zeros(1, 2, 4, 3, 1)), "v"),
        (dict(v=torch.zeros(1, 2, 3, 3)), "v"),
        (dict(beta=torch.zeros(1, 2, 5)), "beta"),
        (dict(state=torch.zeros(1, 2, 3, 7)), "state"),
        (dict(k=torch.zeros(1, 2, 4, 3, dtype=torch.int64)), "k"),
        (dict(beta=torch.zeros(1, 2, 4, dtype=torch.int64)), "beta"),
    ],
)
def test_bad_shapes_name_the_tensor(bad, name):
    args = dict(
        q=torch.zeros(1, 2, 4, 3), k=torch.zeros(1, 2, 4, 3), v=torch.zeros(1, 2, 4, 5),
        beta=torch.zeros(1, 2, 4), state=torch.zeros(1, 2, 5, 3),
    )
    args.update(bad)
    with pytest.raises(ValueError, match=rf"^{name} "):
        fast_weight_delta(args["q"], args["k"], args["v"], args["beta"], args["state"])


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("T", [5, 2 * C + 3])  # one chunk (the zero-state shortcuts) and several
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("used", ["out", "state"])
def test_gradients_when_only_one_output_is_used(backend, rule, T, with_state, used):
    """An unused output gets no gradient from autograd (None): the backward must not need it."""
    inputs = make_inputs(2, 1, T, 6, 4, with_state=with_state)
    wrt = [x for x in inputs if x is not None and (rule == "delta" or x is not inputs[3])]

    def grads(name):
        out, W = run_op(rule, inputs, name)
        grads = torch.autograd.grad((out if used == "out" else W).pow(2).sum(), wrt, allow_unused=True)
        return [torch.zeros_like(x) if g is None else g for x, g in zip(wrt, grads)]  # q cannot reach W

    for got, want in zip(grads(backend), grads("reference")):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def oracle_steps(rule, W, q, k, v, beta=None, decay=None):
    """Each token's output and W after it, from the paper's recurrence (helpers.recurrence), one call per
    token: what a decoder must produce step by step."""
    run = recurrence(rule)
    one = lambda x: None if x is None else x.unsqueeze(2)  # noqa: E731
    out, W = run(one(q), one(k), one(v), one(beta), W, one(decay))
    return out[:, :, 0], W


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_in_place_decoding_steps_equal_the_recurrence(rule, dtype):
    """ops/memory.py: W advanced in place by the rule's own step, token after token."""
    from fairseq_fwp.ops import Memory, fast_weight_step_

    q, k, v, beta, W0 = (x.detach() for x in make_inputs(3, 2, 6, 7, 5))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    W_ref, memory = W0.to(acc), Memory(fast_weight=W0.to(acc).clone())
    for t in range(6):
        q_t, k_t, v_t, b_t = (x[:, :, t].to(dtype) for x in (q, k, v, beta))
        b_t = b_t if rule == "delta" else None
        want, W_ref = oracle_steps(rule, W_ref, *(None if x is None else x.to(acc) for x in (q_t, k_t, v_t, b_t)))
        got = fast_weight_step_(memory, q_t, k_t, v_t, b_t, backend="chunked")
        tolerance = 1e-12 if dtype == torch.float64 else 1e-5
        rounding = 2 ** -8 if dtype == torch.bfloat16 else tolerance  # the output comes in the inputs' dtype
        assert got.dtype == dtype
        torch.testing.assert_close(got.to(acc), want, rtol=rounding, atol=rounding)
        torch.testing.assert_close(memory.materialized(), W_ref, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("rule", RULES)
def test_factored_decoding_steps_equal_the_recurrence_through_growth_and_reorders(rule):
    """From an empty memory, W held as its factors (keys, writes) in buffers that grow and follow beam-search
    reorders, until W is the smaller form (32 tokens at D = Dv = 64)."""
    from fairseq_fwp.ops import Memory, fast_weight_step_
    from fairseq_fwp.ops.memory import factored_length_limit

    q, k, v, beta, _ = (None if x is None else x.detach() for x in make_inputs(3, 2, 40, 64, 64, with_state=False))
    W_ref = torch.zeros(3, 2, 64, 64, dtype=torch.float64)
    memory = Memory()
    for t in range(40):
        b = beta[:, :, t] if rule == "delta" else None
        want, W_ref = oracle_steps(rule, W_ref, q[:, :, t], k[:, :, t], v[:, :, t], b)
        got = fast_weight_step_(memory, q[:, :, t], k[:, :, t], v[:, :, t], b, backend="chunked")
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(memory.materialized(), W_ref, rtol=1e-12, atol=1e-12)
        assert memory.is_factored == (t + 1 < 32)
        order = torch.tensor([2, 0, 0])  # beam search: row 0 continues row 2, rows 1 and 2 continue row 0
        memory.reorder_(order)
        W_ref, q, k, v, beta = (x[order] for x in (W_ref, q, k, v, beta))
    assert factored_length_limit(256, 64) == 51 and factored_length_limit(64, 64) == 32


@pytest.mark.parametrize("rule", RULES)
def test_decoding_steps_of_the_gated_rules(rule):
    """In place (from a given W) and factored (from an empty memory), with a decay."""
    from fairseq_fwp.ops import Memory, fast_weight_step_

    q, k, v, beta, W0 = (x.detach() for x in make_inputs(2, 2, 6, 5, 3))
    decay = 0.5 + 0.5 * torch.rand(2, 2, 6, dtype=torch.float64)
    decay[:, :, 3] = 0  # a full forget
    for start in (W0, None):
        W_ref = torch.zeros_like(W0) if start is None else start.clone()
        memory = Memory(fast_weight=None if start is None else start.clone())
        for t in range(6):
            args = (q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t] if rule == "delta" else None)
            want, W_ref = oracle_steps(rule, W_ref, *args, decay[:, :, t])
            got = fast_weight_step_(memory, *args, log_decay=decay[:, :, t].log(), backend="chunked")
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(memory.materialized(), W_ref, rtol=1e-12, atol=1e-12)


# -- the backend protocol: one resolver, and one decoding step per backend ----------------


def test_auto_says_what_it_chose_and_why_and_named_backends_are_refused_in_one_format():
    from fairseq_fwp.ops import update_rule
    from fairseq_fwp.ops.backends import Call, resolve

    q, k, v, beta, _ = make_inputs(1, 2, 3, 4, 4, dtype=torch.float32)
    choices = []
    fast_weight_delta(q, k, v, beta, on_choice=choices.append)
    assert [c.name for c in choices] == ["chunked"]
    assert choices[0].reason.startswith("auto on cpu torch.float32, D = 4, rule delta; not fla: cpu tensors")
    call = Call(rule=update_rule("gated-sum"), dtype=torch.float32, device=torch.device("cpu"), D=4, Dv=4, T=3,
                needs_grad=True)
    with pytest.raises(BackendUnavailableError,
                       match=r"^backend 'cuda' cannot run this call: it has no kernel for the update rule 'gated-sum'; "
                             r"backend='auto' runs every call$"):
        resolve("cuda", call)


def test_a_memory_keeps_its_backend_choice_while_the_flag_and_the_call_stay_the_same():
    """One decoding resolves its backend once, and again whenever the flag or the call changes."""
    from fairseq_fwp.ops import Memory, update_rule
    from fairseq_fwp.ops.backends import Call, resolve

    asked = []

    def counting_resolve(name, call):
        asked.append((name, call.dtype))
        return resolve(name, call)

    call = Call(rule=update_rule("sum"), dtype=torch.float32, device=torch.device("cpu"), D=4, Dv=4, T=1,
                needs_grad=False)
    memory = Memory()
    for _ in range(3):
        assert memory.backend_for("auto", call, counting_resolve).name == "chunked"
    assert memory.backend_for("reference", call, counting_resolve).name == "reference"
    wider = dataclasses.replace(call, dtype=torch.float64)
    assert memory.backend_for("reference", wider, counting_resolve).name == "reference"
    assert asked == [("auto", torch.float32), ("reference", torch.float32), ("reference", torch.float64)]


@pytest.mark.parametrize("backend", ["reference", "chunked", "auto"])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("gated", [False, True])
def test_under_autocast_a_decoding_step_rounds_as_the_sequence_op(backend, rule, gated):
    """One autocast rule for the sequence ops and the step: inputs rounded to the autocast dtype, float32
    accumulation, the output in the autocast dtype. Token by token equals one call over the sequence to
    within one rounding of bfloat16 (2^-8 of each value)."""
    from fairseq_fwp.ops import Memory, fast_weight_step_

    q, k, v, beta, W0 = (x.detach() for x in make_inputs(2, 2, 40, 6, 5, dtype=torch.float32))
    log_decay = make_decay(2, 2, 40, dtype=torch.float32).detach().log() if gated else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, W_want = run_op(rule, [q, k, v, beta, W0], backend, log_decay=log_decay)
        memory = Memory(fast_weight=W0.clone())
        got = torch.stack([fast_weight_step_(memory, q[:, :, t], k[:, :, t], v[:, :, t],
                                             beta[:, :, t] if rule == "delta" else None, backend=backend,
                                             log_decay=None if log_decay is None else log_decay[:, :, t])
                           for t in range(40)], 2)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -8, atol=1e-6)
    torch.testing.assert_close(memory.materialized(), W_want, rtol=1e-5, atol=1e-5)
