"""The public fast-weight ops: an update rule (rules/) over a sequence, its final state alone, and one
decoding step; fast_weight_sum and fast_weight_delta are the paper's two rules (gated where a decay is
given). backends.py picks the backend that runs each call.

The ops take already feature-mapped queries and keys and apply no
normalisation: the paper's Eqs. 17/11 (sum) and 20/24/25 (delta). Half-precision inputs are computed in float32 (the cuda and fla
kernels read them as they are and accumulate in float32) and the output is
returned in the input dtype; the returned state stays in the accumulation
dtype (float32, or float64 for float64 inputs) so that carried state does
not lose precision from one segment to the next. Inputs of mixed floating
dtypes (float32 features beside float16 values, as autocast makes them) are
computed as if all had the widest of them, and under autocast as if all had
the autocast dtype; that is also the output's dtype (_compute_dtype).
"""
import contextlib

import torch

from .backends import Call, resolve
from .decay import run_with_decay
from .decay_columns import ColumnReads
from .rules import rule_for, update_rule
from .validation import check_inputs, check_step_inputs


def accumulation_dtype(dtype):
    """float64 stays float64; everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _compute_dtype(tensors):
    """The dtype the inputs are computed in.

    Under autocast the ops act like a matmul: float32 and half inputs are
    taken in the autocast dtype (float64 opts out, as in torch); otherwise
    mixed floating inputs (float32 features beside float16 values) are
    computed in the widest of their dtypes. Either way the kernels
    accumulate in float32 and the output has this dtype.
    """
    device_type = tensors[0].device.type
    dtypes = [x.dtype for x in tensors if x is not None]
    if torch.is_autocast_enabled(device_type) and torch.float64 not in dtypes:
        return torch.get_autocast_dtype(device_type)
    dtype = dtypes[0]
    for other in dtypes[1:]:
        dtype = torch.promote_types(dtype, other)
    return dtype


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def _prepare(rule, q, k, v, beta, state, log_decay, backend, on_choice, needs_grad):
    """Picks the backend. Returns (the call, the choice, [q, k, v, beta] as the backend reads them, the state
    and log_decay in the accumulation dtype (or None))."""
    dtype = _compute_dtype([q, k, v, beta])
    call = Call.of(rule, q, v, dtype, needs_grad)
    choice = resolve(backend, call)
    if on_choice is not None:
        on_choice(choice)
    acc = call.accumulation_dtype
    state, log_decay = (None if x is None else x.to(acc) for x in (state, log_decay))
    return call, choice, _rounded((q, k, v, beta), call, choice), state, log_decay


def _rounded(tensors, call, choice):
    """The inputs as the backend reads them: rounded to the dtype they are computed in (under autocast
    its dtype), then in the accumulation dtype unless the backend reads half types itself. The sequence
    ops and the decoding step round alike, so that decoding token by token equals a full forward."""
    computed = call.dtype if choice.backend.reads_half_types else call.accumulation_dtype

    def rounded(x):
        if x is None:
            return None
        x = x if x.dtype == call.dtype else x.to(call.dtype)
        return x if x.dtype == computed else x.to(computed)

    return [rounded(x) for x in tensors]


def _zero_state(k, v, dtype):
    return k.new_zeros(*k.shape[:2], v.shape[-1], k.shape[-1], dtype=accumulation_dtype(dtype))


def _run(rule, q, k, v, beta, state, log_decay, backend, on_choice, needs_grad):
    call, choice, (q, k, v, beta), state, log_decay = _prepare(rule, q, k, v, beta, state, log_decay, backend,
                                                               on_choice, needs_grad)
    if call.T == 0:  # one output per query (a rule with N writes per token has N values per token)
        out = v.new_zeros(*q.shape[:-1], v.shape[-1], dtype=call.dtype)
        return out, _zero_state(k, v, call.dtype) if state is None else state
    with torch.autocast(q.device.type, enabled=False):  # the backends choose their own precision
        out, W = choice.kernel.sequence(call, q, k, v, beta, state, log_decay)
    return out.to(call.dtype), W


def _run_state(rule, q, k, v, beta, state, log_decay, backend, on_choice, needs_grad):
    """As _run, the final state only (q, the keys' stand-in, is not read)."""
    call, choice, (_, k, v, beta), state, log_decay = _prepare(rule, q, k, v, beta, state, log_decay, backend,
                                                               on_choice, needs_grad)
    if call.T == 0:
        return _zero_state(k, v, call.dtype) if state is None else state
    with torch.autocast(k.device.type, enabled=False):
        return choice.kernel.final_state(call, k, v, beta, state, log_decay)


def _check_rule_inputs(rule, beta, gated):
    """What `rule` takes: beta where it has a write strength, a decay where it is gated."""
    if bool(rule.write_strength) != (beta is not None):
        raise ValueError(f"the update rule {rule.name!r} " + ("needs beta" if rule.write_strength else
                                                             "takes no beta"))
    if bool(rule.decay) != gated:
        raise ValueError(f"the update rule {rule.name!r} " + ("needs a decay (decay= or log_decay=)" if rule.decay
                                                             else "takes no decay"))


def _checked_call(run, rule, q, k, v, beta, state, decay, log_decay, backend, on_choice):
    """Checks the inputs, then run(...) with the gate as its log (decay.py: exact gradients at a = 0).

    Whether the call needs gradients is decided here, once: decay.py may run the forward without
    autograd and the backward in a second pass, and both must pick the backend a training call gets
    (one with a backward pass), never one that would fail, or differ, in backward()."""
    rule = update_rule(rule) if rule is not None else rule_for(beta, decay if decay is not None else log_decay)
    check_inputs(q, k, v, beta, state, decay, log_decay, rule.substeps, rule.decay == "channels",
                 rule.write_strength == "channels")
    _check_rule_inputs(rule, beta, decay is not None or log_decay is not None)
    needs_grad = _needs_grad(q, k, v, beta, state, decay, log_decay)
    if decay is None:
        return run(rule, q, k, v, beta, state, log_decay, backend, on_choice, needs_grad)
    decay = decay.to(accumulation_dtype(_compute_dtype([q, k, v, beta])))
    columns = None if rule.write_form is None else ColumnReads(
        rule.write_form, lambda log, *tensors: _run(rule, *tensors, log, backend, None, needs_grad)[0])
    return run_with_decay(lambda log, *tensors: run(rule, *tensors, log, backend, on_choice, needs_grad), decay,
                          (q, k, v, beta, state), columns)


def fast_weight(rule, q, k, v, beta=None, state=None, *, decay=None, log_decay=None, backend="auto",
                on_choice=None):
    """Any registered update rule (rules/) over a sequence: fast_weight_sum and fast_weight_delta are the
    built-ins. rule: its name (--fwp-update-rule's value); the other arguments and the result as in
    fast_weight_delta (beta where the rule has a write strength, a decay where it is gated)."""
    return _checked_call(_run, rule, q, k, v, beta, state, decay, log_decay, backend, on_choice)


def fast_weight_delta_product(q, k, v, beta, state=None, *, decay=None, log_decay=None, backend="auto",
                              on_choice=None):
    """DeltaProduct (Siems et al., 2025): N delta-rule writes per token, in order, then the read (Eqs. 20,
    24, 25 per write); with a decay, the gated form (the decay once per token, before its first write).

    k ``[B, H, T, N, D]``, v ``[B, H, T, N, Dv]``, beta ``[B, H, T, N]`` (in (0, 2): beyond 1 the transition's
    eigenvalues reach [-1, 1]); the rest as fast_weight_delta. N = 1 is the delta rule."""
    rule = "gated-delta-product" if decay is not None or log_decay is not None else "delta-product"
    return fast_weight(rule, q, k, v, beta, state, decay=decay, log_decay=log_decay, backend=backend,
                       on_choice=on_choice)


def fast_weight_state(rule, k, v, beta=None, state=None, *, decay=None, log_decay=None, backend="auto",
                      on_choice=None):
    """Any registered update rule's final fast weight alone; see fast_weight and fast_weight_sum_state."""
    return _checked_call(_run_state, rule, _no_query(rule, k), k, v, beta, state, decay, log_decay, backend,
                         on_choice)


def _no_query(rule, k):
    """What the state-only ops check and size the call by in place of the queries, which they do not read:
    the keys ``[B, H, T, D]``, or for a rule with N writes per token the first of each token's N keys."""
    return k[:, :, :, 0] if update_rule(rule).substeps and k.dim() == 5 else k


def fast_weight_sum_state(k, v, state=None, *, decay=None, log_decay=None, backend="auto", on_choice=None):
    """The sum rule's final fast weight alone (Eq. 17): W_T = W_0 + sum_t v_t k_t^T.

    For memories that are written first and read later (the paper's
    synthetic retrieval, or a prompt carried into decoding): no per-step
    outputs are computed. Arguments and gradients as fast_weight_sum.
    """
    return _checked_call(_run_state, None, k, k, v, None, state, decay, log_decay, backend, on_choice)


def fast_weight_delta_state(k, v, beta, state=None, *, decay=None, log_decay=None, backend="auto", on_choice=None):
    """The delta rule's final fast weight alone (Eqs. 20, 24); see fast_weight_sum_state."""
    return _checked_call(_run_state, None, k, k, v, beta, state, decay, log_decay, backend, on_choice)


def fast_weight_sum(q, k, v, state=None, *, decay=None, log_decay=None, backend="auto", on_choice=None):
    """Sum-rule fast weights (Eq. 17, Eq. 11).

    W_t = W_{t-1} + v_t k_t^T;  out_t = W_t q_t.
    With ``decay`` ``[B, H, T]`` (a_t in [0, 1]; 0 is a full forget): W_t = a_t W_{t-1} + v_t k_t^T
    (the gated sum rule); None means 1 everywhere, the paper's rule.

    Args:
        q, k: ``[B, H, T, D]`` feature-mapped queries and keys.
        v: ``[B, H, T, Dv]`` values.
        state: initial fast weight W ``[B, H, Dv, D]``, or None for zeros.
        decay: ``[B, H, T]`` in [0, 1] (0: a full forget), or None.
        log_decay: the same as its log, ``[B, H, T]`` in [-inf, 0] (what gates produce); give one of the two.
        backend: one of ``BACKENDS`` (backends.py picks the one that runs).
        on_choice: called with the backends.Choice that runs the call (the layers log auto's choice).
    Returns:
        ``(out [B, H, T, Dv], W_T [B, H, Dv, D])``. Gradients flow to q, k, v,
        the decay (or its log) and the initial state, exactly also where a_t = 0 (decay.py).

    Activation memory kept for backward: ``reference`` one ``Dv x D`` state per
    step (testing only); ``chunked`` only the inputs; ``cuda`` the inputs and
    one ``Dv x D`` state per 16 steps.
    """
    return _checked_call(_run, None, q, k, v, None, state, decay, log_decay, backend, on_choice)


def fast_weight_delta(q, k, v, beta, state=None, *, decay=None, log_decay=None, backend="auto", on_choice=None):
    """Delta-rule fast weights (Eqs. 20, 24, 25).

    vbar_t = W_{t-1} k_t;  W_t = W_{t-1} + beta_t (v_t - vbar_t) k_t^T;
    out_t = W_t q_t.
    With ``decay`` (the gated delta rule, Gated DeltaNet): vbar_t = a_t W_{t-1} k_t
    and W_t = a_t W_{t-1} + beta_t (v_t - vbar_t) k_t^T.

    Args:
        q, k: ``[B, H, T, D]`` feature-mapped queries and keys.
        v: ``[B, H, T, Dv]`` values.
        beta: ``[B, H, T]`` write strengths in (0, 1).
        state: initial fast weight W ``[B, H, Dv, D]``, or None for zeros.
        decay, log_decay, backend, on_choice: as in fast_weight_sum.
    Returns:
        ``(out [B, H, T, Dv], W_T [B, H, Dv, D])``. Gradients flow to q, k, v,
        beta, the decay (or its log) and the initial state.

    The recurrence is stable when ``beta_t * |k_t|^2 <= 2`` (e.g. sum-normalised
    non-negative keys, as the paper uses).

    Activation memory kept for backward: ``reference`` one ``Dv x D`` state per
    step (testing only); ``chunked`` the inputs, one ``D x Dv`` state per chunk
    of C tokens (C = 32 for D <= 32, else 64), three ``C x C`` matrices per
    chunk, and two tensors the size of k and v (the WY factors); ``cuda`` the
    inputs, one ``Dv x D`` state per 16 steps and the pseudo-values
    ``beta_t (v_t - vbar_t)`` (the size of v).
    """
    return _checked_call(_run, None, q, k, v, beta, state, decay, log_decay, backend, on_choice)


@torch.no_grad()
def fast_weight_step_(memory, q, k, v, beta=None, *, log_decay=None, rule=None, backend="auto", on_choice=None):
    """One decoding step of every row, through the backend that `backend` resolves to (as training's calls).

    memory: a memory.Memory (W, or its factors, or empty), advanced in place, which keeps the backend chosen
    for its steps; q, k ``[B, H, D]``, v ``[B, H, Dv]``, beta and log_decay ``[B, H]`` or None; rule: a
    registered rule's name (None: the built-in of beta and log_decay, as fast_weight_sum/delta). The query
    reads the memory after the token's write (Eqs. 11, 25). Inputs are rounded, and the output ``[B, H, Dv]``
    returned, in the dtype the inputs are computed in, as by the sequence ops (under autocast its dtype);
    the memory stays in the accumulation dtype (float32, or float64).
    """
    rule = update_rule(rule) if rule is not None else rule_for(beta, log_decay)
    check_step_inputs(q, k, v, beta, log_decay, rule.substeps, rule.decay == "channels",
                      rule.write_strength == "channels")
    dtype = _compute_dtype([q, k, v, beta])
    call = Call.of(rule, q, v, dtype, needs_grad=False)
    choice = memory.backend_for(backend, call, resolve)
    if on_choice is not None:
        on_choice(choice)
    q, k, v, beta = _rounded((q, k, v, beta), call, choice)
    # An autocast context costs as much as a small op: entered only where autocast is on.
    autocast_off = torch.autocast(q.device.type, enabled=False) if torch.is_autocast_enabled(q.device.type) \
        else contextlib.nullcontext()
    with autocast_off:
        out = choice.kernel.step_(call, memory, q, k, v, beta, log_decay)
    return out if out.dtype == dtype else out.to(dtype)
