"""What every call of the ops must satisfy (op_cases.OpCase), each a function that raises AssertionError:

- the named backend gives the reference's outputs, final state and gradients, or is refused in the one
  format of a refusal (backends.cannot_run), which names the backend that runs every call;
- the reference (the rule's own step, token by token) equals the rule's steps run here in float64 on a
  FunctionalMemory with the decay as a plain multiplier: exact gradients also where a_t = 0;
- fast_weight_state equals the final state of fast_weight;
- the decoding step (fast_weight_step_), token by token from an empty memory (W's factors, then W) or from
  the initial state, gives the sequence's outputs and final state.

Comparisons are relative to the largest value of each kind (outputs, state, gradients: all gradients
together, since some are about 0 in exact arithmetic), and float32 runs are compared with float32 runs.
"""
import contextlib

import torch

from fairseq_fwp.ops import BackendUnavailableError, Memory, fast_weight, fast_weight_state, fast_weight_step_
from fairseq_fwp.ops import fla
from fairseq_fwp.ops.memory import FunctionalMemory
from fairseq_fwp.ops.protocol import run_step
from fairseq_fwp.testing import triton_interpreter
from nothing_to_check import NothingToCheck, require

INPUTS = ("q", "k", "v", "beta", "state", "decay", "log_decay")
# float64: sqrt(eps), the error decay.py's exact gradients allow where two decays below sqrt(eps) meet (a product
# of them is cut to below sqrt(eps), not to zero)
TOLERANCE = {torch.float64: 2e-8, torch.float32: 2e-4}


def loss_of(out, W, seed):
    g = torch.Generator().manual_seed(seed)
    return sum((y.double() * torch.randn(y.shape, generator=g, dtype=torch.float64)).sum() for y in (out, W))


def gradients(loss, x):
    """{"d<name>": the gradient of `loss`} for every input of `x` that needs one (zeros where unused)."""
    names = [name for name in INPUTS if x.get(name) is not None and x[name].requires_grad]
    if not loss.requires_grad:  # no tokens and no initial state: nothing the loss depends on
        return {f"d{name}": torch.zeros_like(x[name]) for name in names}
    grads = torch.autograd.grad(loss, [x[name] for name in names], allow_unused=True)
    return {f"d{name}": torch.zeros_like(x[name]) if g is None else g for name, g in zip(names, grads)}


def on(backend):
    """Where fla runs on CPU tensors, through Triton's interpreter, its calls run inside it."""
    return triton_interpreter() if backend == "fla" and fla.interpreting() else contextlib.nullcontext()


def gate_of(x):
    return {name: x[name] for name in ("decay", "log_decay") if x.get(name) is not None}


def run(case, backend, x):
    """{"out", "state", "d<name>"} of fast_weight on the inputs `x` (OpCase.tensors)."""
    with on(backend):
        out, W = fast_weight(case.rule, x["q"], x["k"], x["v"], x["beta"], x["state"], backend=backend, **gate_of(x))
        return {"out": out.detach(), "state": W.detach(), **gradients(loss_of(out, W, case.seed + 1), x)}


def plain_multiplier_steps(case, x):
    """The rule's own steps over the sequence in float64 on a FunctionalMemory, the decay a plain multiplier
    (a from decay=, or exp(log a)): the oracle of the reference's gradients, also where a_t = 0."""
    rule = case.spec
    B, H, T, D, Dv = case.B, case.H, case.T, case.D, case.Dv
    memory = FunctionalMemory(x["q"].new_zeros(B, H, Dv, D) if x["state"] is None else x["state"])
    a = x["decay"] if x.get("decay") is not None else None if x.get("log_decay") is None else x["log_decay"].exp()
    at = lambda y, t: None if y is None else y[:, :, t]  # noqa: E731
    outs = [run_step(rule, memory, at(x["q"], t), at(x["k"], t), at(x["v"], t), at(x["beta"], t), at(a, t))
            for t in range(T)]
    out = torch.stack(outs, 2) if outs else x["q"].new_zeros(B, H, 0, Dv)
    return {"out": out.detach(), "state": memory.fast_weight.detach(),
            **gradients(loss_of(out, memory.fast_weight, case.seed + 1), x)}


def relative_differences(got, want):
    """{kind: max |got - want| / max |want|} for the outputs, the state and all gradients together."""
    kinds = {"out": ["out"], "state": ["state"], "gradients": [name for name in want if name.startswith("d")]}
    kinds = {kind: [n for n in names if n in want] for kind, names in kinds.items()}
    differences = {}
    for kind, names in kinds.items():
        if not names or all(want[n].numel() == 0 for n in names):
            continue
        scale = max(want[n].double().abs().max().item() for n in names if want[n].numel())
        error = max((got[n].double() - want[n].double()).abs().max().item() for n in names if want[n].numel())
        assert all(torch.isfinite(got[n]).all() for n in names), f"{kind}: not finite"
        differences[kind] = error / max(scale, 1e-30)
    return differences


def assert_agree(got, want, tolerance, what):
    assert got.keys() == want.keys(), (what, sorted(got), sorted(want))
    differences = relative_differences(got, want)
    assert all(d <= tolerance for d in differences.values()), f"{what}: {differences} (tolerance {tolerance})"


def named_backend_agrees_with_the_reference(case):
    x = case.tensors()
    want = run(case, "reference", x)
    try:
        got = run(case, case.backend, case.tensors())
    except BackendUnavailableError as err:  # its dtype or sizes: in the one format, and no comparison
        assert f"backend {case.backend!r} cannot run this call: " in str(err)
        assert str(err).endswith("backend='auto' runs every call"), err
        raise NothingToCheck(f"{case.backend} refuses the call") from None
    # fla's kernels accumulate in float32 in every dtype, the chunked form in blocks: float32's tolerance
    assert_agree(got, want, TOLERANCE[case.dtype], f"{case.backend} against reference")


def reference_agrees_with_plain_multiplier_steps(case):
    x = case.tensors()
    got = run(case, "reference", x)
    wide = {name: None if t is None else t.detach().double().requires_grad_() for name, t in x.items()}
    assert_agree(got, plain_multiplier_steps(case, wide), TOLERANCE[case.dtype], "reference against its steps")


def state_alone_is_the_sequences_final_state(case):
    x = case.tensors(requires_grad=False)
    try:
        with on(case.backend):
            _, W = fast_weight(case.rule, x["q"], x["k"], x["v"], x["beta"], x["state"], backend=case.backend,
                               **gate_of(x))
            alone = fast_weight_state(case.rule, x["k"], x["v"], x["beta"], x["state"], backend=case.backend,
                                      **gate_of(x))
    except BackendUnavailableError:
        raise NothingToCheck(f"{case.backend} refuses the call") from None  # named_backend_agrees_... checks it
    assert_agree({"state": alone}, {"state": W}, TOLERANCE[case.dtype], "fast_weight_state")


def decoding_steps_give_the_sequence(case):
    require(case.T > 0, "no tokens to decode")
    x = case.tensors(requires_grad=False)
    log_a = x["decay"].log() if x.get("decay") is not None else x.get("log_decay")
    want = run(case, "reference", case.tensors())
    memory = Memory() if x["state"] is None else Memory(fast_weight=x["state"].clone())
    at = lambda y, t: None if y is None else y[:, :, t]  # noqa: E731
    backend = "auto" if case.backend == "fla" else case.backend  # the interpreter is for sequences
    try:
        outs = [fast_weight_step_(memory, at(x["q"], t), at(x["k"], t), at(x["v"], t), at(x["beta"], t),
                                  log_decay=at(log_a, t), rule=case.rule, backend=backend) for t in range(case.T)]
    except BackendUnavailableError:
        raise NothingToCheck(f"{backend} refuses the step") from None
    W = memory.materialized()
    got = {"out": torch.stack(outs, 2), "state": torch.zeros_like(want["state"]) if W is None else W}
    assert_agree(got, {"out": want["out"], "state": want["state"]}, TOLERANCE[case.dtype], "decoding steps")


OP_INVARIANTS = (named_backend_agrees_with_the_reference, reference_agrees_with_plain_multiplier_steps,
                 state_alone_is_the_sequences_final_state, decoding_steps_give_the_sequence)
