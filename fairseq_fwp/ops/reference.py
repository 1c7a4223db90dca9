"""backend="reference": any update rule, one token at a time, on a FunctionalMemory: the readable ground
truth.

Every fast backend is tested against it (and it against the paper's recurrences written out in the
tests). It runs a rule's own step (rules/) over the sequence and lets autograd do the backward pass, on any
device and dtype: in float64 it is what the oracles use.

Activation memory: autograd keeps one ``Dv x D`` fast weight per time step, i.e. ``O(B * H * T * Dv * D)``;
use it for testing, and for rules that have no kernel yet.
"""
import torch

from .memory import FunctionalMemory
from .protocol import Backend, run_step


def _at(x, t):
    return None if x is None else x[:, :, t]


def _run(rule, q, k, v, beta, state, log_decay, read):
    B, H, T = k.shape[:3]
    memory = FunctionalMemory(k.new_zeros(B, H, v.shape[-1], k.shape[-1]) if state is None else state)
    decay = None if log_decay is None else log_decay.exp()  # exactly 0 for a full forget
    outs = []
    for t in range(T):
        out = run_step(rule, memory, q[:, :, t], k[:, :, t], v[:, :, t], _at(beta, t), _at(decay, t))
        if read:
            outs.append(out)
    return outs, memory.fast_weight


def sequence(call, q, k, v, beta, state, log_decay):
    outs, W = _run(call.rule, q, k, v, beta, state, log_decay, read=True)
    return torch.stack(outs, dim=2), W


def final_state(call, k, v, beta, state, log_decay):
    queries = k[:, :, :, 0] if call.rule.substeps else k  # not read: what a step takes beside the keys
    return _run(call.rule, queries, k, v, beta, state, log_decay, read=False)[1]


BACKEND = Backend("reference", reads_half_types=False, composed=True)  # any device, dtype and rule
