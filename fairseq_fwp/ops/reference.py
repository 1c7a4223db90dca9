"""Step-by-step fast-weight recurrences: the readable ground truth.

Every fast backend is tested against these loops. They follow the paper
("Linear Transformers Are Secretly Fast Weight Programmers") literally, one
time step at a time, and let autograd do the backward pass.

Layouts: q, k ``[B, H, T, D]``, v ``[B, H, T, Dv]``, beta ``[B, H, T]``,
fast weight W ``[B, H, Dv, D]`` (read as ``W @ phi(q)``).

``decay`` ``[B, H, T]`` (a_t in [0, 1], or None for 1) gives the gated rules
(Gated DeltaNet, Yang et al., ICLR 2025): before step t writes, the memory
is scaled by a_t, so the gated sum rule is W_t = a_t W_{t-1} + v_t k_t^T and
the gated delta rule retrieves vbar_t = a_t W_{t-1} k_t and writes
W_t = a_t W_{t-1} + beta_t (v_t - vbar_t) k_t^T.

Activation memory: autograd keeps one ``Dv x D`` fast weight per time step,
i.e. ``O(B * H * T * Dv * D)``; use it for testing, not for training.
"""
import torch


def decayed(W, decay):
    """a_t W_{t-1} (the gated rules); W itself where decay is None."""
    return W if decay is None else W * decay.unsqueeze(-1).unsqueeze(-1)


def sum_write(W, k, v, decay=None):
    """Eq. 17: W_t = W_{t-1} + v_t (x) k_t (gated: a_t W_{t-1} + ...). k: [..., D]; v: [..., Dv]; W: [..., Dv, D]."""
    return decayed(W, decay) + v.unsqueeze(-1) * k.unsqueeze(-2)


def delta_write(W, k, v, beta, decay=None):
    """Eqs. 20, 24: vbar_t = W_{t-1} k_t (the value currently stored under k_t);
    W_t = W_{t-1} + beta_t (v_t - vbar_t) (x) k_t. beta: [...] in (0, 1).
    Gated: W_{t-1} is a_t W_{t-1} in both places."""
    W = decayed(W, decay)
    vbar = read(W, k)
    return W + (beta.unsqueeze(-1) * (v - vbar)).unsqueeze(-1) * k.unsqueeze(-2)


def read(W, q):
    """Eq. 11 / Eq. 25: out_t = W_t q_t."""
    return (W @ q.unsqueeze(-1)).squeeze(-1)


def sum_step(W, q, k, v, decay=None):
    """One step of the sum rule: write, then read the updated memory."""
    W = sum_write(W, k, v, decay)
    return read(W, q), W


def delta_step(W, q, k, v, beta, decay=None):
    """One step of the delta rule: the query reads the updated memory (Eq. 25)."""
    W = delta_write(W, k, v, beta, decay)
    return read(W, q), W


def _at(decay, t):
    return None if decay is None else decay[:, :, t]


def _initial_state(q, v, state):
    if state is not None:
        return state
    B, H, _, D = q.shape
    return q.new_zeros(B, H, v.shape[-1], D)


def fast_weight_sum_reference(q, k, v, state=None, decay=None):
    """Sum rule over a sequence; returns (out [B, H, T, Dv], final W)."""
    W = _initial_state(q, v, state)
    outs = []
    for t in range(q.shape[2]):
        out, W = sum_step(W, q[:, :, t], k[:, :, t], v[:, :, t], _at(decay, t))
        outs.append(out)
    return torch.stack(outs, dim=2), W


def fast_weight_delta_reference(q, k, v, beta, state=None, decay=None):
    """Delta rule over a sequence; returns (out [B, H, T, Dv], final W)."""
    W = _initial_state(q, v, state)
    outs = []
    for t in range(q.shape[2]):
        out, W = delta_step(W, q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], _at(decay, t))
        outs.append(out)
    return torch.stack(outs, dim=2), W


def fast_weight_sum_state_reference(k, v, state=None, decay=None):
    """Sum rule, final fast weight only."""
    W = _initial_state(k, v, state)
    for t in range(k.shape[2]):
        W = sum_write(W, k[:, :, t], v[:, :, t], _at(decay, t))
    return W


def fast_weight_delta_state_reference(k, v, beta, state=None, decay=None):
    """Delta rule, final fast weight only."""
    W = _initial_state(k, v, state)
    for t in range(k.shape[2]):
        W = delta_write(W, k[:, :, t], v[:, :, t], beta[:, :, t], _at(decay, t))
    return W


# -- the backend protocol (backends.py) -------------------------------------------------

READS_HALF_TYPES = False


def unfit_reason(call):
    return None  # any device and dtype


def _decay(log_decay):
    return None if log_decay is None else log_decay.exp()


def sequence(call, q, k, v, beta, state, log_decay):
    if call.rule == "sum":
        return fast_weight_sum_reference(q, k, v, state, _decay(log_decay))
    return fast_weight_delta_reference(q, k, v, beta, state, _decay(log_decay))


def final_state(call, k, v, beta, state, log_decay):
    if call.rule == "sum":
        return fast_weight_sum_state_reference(k, v, state, _decay(log_decay))
    return fast_weight_delta_state_reference(k, v, beta, state, _decay(log_decay))


@torch.no_grad()
def step_(call, memory, q, k, v, beta, log_decay):
    W = memory.fast_weight_for(q, v, call.accumulation_dtype)
    q, k, v = (x.to(W.dtype) for x in (q, k, v))
    decay = None if log_decay is None else log_decay.to(W.dtype).exp()
    if call.rule == "sum":
        out, new = sum_step(W, q, k, v, decay)
    else:
        out, new = delta_step(W, q, k, v, beta.to(W.dtype), decay)
    W.copy_(new)
    return out
