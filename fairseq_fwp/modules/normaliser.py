"""Attention normalisation's division (Eqs. 19, 28), shared by the causal and the non-causal paths."""
import torch


def divided_by_normalizer(out, normalizer, eps):
    """out / (normalizer + eps) (Eqs. 19, 28), and 0 where the normalizer z . phi(q) is 0: there phi(q) shares no
    feature with any key written (the features are non-negative), so W phi(q) is 0 too, and so is every exact
    gradient through it; dividing by eps alone would send 1 / eps times the output's gradient into the backward
    passes, whose rounding then reaches the other positions."""
    return torch.where(normalizer > 0, out / (normalizer + eps), 0.0)
