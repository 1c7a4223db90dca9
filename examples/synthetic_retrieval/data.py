"""Sequences of the associative-retrieval task (paper Sec. 6.1).

A sequence is L (key, value) pairs over S keys and S values, followed by one
query key. Keys and values are indices in [0, S).

- Setting 1 (capacity, Sec. 6.1.1): L = S, keys and values drawn without
  replacement, so every key is written exactly once.
- Setting 2 (update rules, Sec. 6.1.2): L = 2S, drawn with replacement, so a
  key can be re-assigned; the target is the value at the query key's LAST
  occurrence.

Training queries are the key at a uniformly drawn position (so frequent keys
are asked more often). Evaluation queries every distinct key of a sequence,
at most ``max_queries`` of them.
"""
import torch

SETTINGS = (1, 2)


def sequence_length(setting, num_keys):
    """L = S in setting 1, L = 2S in setting 2."""
    return num_keys if setting == 1 else 2 * num_keys


def sample_sequences(batch_size, num_keys, setting, generator=None):
    """(keys, values): two LongTensors ``[batch_size, L]`` with entries in [0, S)."""
    if setting == 1:
        # without replacement and L = S: each row is a random permutation
        def draw():
            return torch.rand(batch_size, num_keys, generator=generator).argsort(-1)
    else:
        def draw():
            return torch.randint(num_keys, (batch_size, sequence_length(setting, num_keys)), generator=generator)
    return draw(), draw()


def last_occurrence(keys, queries):
    """Position of each query key's last occurrence in its sequence.

    keys ``[B, L]``, queries ``[B, Q]`` -> ``[B, Q]`` (-1 where the key is absent).
    """
    positions = torch.arange(keys.shape[-1])
    found = keys.unsqueeze(1) == queries.unsqueeze(-1)  # [B, Q, L]
    return torch.where(found, positions, -1).amax(-1)


def targets_for(keys, values, queries):
    """The value stored last under each query key (the most recent association).

    Every query must occur in its sequence.
    """
    return values.gather(1, last_occurrence(keys, queries))


def training_batch(batch_size, num_keys, setting, generator=None):
    """keys, values ``[B, L]``; one query per sequence ``[B, 1]`` and its target ``[B, 1]``."""
    keys, values = sample_sequences(batch_size, num_keys, setting, generator)
    position = torch.randint(keys.shape[1], (batch_size, 1), generator=generator)
    queries = keys.gather(1, position)
    return keys, values, queries, targets_for(keys, values, queries)


def evaluation_sequence(num_keys, setting, max_queries=200, generator=None):
    """One fresh sequence queried with its distinct keys (at most ``max_queries``).

    Returns keys, values ``[1, L]`` and queries, targets ``[1, Q]``. Where the
    sequence holds more than ``max_queries`` distinct keys, a random subset of
    them is asked.
    """
    keys, values = sample_sequences(1, num_keys, setting, generator)
    distinct = keys.unique()
    chosen = torch.randperm(len(distinct), generator=generator)[:max_queries]
    queries = distinct[chosen].unsqueeze(0)
    return keys, values, queries, targets_for(keys, values, queries)
