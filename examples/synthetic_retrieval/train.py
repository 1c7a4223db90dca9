"""One training run: a model on one task size, with the authors' stopping rule.

Adam (lr 1e-3, otherwise default), mini-batches of 32 sequences with one
query each, loss 0.5 * ||one_hot(target) - y||^2 (predicting zeros scores
0.5). Every 100 steps the model is evaluated on 20 fresh sequences, each
queried with every distinct key (at most 200), in mini-batches of 32 queries;
the evaluation loss is the mean of the mini-batch means, as in the authors'
code. Training stops when the evaluation loss is <= 1e-3, after 11
evaluations in a row without a new best, at 100K steps, or as soon as a loss
is not finite (nothing is ever trained on a NaN).
"""
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .data import evaluation_sequence, training_batch
from .logs import SOLVED_LOSS
from .models import build_model
from .names import D_KEY

STOP_REASONS = ("solved", "no_progress", "max_steps", "not_finite")


@dataclass(frozen=True)
class TrainConfig:
    lr: float = 1e-3
    batch_size: int = 32  # training sequences, and queries per evaluation mini-batch
    eval_every: int = 100
    eval_sequences: int = 20
    max_queries: int = 200
    target_loss: float = SOLVED_LOSS
    patience: int = 11  # the authors stop when more than 10 evaluations bring no new best
    max_steps: int = 100_000  # rounded down to a multiple of eval_every
    seed: int = 1
    d_key: int = D_KEY  # the model's key size (the feature size D follows from it)


@dataclass(frozen=True)
class Evaluation:
    step: int
    eval_loss: float
    train_loss: float  # mean over the steps since the previous evaluation
    wall_s: float  # since the start of the run


class StoppingRule:
    """Solved at eval loss <= target; no progress after ``patience`` evaluations without a new best."""

    def __init__(self, target_loss, patience):
        self.target_loss = target_loss
        self.patience = patience
        self.best = math.inf
        self.evals_since_best = 0

    def update(self, eval_loss):
        """Record one evaluation; returns a stop reason or None."""
        if not math.isfinite(eval_loss):
            return "not_finite"
        if eval_loss < self.best:
            self.best, self.evals_since_best = eval_loss, 0
        else:
            self.evals_since_best += 1
        if eval_loss <= self.target_loss:
            return "solved"
        if self.evals_since_best >= self.patience:
            return "no_progress"
        return None


def retrieval_loss(y, targets):
    """0.5 * ||one_hot(target) - y||^2 per query: y ``[B, Q, S]``, targets ``[B, Q]`` -> ``[B, Q]``."""
    return 0.5 * (F.one_hot(targets, y.shape[-1]).to(y.dtype) - y).pow(2).sum(-1)


def train_steps(model, optimizer, num_keys, setting, config, generator):
    """``eval_every`` optimiser steps; the mean training loss, or NaN at the first non-finite loss."""
    losses = []
    for _ in range(config.eval_every):
        keys, values, queries, targets = training_batch(config.batch_size, num_keys, setting, generator)
        loss = retrieval_loss(model(keys, values, queries), targets).mean()
        if not torch.isfinite(loss):
            return math.nan
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return sum(losses) / len(losses)


@torch.no_grad()
def evaluate(model, num_keys, setting, config, generator):
    """Mean over mini-batches of queries on fresh sequences (see the module docstring).

    The memory depends on the sequence only, so each sequence is written once
    and read with all its queries; the loss is the same as the authors'
    query-by-query batches.
    """
    model.eval()
    batch_means = []
    for _ in range(config.eval_sequences):
        keys, values, queries, targets = evaluation_sequence(num_keys, setting, config.max_queries, generator)
        per_query = retrieval_loss(model(keys, values, queries), targets).flatten()
        batch_means += [batch.mean() for batch in per_query.split(config.batch_size)]
    model.train()
    return torch.stack(batch_means).mean().item()


def train(model_name, num_keys, setting, config=TrainConfig(), on_evaluation=None):
    """Train one model until it stops; returns the stop reason (one of ``STOP_REASONS``).

    ``on_evaluation(evaluation, stop)`` is called after every evaluation, with
    ``stop`` None except on the last one.
    """
    num_evals = config.max_steps // config.eval_every
    if num_evals < 1:
        raise ValueError(f"max_steps ({config.max_steps}) must be at least eval_every ({config.eval_every})")
    torch.manual_seed(config.seed)  # model initialisation (and FAVOR+ seeds)
    generator = torch.Generator().manual_seed(config.seed)  # the data
    model = build_model(model_name, num_keys, config.d_key)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    stopping = StoppingRule(config.target_loss, config.patience)
    start = time.perf_counter()
    for n in range(1, num_evals + 1):
        train_loss = train_steps(model, optimizer, num_keys, setting, config, generator)
        if math.isnan(train_loss):
            eval_loss, stop = math.nan, "not_finite"
        else:
            eval_loss = evaluate(model, num_keys, setting, config, generator)
            stop = stopping.update(eval_loss) or ("max_steps" if n == num_evals else None)
        evaluation = Evaluation(n * config.eval_every, eval_loss, train_loss, time.perf_counter() - start)
        if on_evaluation is not None:
            on_evaluation(evaluation, stop)
        if stop:
            return stop
