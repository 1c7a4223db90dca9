"""The one-layer, one-head retrieval models of the paper's Sec. 6.1.

A model is the shared front end (``RetrievalModel``) plus one memory. The
front end turns the sequence into keys, values and write strengths:

    x_i  = [one_hot(value_i); E(key_i)]   E: trainable, size int(2.2 S), N(0, 1)
    k_i  = W_k x_i                         d_key = 64
    beta_i = sigmoid(W_b x_i)              (Eq. 21; rules that use it)
    q    = W_q E(query)                    the query comes after the sequence
    v_i  = one_hot(value_i)                fixed, so the targets are exact

The memory writes all L pairs, then reads once with q. The query comes after
the sequence, so only the FINAL fast weight is needed: the plugin ops return
it, and their per-step outputs are not used. No positional encoding.

Models are named ``softmax`` or ``RULE-PHI`` (``names.py``):

- ``sum``:   W = sum_i v_i phi(k_i)^T (Eq. 17), read with attention
             normalisation y = W phi(q) / (z . phi(q)), z = sum_i phi(k_i) (Eq. 11).
- ``delta``: "ours" (Sec. 4.2): phi sum-normalised (Eq. 29) for keys and
             query, delta rule (Eqs. 20-25), y = W phi'(q). Dividing W phi(q) by
             the sum of phi(q) (the authors' code) is the same thing.
- ``gated``: Peng et al.'s rule of Appendix B, W = (1 - beta) W + beta v phi'(k)^T
             (Eq. 52), with the same sum-normalised phi' as ``delta``.
- ``gdelta``: the gated delta rule (Gated DeltaNet, 2025): ``delta`` with a
             decay a_i from the write input (Mamba-2's form, the plugin's
             DecayGate): W_i = a_i W_{i-1} + beta_i (v_i - a_i W_{i-1} phi'(k_i)) phi'(k_i)^T.
- ``fwm``:   the fast weight memory of Schlag et al. (2021) as the authors
             ported it: unnormalised keys (``tanh``, or a phi for the ablation),
             the delta rule, W divided by max(1, ||W||_F) after every write, and a
             layer-normalised output.
- ``softmax``: softmax attention over the stored pairs, scores q . k / sqrt(d_key).

PHI is ``linear`` (elu + 1), ``dpfpNU`` (DPFP-nu), ``favorM`` (FAVOR+ with M
random features) or, for ``fwm`` only, ``tanh``. Every phi, and the sum and
delta rules, are the plugin's own (``fairseq_fwp``).
"""
import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from fairseq_fwp.modules.feature_maps import build_feature_map, start_training_step, sum_normalize
from fairseq_fwp.modules.gates import DecayGate
from fairseq_fwp.ops import fast_weight_delta_state, fast_weight_sum_state

from .names import D_KEY, parse_model_name


# ---------------------------------------------------------------- feature maps

def build_phi(name, d_key=D_KEY):
    """The plugin feature map for a PHI name; ``tanh`` is the 2021 FWM's key squashing."""
    if name == "tanh":
        return nn.Tanh()
    if name == "linear":
        return build_feature_map("linear", d_key)
    match = re.fullmatch(r"(dpfp|favor)([1-9][0-9]*)", name)
    if match is None:
        raise ValueError(f"unknown feature map {name!r}")
    kind, size = match.group(1), int(match.group(2))
    if kind == "dpfp":
        return build_feature_map("dpfp", d_key, nu=size)
    return build_feature_map("performer", d_key, num_features=size, input_scaling=False)  # the paper's Eqs. 31-32


# ---------------------------------------------------------------- memories

class SoftmaxMemory(nn.Module):
    """Softmax attention over all stored pairs: a memory that grows with L."""

    uses_beta = False

    def forward(self, k, v, beta, q, log_decay=None):
        scores = q @ k.transpose(-1, -2) / math.sqrt(k.shape[-1])  # [B, Q, L]
        return scores.softmax(-1) @ v


class FastWeightMemory(nn.Module):
    """Write all pairs into a fast weight W ``[B, S, D]``, then read it with phi(q).

    Subclasses define ``write(phi_k, v, beta) -> W`` and ``read(W, phi_q) -> y``.
    """

    uses_beta = True
    uses_decay = False  # the gated delta rule's a_i (as log a_i)
    sum_normalized = False  # phi' = phi / sum(phi) (Eq. 29) for keys and query

    def __init__(self, phi):
        super().__init__()
        self.phi = phi

    def features(self, x):
        features = self.phi(x)
        return sum_normalize(features) if self.sum_normalized else features

    def forward(self, k, v, beta, q, log_decay=None):
        if self.training:
            start_training_step(self.phi)  # FAVOR+: new random features every mini-batch (Sec. 5.3)
        fast_weight = self.write(self.features(k), v, beta, *((log_decay,) if self.uses_decay else ()))
        return self.read(fast_weight, self.features(q))

    def read(self, fast_weight, phi_q):
        return phi_q @ fast_weight.transpose(-1, -2)  # y = W phi(q) (Eq. 25)


def final_fast_weight(op, phi_k, v, beta=None, state=None, log_decay=None):
    """Run a plugin state-only op on one head: the final fast weight, ``[B, Dv, D]``.

    phi_k ``[B, T, D]``, v ``[B, T, Dv]``, beta and log_decay ``[B, T]``, state ``[B, Dv, D]``.
    The query comes after the sequence, so no per-step outputs are needed:
    fast_weight_sum_state / fast_weight_delta_state compute none.
    """
    betas = () if beta is None else (beta.unsqueeze(1),)
    gated = {} if log_decay is None else {"log_decay": log_decay.unsqueeze(1)}
    fast_weight = op(phi_k.unsqueeze(1), v.unsqueeze(1), *betas, None if state is None else state.unsqueeze(1),
                     **gated)
    return fast_weight.squeeze(1)


class SumMemory(FastWeightMemory):
    """Sum rule (Eq. 17) with attention normalisation (Eq. 11)."""

    uses_beta = False

    def write(self, phi_k, v, beta):
        # An all-ones value channel makes the op accumulate the normaliser
        # z = sum_i phi(k_i) as the last row of W, in the same pass.
        v_and_one = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], -1)
        return final_fast_weight(fast_weight_sum_state, phi_k, v_and_one)

    def read(self, fast_weight, phi_q):
        numerator_and_z = super().read(fast_weight, phi_q)
        # eps as in the authors' synthetic-task code
        return numerator_and_z[..., :-1] / (numerator_and_z[..., -1:] + 1e-6)


class DeltaMemory(FastWeightMemory):
    """"Ours" (Sec. 4.2): sum-normalised phi and the delta rule (Eqs. 20-25, 29)."""

    sum_normalized = True

    def write(self, phi_k, v, beta):
        return final_fast_weight(fast_weight_delta_state, phi_k, v, beta)


class GatedDeltaMemory(DeltaMemory):
    """The gated delta rule: the delta rule with a decay a_i (fast_weight_delta_state's log_decay)."""

    uses_decay = True

    def write(self, phi_k, v, beta, log_decay):
        return final_fast_weight(fast_weight_delta_state, phi_k, v, beta, log_decay=log_decay)


class GatedMemory(FastWeightMemory):
    """Peng et al.'s gated rule, Appendix B Eq. 52: W_i = (1 - beta_i) W_{i-1} + beta_i v_i phi'(k_i)^T.

    Unrolled from W_0 = 0, the final W is a sum rule over re-weighted values,
    W_L = sum_i beta_i prod_{j > i} (1 - beta_j) v_i phi'(k_i)^T, so the
    plugin's sum op computes it.
    """

    sum_normalized = True

    def write(self, phi_k, v, beta):
        keep = 1 - beta  # [B, L]
        # prod_{j > i} keep_j: a reverse cumulative product, shifted by one
        kept_after = torch.cat([keep[:, 1:].flip(-1).cumprod(-1).flip(-1), torch.ones_like(keep[:, :1])], -1)
        return final_fast_weight(fast_weight_sum_state, phi_k, v * (beta * kept_after).unsqueeze(-1))


class FastWeightMemory2021(FastWeightMemory):
    """Schlag et al. (2021)'s fast weight memory, as ported by the authors (Sec. 6.1.2).

    Each write is one delta-rule step (the old value is replaced by the beta
    interpolation of old and new, Eq. 22) on unnormalised keys, followed by
    W <- W / max(1, ||W||_F). The normalisation needs W after every step, so
    the plugin's delta op runs one step at a time. The output is layer-normalised.
    """

    def write(self, phi_k, v, beta):
        fast_weight = None
        for i in range(phi_k.shape[1]):
            step = slice(i, i + 1)
            fast_weight = final_fast_weight(fast_weight_delta_state, phi_k[:, step], v[:, step], beta[:, step], fast_weight)
            frobenius = fast_weight.flatten(1).norm(dim=-1).clamp_min(1)
            fast_weight = fast_weight / frobenius.view(-1, 1, 1)
        return fast_weight

    def read(self, fast_weight, phi_q):
        y = super().read(fast_weight, phi_q)
        return F.layer_norm(y, y.shape[-1:])


MEMORIES = {"sum": SumMemory, "delta": DeltaMemory, "gated": GatedMemory, "gdelta": GatedDeltaMemory,
            "fwm": FastWeightMemory2021}


# ---------------------------------------------------------------- the model

class RetrievalModel(nn.Module):
    """The shared front end (Sec. 6.1) around one memory; see the module docstring."""

    def __init__(self, num_keys, memory, d_key=D_KEY):
        super().__init__()
        self.num_keys = num_keys
        embedding_size = int(2.2 * num_keys)
        self.embedding = nn.Embedding(num_keys, embedding_size)
        nn.init.normal_(self.embedding.weight, mean=0.0, std=1.0)
        self.W_k = nn.Linear(num_keys + embedding_size, d_key)
        self.W_q = nn.Linear(embedding_size, d_key)
        self.W_b = nn.Linear(num_keys + embedding_size, 1) if memory.uses_beta else None
        self.decay_gate = DecayGate(num_keys + embedding_size, 1) if getattr(memory, "uses_decay", False) else None
        for projection in (self.W_k, self.W_q):
            if isinstance(memory, SoftmaxMemory):
                nn.init.xavier_uniform_(projection.weight)  # as the authors' softmax baseline
            else:
                bound = d_key ** -0.5  # as the authors' fast-weight models
                nn.init.uniform_(projection.weight, -bound, bound)
        self.memory = memory

    def forward(self, keys, values, queries):
        """keys, values ``[B, L]``, queries ``[B, Q]`` (indices) -> retrieved values ``[B, Q, S]``."""
        beta = torch.sigmoid(self.write_input(self.W_b, keys, values)).squeeze(-1) if self.W_b is not None else None
        log_decay = None
        if self.decay_gate is not None:  # [B, L, 1] logits -> [B, L] log decays
            log_decay = self.decay_gate.log_decay_from_logits(
                self.write_input(self.decay_gate.proj, keys, values)).squeeze(-1)
        v = F.one_hot(values, self.num_keys).float()
        return self.memory(self.write_input(self.W_k, keys, values), v, beta, self.W_q(self.embedding(queries)),
                           log_decay)

    def write_input(self, linear, keys, values):
        """``linear(x_i)`` for x_i = [one_hot(value_i); E(key_i)], without building x.

        A linear map of a one-hot vector picks a column, and of E(key) a row
        of the projected table E W^T, which has only S rows: the same numbers
        for B*L/S (32 or 64) times less work than projecting every x_i.
        """
        w_value, w_key = linear.weight.split([self.num_keys, self.embedding.embedding_dim], dim=1)
        projected_embedding = self.embedding.weight @ w_key.T  # [S, out]
        out = F.embedding(values, w_value.T) + F.embedding(keys, projected_embedding)
        return out if linear.bias is None else out + linear.bias


def build_model(name, num_keys, d_key=D_KEY):
    """A fresh ``RetrievalModel`` for a model name (see ``parse_model_name``)."""
    rule, phi = parse_model_name(name)
    memory = SoftmaxMemory() if rule == "softmax" else MEMORIES[rule](build_phi(phi, d_key))
    return RetrievalModel(num_keys, memory, d_key)
