"""The backend protocol, the registry, and the one place that picks a backend for a call.

A backend is one module that implements:

    READS_HALF_TYPES                    True if it takes float16/bfloat16 inputs as they are (else the
                                        ops hand it the accumulation dtype: float32, or float64)
    unfit_reason(call) -> str | None    why it cannot run this call (None: it can)
    sequence(call, q, k, v, beta, state, log_decay) -> (out, W)     the rule over a sequence, with
                                                                     gradients
    final_state(call, k, v, beta, state, log_decay) -> W            the final fast weight alone
    step_(call, memory, q, k, v, beta, log_decay) -> out            one decoding step; advances
                                                                     `memory` (memory.Memory) in place

with the layouts of ops/fast_weight.py: q, k ``[B, H, T, D]``, v ``[B, H, T, Dv]``, beta and
log_decay ``[B, H, T]`` or None (the sum rule; the paper's rules), state W ``[B, H, Dv, D]`` or None;
a step takes the same without T. A new backend is one new module and one line in REGISTRY.

``resolve(name, call)`` maps the flag (--fwp-backend, or the ops' ``backend=``) to the backend that
runs a call, for training, state-only calls and decoding alike: a named backend runs or is refused
(BackendUnavailableError, in the format of ``cannot_run``), and "auto" takes the first backend of
AUTO whose device matches and that can run the call.
"""
import dataclasses
from typing import Optional

import torch

from . import chunked, cuda, fla, reference
from .errors import BackendUnavailableError

REGISTRY = {"reference": reference, "chunked": chunked, "cuda": cuda, "fla": fla}
BACKENDS = ("auto", *REGISTRY)
# What "auto" may choose, in order, and on which device type (None: any). Only paths verified on that
# kind of device: fla's kernels on GPUs (tested by its maintainers there; our calls into them against
# the reference through Triton's interpreter), the pure-torch chunked form everywhere. The csrc
# kernels join once the GPU check (scripts/gpu_check.sh) has passed on a GPU.
AUTO = (("fla", "cuda"), ("chunked", None))


@dataclasses.dataclass(frozen=True)
class Call:
    """What a backend needs to know to say whether it can run a call."""

    rule: str  # "sum" or "delta"
    gated: bool  # with a decay
    dtype: torch.dtype  # the dtype the inputs are computed in
    device: torch.device
    D: int
    Dv: int
    T: int  # 1 for a decoding step
    needs_grad: bool

    @property
    def accumulation_dtype(self):
        """float64 stays float64; everything else accumulates (and carries its state) in float32."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @classmethod
    def of(cls, q, v, beta, log_decay, dtype, needs_grad):
        """The call for q ``[B, H, T, D]`` (or ``[B, H, D]``: one step), values v of size Dv."""
        return cls(rule="sum" if beta is None else "delta", gated=log_decay is not None, dtype=dtype,
                   device=q.device, D=q.shape[-1], Dv=v.shape[-1], T=q.shape[2] if q.dim() == 4 else 1,
                   needs_grad=needs_grad)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The backend that runs a call: its name, its module, and why it was chosen."""

    name: str
    backend: object
    reason: str


def cannot_run(name, reason):
    """The one message format for a backend that cannot run a call."""
    return f"backend {name!r} cannot run this call: {reason}; backend='chunked' runs everywhere"


def resolve(name, call) -> Choice:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if name != "auto":
        reason = REGISTRY[name].unfit_reason(call)
        if reason is not None:
            raise BackendUnavailableError(cannot_run(name, reason))
        return Choice(name, REGISTRY[name], "named")
    passed = []
    for candidate, device_type in AUTO:
        reason = (f"{call.device.type} tensors" if device_type not in (None, call.device.type)
                  else REGISTRY[candidate].unfit_reason(call))
        if reason is None:
            why = f"auto on {call.device.type} {call.dtype}, D = {call.D}"
            return Choice(candidate, REGISTRY[candidate], why + "".join(f"; not {n}: {r}" for n, r in passed))
        passed.append((candidate, reason))
    raise AssertionError("chunked runs everywhere")  # the last of AUTO takes every call


def resolved_name(name, x, Dv, dtype: Optional[torch.dtype] = None, **call):
    """The backend `name` resolves to for inputs like x ``[B, H, T, D]`` (values of size Dv): what the
    GPU check and the benchmarks report. call: Call fields to override (rule, gated, needs_grad)."""
    fields = dict(rule="sum", gated=False, dtype=dtype or x.dtype, device=x.device, D=x.shape[-1], Dv=Dv,
                  T=x.shape[2], needs_grad=True)
    return resolve(name, Call(**{**fields, **call})).name
