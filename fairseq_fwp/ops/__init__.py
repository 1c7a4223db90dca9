"""Fast-weight ops: pure torch, no fairseq. See README.md in this folder."""
from .backends import BACKENDS
from .errors import BackendUnavailableError
from .fast_weight import (
    fast_weight, fast_weight_delta, fast_weight_delta_product, fast_weight_delta_state, fast_weight_state,
    fast_weight_step_, fast_weight_sum, fast_weight_sum_state,
)
from .memory import Memory
from .rules import UPDATE_RULES, UpdateRule, register_update_rule, update_rule

__all__ = ["BACKENDS", "BackendUnavailableError", "Memory", "UPDATE_RULES", "UpdateRule", "fast_weight",
           "fast_weight_delta", "fast_weight_delta_product", "fast_weight_delta_state", "fast_weight_state", "fast_weight_step_", "fast_weight_sum",
           "fast_weight_sum_state", "register_update_rule", "update_rule"]
