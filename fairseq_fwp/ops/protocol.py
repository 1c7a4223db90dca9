"""What a backend is, and how it runs one update rule (backends.py picks them; rules/ declare kernels)."""
import dataclasses
from typing import Callable

import torch


def fits(call):
    return None


def transformed():
    """Whether forward-mode AD or a torch.func transform (grad, vmap, jvp, ...) is active: the kernels' autograd
    Functions define no rules for them, and only compositions of torch ops (the reference) run under them."""
    return torch.autograd.forward_ad._current_level >= 0 or torch._C._functorch.peek_interpreter_stack() is not None


@dataclasses.dataclass(frozen=True)
class Backend:
    """A named place to run the ops."""

    name: str
    reads_half_types: bool  # takes float16/bfloat16 inputs as they are (else it gets the accumulation dtype)
    unfit_reason: Callable = fits  # (call) -> why it cannot run the call (device, dtype, installation), or None
    composed: bool = False  # its ops are compositions of torch ops, which autograd's transforms differentiate


def run_step(rule, memory, q, k, v, beta, decay):
    """rule.step, with what a rule that uses beta or a decay without declaring it meets said in its name."""
    try:
        return rule.step(memory, q, k, v, beta, decay)
    except (AttributeError, TypeError) as err:
        undeclared = [f"{given} ({need} = True)" for given, value, need in
                      (("beta", beta, "write_strength"), ("a decay", decay, "decay")) if value is None]
        if undeclared and "NoneType" in str(err):
            raise ValueError(f"update rule {rule.name!r}: its step failed on None for {' or '.join(undeclared)} "
                             f"({type(err).__name__}: {err}): the layer gives beta only to a rule that declares "
                             "write_strength = True, and a decay only to one that declares decay = True") from err
        raise


def rule_step_(call, memory, q, k, v, beta, log_decay):
    """The rule's own step (rules/), on the decoder's memory in place: pure torch, on any device."""
    memory.start_(k, v, call.accumulation_dtype)
    decay = None if log_decay is None else log_decay.to(call.accumulation_dtype).exp()
    return run_step(call.rule, memory, q, k, v, beta, decay)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """How one backend runs one update rule:

        sequence(call, q, k, v, beta, state, log_decay) -> (out, W)   the rule over a sequence, with gradients
        final_state(call, k, v, beta, state, log_decay) -> W          the final fast weight alone
        step_(call, memory, q, k, v, beta, log_decay) -> out          one decoding step, advancing `memory`
                                                                       (memory.Memory) in place; by default
                                                                       the rule's own step on it
        unfit_reason(call) -> str or None                              why this kernel cannot run the call,
                                                                       beyond its backend's reasons
    """

    sequence: Callable
    final_state: Callable
    step_: Callable = rule_step_
    unfit_reason: Callable = fits
