"""The glue around an attention layer's kernel, counted: every aten op that one training step of one layer
runs outside its kernel (forward and backward), the bytes each writes, and what the forward keeps for the
backward pass.

    python examples/speed/glue.py                       # the table: fairseq-softmax, linear-delta, gated-deltanet
    python examples/speed/glue.py --ops linear-delta    # and every op of the row that writes, in order
    python examples/speed/glue.py --precision cast      # the model cast to half (fairseq's --fp16, --bf16)

Each row is the decoder self-attention of train_step.py's row (built by fairseq from the same flags, at the
GPT-2-small layer shape: d 768, 12 heads of 64; --fwp-backend fla for the fwp rows) in training mode, run
forward on a layer-norm output (float32 ``[T, B, C]``, as a pre-norm layer's attention receives it under
autocast) and backward from a gradient of its output. A TorchDispatchMode records every aten op with the
bytes its outputs take (views, allocations and metadata write none; an in-place op writes its
destination). The op sequence depends neither on the device nor on T and B (B > 1); the bytes do,
linearly: each row runs at five small shapes and every op's bytes are fitted as a B T + b B + c + d T^2
(d: the softmax's T x T mask), then given per token and at T = 2048, B = 16 (train_step.py's 32,768 tokens
a step).

The kernel: fla's Triton launches (run through Triton's interpreter, on the CPU), and torch's
scaled_dot_product_attention for fairseq's softmax (after autocast's casts of its inputs, which are glue),
each counted as one call. fla's own Python around its launches is listed apart ("fla's own": its fills and
elementwise ops), except its copies and casts, which the layout and dtype it is given decide: those are glue.

--precision amp (the default, fairseq's --amp): a float32 model under autocast, which follows CUDA's policy,
not the CPU's: a sum, a norm, a cumsum, exp, softplus and the layer norm compute in float32, the GEMMs in the
autocast dtype (cuda_autocast_policy). --precision cast (fairseq's --fp16 and --bf16, which cast the model and
its inputs, no autocast): the layer and its input in the half type. float16 stands in for bfloat16 either way
(the same sizes and, under autocast, the same policy): the interpreter computes bfloat16 chunk kernels wrongly,
and fla.py refuses them on the CPU.
"""
import argparse
import collections
import contextlib
import datetime
import os
import platform
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # fla's kernels on CPU tensors: set before triton is imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from examples.speed.train_step import ROWS, model_flags  # noqa: E402

TABLE_ROWS = ("fairseq-softmax", "linear-delta", "gated-deltanet")
SHAPES = ((2, 64), (3, 64), (2, 128), (3, 192), (4, 64))  # (B, T), B > 1 (B = 1 needs no transposes): a fit, checked
TOKENS, LENGTH = 32768, 2048  # train_step.py's step at T = 2048
HALF = torch.float16

# CUDA's autocast policy (ATen/autocast_mode.h), for the ops these layers can reach.
LOWER_PRECISION = ("linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "einsum", "conv1d", "_convolution",
                   "linalg_vecdot")
FP32 = ("exp", "expm1", "log", "log1p", "reciprocal", "rsqrt", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
        "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm")
FP32_SET_DTYPE = ("sum", "sum.dim_IntList", "cumsum", "cumprod", "prod", "prod.dim_int", "softmax.int",
                  "log_softmax.int", "linalg_vector_norm")
PROMOTE = ("addcdiv", "addcmul", "index_put", "scatter_add", "dot", "tensordot")


def _eligible(x):
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


def _cast_all(tree, dtype):
    if _eligible(tree):
        return tree.to(dtype)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cast_all(x, dtype) for x in tree)
    return tree


def _widest(args):
    dtypes = [x.dtype for x in args if _eligible(x)] + [
        y.dtype for x in args if isinstance(x, (list, tuple)) for y in x if _eligible(y)]
    dtype = dtypes[0]
    for other in dtypes[1:]:
        dtype = torch.promote_types(dtype, other)
    return dtype


@contextlib.contextmanager
def cuda_autocast_policy():
    """CPU autocast that casts as CUDA's does: each op of the lists above gets an AutocastCPU kernel that
    casts its floating arguments (float64 aside) as CUDA's autocast would, then runs below autocast."""
    library = torch.library.Library("aten", "IMPL")
    below_autocast = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def register(name, cast):
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")

        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(below_autocast):
                args, kwargs = cast(op, args, kwargs)
                return op(*args, **kwargs)
        library.impl(name, kernel, "AutocastCPU")

    def lower(op, args, kwargs):
        dtype = torch.get_autocast_dtype("cpu")
        return _cast_all(args, dtype), {k: _cast_all(v, dtype) for k, v in kwargs.items()}

    def fp32(op, args, kwargs):
        return _cast_all(args, torch.float32), kwargs

    def set_dtype(op, args, kwargs):
        names = [a.name for a in op._schema.arguments]
        first = next(x for x in args if isinstance(x, torch.Tensor))
        if _eligible(first):
            at = names.index("dtype")
            if at < len(args):
                args = (*args[:at], args[at] if args[at] is not None else torch.float32, *args[at + 1:])
            elif kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        return args, kwargs

    def promote(op, args, kwargs):
        return _cast_all(args, _widest(args)), kwargs

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
        for names, cast in ((LOWER_PRECISION, lower), (FP32, fp32), (FP32_SET_DTYPE, set_dtype),
                            (PROMOTE, promote)):
            for name in names:
                register(name, cast)
    try:
        yield
    finally:
        library._destroy()


# -- recording -------------------------------------------------------------------------------------

Op = collections.namedtuple("Op", "name phase scope kind bytes shapes where")
FLA_DIR = os.sep + "fla" + os.sep
TORCH_DIR = os.path.dirname(torch.__file__)
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
NO_WRITE = {"_unsafe_view", "lift_fresh", "detach", "alias", "_local_scalar_dense", "is_nonzero", "equal",
            "_has_compatible_shallow_copy_type", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
            "_fused_sdp_choice", "is_same_size", "_assert_async"}
GEMMS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "matmul", "dot", "convolution",
         "convolution_backward"}
REDUCTIONS = {"sum", "mean", "norm", "linalg_vector_norm", "amax", "amin", "prod", "var", "var_mean", "std",
              "cumsum", "cumprod", "logsumexp", "max", "min", "_softmax", "_log_softmax"}
COPIES = {"clone", "cat", "stack", "index", "index_select", "gather", "slice_scatter",
          "select_scatter", "repeat", "expand_copy", "roll", "flip", "constant_pad_nd"}
FILLS = {"zeros", "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "fill_", "zero_", "full",
         "full_like", "scalar_tensor", "new_full"}


def _written(func, args, out):
    """Bytes func writes: its outputs, but nothing for a view, an allocation or a query; an in-place or out=
    op writes its destination."""
    name = func.overloadpacket.__name__
    if func.is_view or name in ALLOCATIONS or name in NO_WRITE:
        return 0, []
    outs = [x for x in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(x, torch.Tensor)]
    return sum(x.numel() * x.element_size() for x in outs), [(tuple(x.shape), str(x.dtype)[6:]) for x in outs]


def _kind(func, args, kwargs, bytes_written):
    """none (writes nothing), GEMM, cast, copy, reduction, fill, elementwise or other."""
    name = func.overloadpacket.__name__
    if bytes_written == 0:
        return "none"
    if name in GEMMS:
        return "GEMM"
    if name == "_to_copy":
        return "cast" if kwargs.get("dtype") not in (None, args[0].dtype) else "copy"
    if name == "copy_":
        return "cast" if args[0].dtype != args[1].dtype else "copy"
    for kind, names in (("copy", COPIES), ("reduction", REDUCTIONS), ("fill", FILLS)):
        if name in names:
            return kind
    return "elementwise" if torch.Tag.pointwise in func.tags or name.endswith("_backward") else "other"


class OpLog(TorchDispatchMode):
    """Every aten op under it: Op(name, phase, scope, kind, bytes written, output shapes)."""

    def __init__(self):
        super().__init__()
        self.ops, self.phase, self.scope = [], "forward", "glue"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.scope == "kernel":  # recorded once, as the call (kernel_call)
            return out
        written, shapes = _written(func, args, out)
        kind = _kind(func, args, kwargs, written)
        scope, where = self.scope, _caller()
        if scope == "glue" and FLA_DIR in where:
            scope = "fla"  # fla's own Python around its launches
        self.ops.append(Op(func.overloadpacket.__name__, self.phase, scope, kind, written, shapes, where))
        return out

    @contextlib.contextmanager
    def kernel_call(self, name):
        """One op for the kernel `name`, whatever it runs inside (a shape may change what SDPA runs)."""
        if self.scope == "kernel":
            yield
            return
        self.ops.append(Op(name, self.phase, "kernel", "kernel", 0, [], ""))
        outer, self.scope = self.scope, "kernel"
        try:
            yield
        finally:
            self.scope = outer


def _caller():
    """file:line of the innermost frame outside torch and this script: the code that ran the op."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH_DIR) or
                                 frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "autograd"
    return f"{os.path.relpath(frame.f_code.co_filename, ROOT)}:{frame.f_lineno}"


@contextlib.contextmanager
def kernels_scoped(log):
    """fla's Triton launches, and torch's scaled_dot_product_attention (after autocast's casts of its
    arguments, which are glue), are recorded as the kernel."""
    from triton.runtime.interpreter import InterpretedFunction

    launch, attention = InterpretedFunction.run, torch.nn.functional.scaled_dot_product_attention

    def scoped_launch(self, *args, **kwargs):
        with log.kernel_call(self.fn.__name__):
            return launch(self, *args, **kwargs)

    def scoped_attention(q, k, v, attn_mask=None, *args, **kwargs):
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
        q, k, v, attn_mask = (None if x is None or not x.is_floating_point() else x.to(dtype)
                              for x in (q, k, v, attn_mask))
        return _KernelCall.apply(log, lambda *x: attention(*x, *args, **kwargs), q, k, v, attn_mask)

    InterpretedFunction.run, torch.nn.functional.scaled_dot_product_attention = scoped_launch, scoped_attention
    try:
        yield
    finally:
        InterpretedFunction.run, torch.nn.functional.scaled_dot_product_attention = launch, attention


def _same(t):
    return t


class _KernelCall(torch.autograd.Function):
    """fn(*inputs) with every op of its forward and backward recorded as the kernel."""

    @staticmethod
    def forward(ctx, log, fn, *inputs):
        ctx.log = log
        with log.kernel_call("scaled_dot_product_attention"), torch.enable_grad(), \
                torch.autocast("cpu", enabled=False), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            ctx.inputs = [None if x is None else x.detach().requires_grad_(x.requires_grad) for x in inputs]
            ctx.out = fn(*ctx.inputs)
        out = ctx.out.detach()
        ctx.save_for_backward(*[x for x in inputs if x is not None], out)  # what a fused kernel keeps (not
        # what the CPU's SDPA, which may materialise the attention weights, keeps inside)
        return out

    @staticmethod
    def backward(ctx, grad):
        with ctx.log.kernel_call("scaled_dot_product_attention_backward"):
            wanted = [x for x in ctx.inputs if x is not None and x.requires_grad]
            grads = iter(torch.autograd.grad(ctx.out, wanted, grad))
        return (None, None, *(next(grads) if x is not None and x.requires_grad else None for x in ctx.inputs))


# -- one row at one shape ------------------------------------------------------------------------------

def attention_of(row, length):
    """The row's decoder self-attention (one layer of train_step.py's model at the GPT-2-small shape) and
    the future mask its decoder gives it."""
    from examples.recipes.decoding_cost import build_random_model, numbered_dictionary

    arch, flags = ROWS[row]
    flags = [*flags, *(["--fwp-backend", "fla"] if arch.startswith("fwp") else [])]
    model = build_random_model("language_modeling", arch, model_flags("gpt2-small", length, 1) + flags,
                               numbered_dictionary(100)).train()
    return model.decoder.layers[0].self_attn, model.decoder


PRECISIONS = ("amp", "cast")


def recorded_step(row, B, T, seed=0, precision="amp"):
    """The ops of one forward and backward of the row's attention on a [T, B, C] input, and the bytes of
    what its forward keeps for the backward pass (each storage once; the parameters aside); precision: "amp", a
    float32 layer under autocast, or "cast", the layer and its input in the half type."""
    from fairseq_fwp.testing import triton_interpreter

    attention, decoder = attention_of(row, T)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(T, B, attention.embed_dim, generator=generator)
    if precision == "cast":
        attention, x = attention.to(HALF), x.to(HALF)
    x.requires_grad_()
    mask = decoder.buffered_future_mask(x) if row == "fairseq-softmax" else None
    log, saved = OpLog(), {}

    def keep(t):
        if not isinstance(t, torch.nn.Parameter):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with triton_interpreter(), kernels_scoped(log), cuda_autocast_policy():
        with log, torch.autocast("cpu", dtype=HALF, enabled=precision == "amp"), \
                torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out, _ = attention(query=x, key=x, value=x, key_padding_mask=None, incremental_state=None,
                               need_weights=False, attn_mask=mask)
        grad = torch.randn(out.shape, generator=generator).to(out.dtype)
        log.phase = "backward"
        with log:
            out.backward(grad)
    return log.ops, sum(saved.values())


# -- the table -----------------------------------------------------------------------------------------

def fitted(row, shapes=SHAPES, precision="amp"):
    """The row's ops (at the first shape) and, per op, its bytes fitted as a B T + b B + c + d T^2; the last
    coefficients are those of what the forward keeps for the backward pass."""
    runs, kept = zip(*[recorded_step(row, B, T, precision=precision) for B, T in shapes])
    names = [[(op.name, op.phase, op.scope) for op in ops] for ops in runs]
    if any(n != names[0] for n in names[1:]):
        raise AssertionError(f"{row}: the op sequence changed with the shape")
    features = torch.tensor([[B * T, B, 1, T * T] for B, T in shapes], dtype=torch.float64)
    written = torch.tensor([[op.bytes for op in ops] + [saved] for ops, saved in zip(runs, kept)],
                           dtype=torch.float64)
    coefficients = torch.linalg.lstsq(features, written).solution  # [4, ops]
    residual = (features @ coefficients - written).abs().max().item()
    if residual > 0.5:
        raise AssertionError(f"{row}: bytes not linear in B T, B, 1 and T^2 (residual {residual})")
    *coefficients, saved = coefficients.t().round().tolist()
    return runs[0], coefficients, saved


def at_step(coefficient):
    per_token, per_sequence, constant, squared = coefficient
    return per_token * TOKENS + per_sequence * (TOKENS // LENGTH) + constant + squared * LENGTH ** 2


KINDS = ("copy", "cast", "reduction", "elementwise", "fill", "other")  # the glue; then fla's own, GEMMs, kernels


def summarize(ops, coefficients):
    """{(phase, kind): [ops, bytes per token, MB at the step]} over the glue, plus the GEMMs and kernel."""
    table = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for op, coefficient in zip(ops, coefficients):
        if op.kind == "none":
            continue
        kind = op.kind if op.scope != "fla" or op.kind in ("copy", "cast") else "fla"
        for key in ((op.phase, kind), ("both", kind)):
            table[key][0] += 1
            table[key][1] += coefficient[0]
            table[key][2] += at_step(coefficient) / 1e6
    return table


def print_table(results, precision):
    print(f"# glue around each row's attention kernel, one layer (d 768, 12 heads of 64), forward + backward, "
          f"--precision {precision}; bytes written per token, and MB at T = {LENGTH}, {TOKENS} tokens; "
          f"{describe_machine()}")
    print("| row | phase | glue ops | glue bytes/token | glue MB | copies | casts | reductions | elementwise | "
          "fills | other | fla's own | GEMMs | kernel calls |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row, table in results.items():
        for phase in ("forward", "backward", "both"):
            glue = [table.get((phase, kind), [0, 0, 0]) for kind in KINDS]
            cells = [f"{n} / {b:,.0f}" for n, b, _ in glue] + [
                f"{n} / {b:,.0f}" for n, b, _ in (table.get((phase, kind), [0, 0, 0]) for kind in ("fla", "GEMM"))]
            print(f"| {row} | {phase} | {sum(g[0] for g in glue)} | {sum(g[1] for g in glue):,.0f} | "
                  f"{sum(g[2] for g in glue):,.1f} | " + " | ".join(cells) +
                  f" | {table.get((phase, 'kernel'), [0])[0]} |")
    print("\ncells: ops / bytes per token (the part of an op's output that grows with the tokens); glue MB: "
          f"at T = {LENGTH}, B = {TOKENS // LENGTH}, with what does not grow with the tokens (the weights' casts, "
          "per-sequence states, the softmax's T x T mask). fla's own: fills and elementwise ops inside fla's "
          "Python (its copies and casts, which the layout and dtype fla is given decide, are glue)")


def print_ops(row, ops, coefficients):
    print(f"\n### {row}: every op outside the kernel that writes\n")
    print("| # | phase | op | kind | bytes/token | MB at the step | outputs at B, T = "
          f"{SHAPES[0][0]}, {SHAPES[0][1]} | run by |")
    print("|---|---|---|---|---|---|---|---|")
    for i, (op, coefficient) in enumerate(zip(ops, coefficients)):
        if op.kind != "none" and op.scope != "kernel":
            shapes = ", ".join(f"{list(s)} {d}" for s, d in op.shapes)
            kind = "fla's own" if op.scope == "fla" and op.kind not in ("copy", "cast") else op.kind
            print(f"| {i} | {op.phase} | {op.name} | {kind} | {abs(coefficient[0]):,.0f} | "
                  f"{at_step(coefficient) / 1e6:,.2f} | {shapes} | {op.where.split('site-packages/')[-1]} |")


def describe_machine():
    import fla
    import triton
    return (f"CPU ({os.cpu_count()} cores), torch {torch.__version__}, Triton {triton.__version__} (interpreter), "
            f"fla-core {fla.__version__}, Python {platform.python_version()}, {datetime.date.today().isoformat()}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(TABLE_ROWS))
    parser.add_argument("--ops", nargs="*", default=[], metavar="ROW", help="also list every op of these rows")
    parser.add_argument("--precision", choices=PRECISIONS, default="amp",
                        help="amp: a float32 layer under autocast (fairseq's --amp); cast: the layer and its input "
                             "in the half type (fairseq's --fp16 and --bf16)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results, kept, listed = {}, {}, []
    for row in args.rows:
        ops, coefficients, kept[row] = fitted(row, precision=args.precision)
        results[row] = summarize(ops, coefficients)
        if row in args.ops:
            listed.append((row, ops, coefficients))
    print_table(results, args.precision)
    print("\n| row | kept for the backward pass: bytes/token | MB at the step |\n|---|---|---|")
    for row, coefficient in kept.items():
        print(f"| {row} | {coefficient[0]:,.0f} | {at_step(coefficient) / 1e6:,.1f} |")
    print("\nkept: every storage the forward saves for the backward pass, once (the parameters aside; for "
          "softmax, the inputs and output of its fused kernel)")
    for row, ops, coefficients in listed:
        print_ops(row, ops, coefficients)


if __name__ == "__main__":
    main()
