"""Exact gradients of small per-channel decays, from the histories of the key columns they scale.

A decay per key channel scales column d of the memory before step t writes, W'_t = W_{t-1} Diag(a_t), so

    dL/da_{t,d} = <G_t[:, d], W_{t-1}[:, d]>,   G_t = dL/dW'_t,

the column before the decay against the gradient's column after it: neither holds a_t, so both are exact
however small a_t is (log a's gradient is a_t times this, and loses it below sqrt(eps): decay.py).

- W_{t-1}[:, d] is what the query e_d reads at step t - 1: one forward pass of the op (the rows repeated, a
  column per copy) reads every step's column, for any rule.
- gamma_t = G_t[:, d] follows the adjoint back from the final state's gradient dL/dW_T. With
  dL/dW_t = g_t q_t^T + G_{t+1} Diag(a_{t+1}) (g the outputs' gradient), a sum-rule write (W' + v k^T: GLA)
  passes it on unchanged, G_t = dL/dW_t, and a delta-rule write (W' + beta (v - W' k) k^T: KDA, each of its
  N writes) removes its retrieval's share, G_t = dL/dW_t - dv_t k_t^T, where dv = beta (dL/dW_t) k is the
  values' gradient. Column d:

      gamma_t = g_t q_{t,d} - sum_n k_{t,n,d} dv_{t,n} + a_{t+1,d} gamma_{t+1}

  a gated sum rule with one key channel, run backwards in time.

So the small decays of a channel cost one column read and one such backward sum, however many steps they fall
on; a channel's columns of all rows and steps are one copy of the rows.
"""
import dataclasses
from typing import Callable

import torch

from .chunked_gated import gated_chunked


@dataclasses.dataclass(frozen=True)
class ColumnReads:
    """What the column histories need from the op: the rule's write form (UpdateRule.write_form: "sum" or
    "delta") and read(log_decay, queries, k, v, beta, state) -> ``[B, H, T, Dv]``, what each step's query
    reads from the memory after its write."""

    write_form: str
    read: Callable


def _channel_of(copies, x):
    """x ``[B, H, ..., D]`` at each copy's channel: ``[K, B, H, ...]``; copies ``[K, B, H]`` are indices."""
    index = copies.view(*copies.shape, *[1] * (x.dim() - 2)).expand(-1, *x.shape[:-1], 1)
    return x.expand(len(copies), *x.shape).gather(-1, index).squeeze(-1)


def _backwards_sum(values, log_decay, final):
    """gamma_t = values_t + a_{t+1} gamma_{t+1} from gamma_T = final: values ``[R, H, T, Dv]``, log a
    ``[R, H, T]`` (a_{T} unused), final ``[R, H, Dv]``; the gated sum rule with one key channel, time reversed."""
    flip = lambda x: x.flip(2)  # noqa: E731
    shifted = torch.cat([log_decay[:, :, 1:], torch.zeros_like(log_decay[:, :, :1])], 2)  # a_{t+1}; 1 after T
    ones = values.new_ones(*values.shape[:3], 1)
    gamma, _ = gated_chunked(ones, ones, flip(values), None, flip(shifted), final.unsqueeze(-1))
    return flip(gamma)


def column_gradients(columns, log_decay, chosen, tensors, d_out, d_final, d_v, per_call):
    """dL/da where `chosen` ``[B, H, T, D]`` (0 elsewhere), from the op's inputs `tensors` (q, k, v, beta,
    state), the gradients of its outputs (None for the final-state op), of its final state and of its values;
    at most `per_call` copies of the rows at a time."""
    wide = lambda x: None if x is None else x.to(log_decay.dtype)  # noqa: E731 (half inputs: computed in float32)
    tensors, d_out, d_final, d_v = [wide(x) for x in tensors], wide(d_out), wide(d_final), wide(d_v)
    channels = chosen.any(2)  # [B, H, D]: the channels each row needs
    rank = channels.cumsum(-1)
    picks = [channels & (rank == n) for n in range(1, int(rank.max()) + 1)]  # a channel of each row per copy
    gradients = sum(_copies_gradients(columns, log_decay, torch.stack(picks[first:first + per_call]), tensors,
                                      d_out, d_final, d_v) for first in range(0, len(picks), per_call))
    return gradients.masked_fill(~chosen, 0.0)


def _copies_gradients(columns, log_decay, picks, tensors, d_out, d_final, d_v):
    """dL/da_{t,d} at every step of the channels of `picks` ``[K, B, H, D]`` (one or none per copy and row)."""
    q, k, v, beta, state = tensors
    K, (B, H, T, D) = len(picks), log_decay.shape
    copies = picks.to(torch.uint8).argmax(-1)  # [K, B, H]: each copy's channel (0 where a row has none: unused)
    repeated = lambda x: None if x is None else x.repeat(K, *[1] * (x.dim() - 1))  # noqa: E731
    queries = picks.unsqueeze(-2).expand(K, B, H, T, D).to(q.dtype).flatten(0, 1)
    read = columns.read(repeated(log_decay), queries, *map(repeated, (k, v, beta, state))).view(K, B, H, T, -1)
    start = torch.zeros_like(read[:, :, :, 0]) if state is None else _channel_of(copies, state)
    before = torch.cat([start.unsqueeze(3), read[:, :, :, :-1]], 3)  # W_{t-1}[:, d]

    pulls = torch.zeros_like(before)  # what each step adds to gamma
    if d_out is not None:
        pulls += d_out * _channel_of(copies, q).unsqueeze(-1)
    if columns.write_form == "delta":  # one term per write, N of them per token where k is [B, H, T, N, D]
        k_d = _channel_of(copies, k if k.dim() == 5 else k.unsqueeze(3))  # [K, B, H, T, N]
        pulls -= (k_d.unsqueeze(-1) * (d_v if d_v.dim() == 5 else d_v.unsqueeze(3))).sum(-2)
    gamma = _backwards_sum(pulls.flatten(0, 1), _channel_of(copies, log_decay).flatten(0, 1),
                           _channel_of(copies, d_final).flatten(0, 1)).view_as(before)
    per_copy = (gamma * before).sum(-1)  # [K, B, H, T]
    return (per_copy.unsqueeze(-1) * picks.unsqueeze(3)).sum(0)
