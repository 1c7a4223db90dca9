"""Fast-weight ops: pure torch, no fairseq. See README.md in this folder."""
from .errors import BackendUnavailableError
from .fast_weight import (
    BACKENDS, fast_weight_delta, fast_weight_delta_state, fast_weight_sum, fast_weight_sum_state,
)

__all__ = ["BACKENDS", "BackendUnavailableError", "fast_weight_delta", "fast_weight_delta_state",
           "fast_weight_sum", "fast_weight_sum_state"]
