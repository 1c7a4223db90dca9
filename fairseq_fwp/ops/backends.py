"""The backends, and the one place that picks the one that runs a call.

A backend is a named place to run the ops (protocol.Backend: its device, dtypes and installation, and
whether it reads half types as they are). It runs an update rule through a protocol.Kernel that the rule
declares for it (rules/: ``kernels``), with the layouts of ops/fast_weight.py: q, k ``[B, H, T, D]``, v ``[B, H, T, Dv]``, beta and log_decay
``[B, H, T]`` or None, state W ``[B, H, Dv, D]`` or None; a step takes the same without T. Every rule runs
on "reference" (reference.py: its step, token by token). A new backend is one new module and one line in
REGISTRY.

``resolve(name, call)`` maps the flag (--fwp-backend, or the ops' ``backend=``) to what runs a call, for
training, state-only calls and decoding alike: a named backend runs or is refused
(BackendUnavailableError, in the format of ``cannot_run``), and "auto" takes the first of AUTO whose device
matches and that can run the call.
"""
import dataclasses
from typing import Optional

import torch

from . import chunked, cuda, fla, reference
from .errors import BackendUnavailableError
from .protocol import Backend, Kernel, transformed


REGISTRY = {module.BACKEND.name: module.BACKEND for module in (reference, chunked, cuda, fla)}
BACKENDS = ("auto", *REGISTRY)
# What "auto" may choose, in order, and on which device type (None: any). Only paths verified on that
# kind of device: fla's kernels on GPUs (tested by its maintainers there; our calls into them against
# the reference through Triton's interpreter), the pure-torch chunked form everywhere, and a rule's own
# step where it has no kernel. The csrc kernels join once the GPU check (scripts/gpu_check.sh) has passed.
AUTO = (("fla", "cuda"), ("chunked", None), ("reference", None))
REFERENCE_KERNEL = Kernel(reference.sequence, reference.final_state)


@dataclasses.dataclass(frozen=True)
class Call:
    """What a backend needs to know to say whether it can run a call."""

    rule: object  # rules.UpdateRule
    dtype: torch.dtype  # the dtype the inputs are computed in
    device: torch.device
    D: int
    Dv: int
    T: int  # 1 for a decoding step
    needs_grad: bool
    step: bool = False  # a decoding step (q [B, H, D]), not a sequence
    transformed: bool = False  # under forward-mode AD or a torch.func transform (protocol.transformed)

    @property
    def accumulation_dtype(self):
        """float64 stays float64; everything else accumulates (and carries its state) in float32."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @classmethod
    def of(cls, rule, q, v, dtype, needs_grad):
        """The call of `rule` for q ``[B, H, T, D]`` (or ``[B, H, D]``: one step), values v of size Dv."""
        return cls(rule=rule, dtype=dtype, device=q.device, D=q.shape[-1], Dv=v.shape[-1],
                   T=q.shape[2] if q.dim() == 4 else 1, needs_grad=needs_grad, step=q.dim() == 3,
                   transformed=transformed())


@dataclasses.dataclass(frozen=True)
class Choice:
    """What runs a call: the backend's name and description, the rule's kernel there, and why; `log`: the
    line the layers log once (modules/backend_log.py), where the flag did not name what runs."""

    name: str
    backend: Backend
    kernel: Kernel
    reason: str
    log: Optional[str] = None


def cannot_run(name, reason):
    """The one message format for a backend that cannot run a call."""
    return f"backend {name!r} cannot run this call: {reason}; backend='auto' runs every call"


def kernel_of(name, rule):
    return REFERENCE_KERNEL if name == "reference" else rule.kernels.get(name)


def unfit_reason(name, call):
    """Why backend `name` cannot run `call`, or None."""
    kernel = kernel_of(name, call.rule)
    if kernel is None:
        return f"it has no kernel for the update rule {call.rule.name!r}"
    if call.transformed and not REGISTRY[name].composed:
        return ("forward-mode AD or a torch.func transform is active, for which its autograd Functions define no "
                "rules (the reference, torch ops alone, runs under them)")
    return REGISTRY[name].unfit_reason(call) or kernel.unfit_reason(call)


def resolve(name, call) -> Choice:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if name != "auto":
        reason = unfit_reason(name, call)
        if reason is None:
            return Choice(name, REGISTRY[name], kernel_of(name, call.rule), "named")
        if call.step and kernel_of(name, call.rule) is not None and REGISTRY[name].unfit_reason(call) is None:
            # The backend trains this rule but has no step for it: the rule's own step decodes, in pure torch
            # on the same device, as the reference backend runs it.
            why = f"{name} has no decoding step for the rule {call.rule.name}: {reason}"
            return Choice(name, REGISTRY["reference"], REFERENCE_KERNEL, why,
                          log=f"--fwp-backend {name} decodes with the rule's own step ({why})")
        raise BackendUnavailableError(cannot_run(name, reason))
    passed = []
    for candidate, device_type in AUTO:
        reason = (f"{call.device.type} tensors" if device_type not in (None, call.device.type)
                  else unfit_reason(candidate, call))
        if reason is None:
            why = f"auto on {call.device.type} {call.dtype}, D = {call.D}, rule {call.rule.name}" + "".join(
                f"; not {n}: {r}" for n, r in passed)
            return Choice(candidate, REGISTRY[candidate], kernel_of(candidate, call.rule), why,
                          log=f"--fwp-backend auto runs {candidate} ({why})")
        passed.append((candidate, reason))
    raise AssertionError("the reference runs every rule")  # the last of AUTO takes every call


def resolved_name(name, x, Dv, dtype: Optional[torch.dtype] = None, rule="sum", **call):
    """The backend `name` resolves to for inputs like x ``[B, H, T, D]`` (values of size Dv): what the
    GPU check and the benchmarks report. rule: a registered rule's name; call: Call fields to override
    (needs_grad, T)."""
    from .rules import update_rule

    fields = dict(rule=update_rule(rule), dtype=dtype or x.dtype, device=x.device, D=x.shape[-1], Dv=Dv,
                  T=x.shape[2], needs_grad=True)
    return resolve(name, Call(**{**fields, **call})).name
