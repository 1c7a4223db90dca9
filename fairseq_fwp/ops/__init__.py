"""Fast-weight ops: pure torch, no fairseq. See README.md in this folder."""
from .fast_weight import BACKENDS, BackendUnavailableError, fast_weight_delta, fast_weight_sum

__all__ = ["BACKENDS", "BackendUnavailableError", "fast_weight_delta", "fast_weight_sum"]
