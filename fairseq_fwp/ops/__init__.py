"""Fast-weight ops: pure torch, no fairseq. See README.md in this folder."""
from .backends import BACKENDS
from .errors import BackendUnavailableError
from .fast_weight import (
    fast_weight_delta, fast_weight_delta_state, fast_weight_step_, fast_weight_sum, fast_weight_sum_state,
)
from .memory import Memory

__all__ = ["BACKENDS", "BackendUnavailableError", "Memory", "fast_weight_delta", "fast_weight_delta_state",
           "fast_weight_step_", "fast_weight_sum", "fast_weight_sum_state"]
