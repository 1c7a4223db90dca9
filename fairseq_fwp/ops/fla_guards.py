"""What fla itself refuses to run on this device with these versions, in fla's own words.

fla guards some of its kernels by device and version. fla-core 0.6.0 has one such guard on the kernels
this project calls: ``fla.ops.common.chunk_o.chunk_bwd_dqkwg`` with a gate ``g`` (the backward of
``chunk_simple_gla`` with g, ``chunk_gated_delta_rule`` and ``chunk_gated_delta_product`` with g) raises a
RuntimeError on Hopper GPUs with Triton versions that miscompile it (in 0.6.0: compute capability 9 or a
name starting "NVIDIA H", with Triton >= 3.4.0 and < 3.7.1, read when fla is imported), saying what to
install. Its other raises on these kernels' paths are argument checks that our calls satisfy, and the
backward that ``fused_recurrent_gated_delta_rule`` lacks, which fla.py refuses by itself.

The condition is fla's, not a copy of it: ``refusal`` calls the guarded function as the op would call it
(through fla's backend dispatch), with arguments that stop it the moment it reads one. A guard that
raises first is fla's refusal, with its message; an argument read first means the guard let the call
through. Nothing is computed, and the answer is cached per process.

A guard on the arguments' values (their dtypes, say) would read them first, so the probe answers for
guards on the device, the versions and which arguments are given: all that fla-core 0.6.0 has. Where fla
would hand a call to another of its backends (TileLang, where installed), the probe, whose arguments no
backend accepts, still sees the refusal: auto then routes around the kernel although fla might have
taken that call.
"""
import functools
import importlib
import inspect

# name -> (module, function, the optional arguments the op passes): each guard fla-core 0.6.0 has on
# the paths of the kernels in fla.py.
GUARDS = {"the gated chunk kernels' backward": ("fla.ops.common.chunk_o", "chunk_bwd_dqkwg", ("g",))}


class _PastTheGuard(Exception):
    """fla read an argument: its guards, which read none, let the call through."""


class _StopWhenRead:
    """An argument that stops the guarded function at its first use of it."""

    def __getattr__(self, name):
        raise _PastTheGuard


@functools.lru_cache(maxsize=None)
def refusal(guard):
    """fla's message where fla refuses the calls of `guard` (a name in GUARDS) here, else None."""
    module, function, given = GUARDS[guard]
    guarded = getattr(importlib.import_module(module), function)
    required = [name for name, parameter in inspect.signature(inspect.unwrap(guarded)).parameters.items()
                if parameter.default is inspect.Parameter.empty]
    try:
        guarded(**{name: _StopWhenRead() for name in (*required, *given)})
    except _PastTheGuard:
        return None
    except RuntimeError as err:  # fla's guards raise RuntimeError
        return f"fla refuses {guard} on this device ({function}): {err}"
    raise AssertionError(f"{module}.{function} returned without reading its arguments")
