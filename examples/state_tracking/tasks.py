"""The state-tracking tasks: token sequences and, for every prefix, the state a model must output.

- parity: tokens 0/1; the state is the parity of the ones so far (Z_2).
- mod3: tokens 0/1; the number of ones so far, mod 3 (Z_3, a rotation by 120 degrees per one).
- s3: tokens are the six permutations of three things; the state is their composition so far (the word
  problem of S3, the smallest non-commutative group).

Training lengths and test lengths follow the papers: parity and counting train on lengths 3 to 40 and are
tested up to 256 (Grazzi et al., 2024); S3 trains at 128 and is tested up to 512 (Siems et al., 2025).
"""
import dataclasses
import itertools
from typing import Tuple

import torch

PERMUTATIONS = list(itertools.permutations(range(3)))  # index 0 is the identity
_INDEX = {p: i for i, p in enumerate(PERMUTATIONS)}
# COMPOSE[a, b] = a o b (b first): the state after b, then a
COMPOSE = torch.tensor([[_INDEX[tuple(a[b[i]] for i in range(3))] for b in PERMUTATIONS] for a in PERMUTATIONS])


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    vocab: int
    classes: int
    train_lengths: Tuple[int, int]  # drawn per batch, inclusive
    test_lengths: Tuple[int, ...]

    def batch(self, size, length, generator):
        """(tokens, states) ``[size, length]``: random tokens and the state after each."""
        tokens = torch.randint(0, self.vocab, (size, length), generator=generator)
        if self.name == "parity":
            return tokens, tokens.cumsum(1) % 2
        if self.name == "mod3":
            return tokens, tokens.cumsum(1) % 3
        states, state = torch.empty_like(tokens), torch.zeros(size, dtype=torch.long)
        for t in range(length):
            state = COMPOSE[tokens[:, t], state]
            states[:, t] = state
        return tokens, states

    def training_batch(self, size, generator):
        low, high = self.train_lengths
        length = int(torch.randint(low, high + 1, (), generator=generator))
        return self.batch(size, length, generator)


TASKS = {
    "parity": Task("parity", 2, 2, (3, 40), (40, 64, 128, 256)),
    "mod3": Task("mod3", 2, 3, (3, 40), (40, 64, 128, 256)),
    "s3": Task("s3", 6, 6, (128, 128), (128, 256, 512)),
}
