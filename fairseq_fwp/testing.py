"""Test helpers for users and for this project: fla's Triton kernels on CPU tensors.

``triton_interpreter()`` lets ``backend="fla"`` run on CPU tensors through
Triton's interpreter, the chunkwise kernels (``chunk_delta_rule`` and the
others that half-precision training uses on GPUs) included::

    # TRITON_INTERPRET=1 must be in the environment before triton is imported
    from fairseq_fwp.testing import triton_interpreter
    with triton_interpreter():
        out, W = fast_weight_delta(q, k, v, beta, backend="fla")   # float16 or float32 CPU tensors

Three things stand between fla's kernels and the interpreter, and the context
manager deals with them while it is open:

- Triton's autotuner times its configurations on a GPU. The interpreter has
  nothing to time (Triton 3.6 fails looking for a GPU driver), and every
  configuration computes the same result, so each autotuner sees only its
  first one.
- A compiled kernel's ``for i in range(n)`` counter is a Triton tensor
  (fla's chunk kernels call ``i_t.to(tl.int64)`` on it); the interpreter
  hands the body a Python int. Each kernel's source is rewritten once, so
  that the counter is made a tensor at the top of the loop body, the way
  the interpreter already rewrites assignments.
- Triton 3.6's interpreter reads a one-element tensor used as an index with
  ``int(array)``, which numpy 2 refuses for one-dimensional arrays; it is
  read through ``squeeze()``, as newer Triton does.

bfloat16 is not computed faithfully by the interpreter (its results differ
silently from a GPU's): test float16 and float32 on the CPU, bfloat16 on a GPU.
"""
import ast
import contextlib
import os
from unittest.mock import patch


class TritonInterpreterUnavailable(RuntimeError):
    """Triton's interpreter cannot run fla's kernels in this process."""


def _interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_interpreter_is_on():
    if not _interpreting():
        raise TritonInterpreterUnavailable(
            "triton_interpreter() needs TRITON_INTERPRET=1 in the environment before triton is imported "
            "(for example `TRITON_INTERPRET=1 python ...`, or os.environ['TRITON_INTERPRET'] = '1' at the top "
            "of the program)")
    try:
        from fla.ops.common import chunk_delta_h
    except ImportError as err:
        raise TritonInterpreterUnavailable(f"triton_interpreter() runs fla's kernels, and fla is missing ({err}): "
                                           "pip install fla-core triton") from err
    from triton.runtime.interpreter import InterpretedFunction

    kernel = chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64
    while not isinstance(kernel, InterpretedFunction) and hasattr(kernel, "fn"):
        kernel = kernel.fn  # through the autotuner and heuristics wrappers
    if not isinstance(kernel, InterpretedFunction):
        raise TritonInterpreterUnavailable(
            "TRITON_INTERPRET=1 was set after triton compiled fla's kernels (they are GPU kernels in this "
            "process): set it in the environment before triton, fla or fairseq_fwp's fla backend is imported")


def _loop_counters_as_tensors_transformer():
    from triton.runtime.interpreter import ASTTransformer

    class LoopCountersAsTensors(ASTTransformer):
        """The interpreter's own rewrite, plus ``i = i`` (which it turns into a tensor) at the top of
        every ``for i in ...`` body."""

        def visit_For(self, node):
            node = self.generic_visit(node)
            if isinstance(node.target, ast.Name):
                counter = node.target.id
                again = ast.Assign(targets=[ast.Name(id=counter, ctx=ast.Store())],
                                   value=ast.Name(id=counter, ctx=ast.Load()))
                node.body.insert(0, ast.copy_location(self.visit_Assign(again), node))
            return node

    return LoopCountersAsTensors()


def _first_config_only(run):
    """Autotuner.run that sees only its first configuration, so it has nothing to time (a list of one
    is never benchmarked, in every Triton version)."""
    def run_first_config(self, *args, **kwargs):
        configs, self.configs = self.configs, self.configs[:1]
        try:
            return run(self, *args, **kwargs)
        finally:
            self.configs = configs

    return run_first_config


def _squeezed_index(patch_lang_tensor):
    """The interpreter's tensor patch, with a one-element tensor used as an index (``range(NT)``) read
    through squeeze(): older Triton (3.6) calls int() on a one-dimensional array, which numpy 2 refuses."""
    def squeezed(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    return squeezed


@contextlib.contextmanager
def triton_interpreter():
    """Run fla's Triton kernels (chunk and fused_recurrent) on CPU tensors while open; see the module doc.

    Raises TritonInterpreterUnavailable, saying what to do, when TRITON_INTERPRET=1 was not set before
    triton was imported, or fla is missing.
    """
    _check_interpreter_is_on()
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.interpreter import FunctionRewriter, InterpretedFunction

    from .ops import fla

    rewritten = InterpretedFunction.rewritten_fn
    saved = dict(rewritten)
    rewritten.clear()  # kernels rewritten before (without the loop rewrite) are rewritten again
    fla.INTERPRETER_OPEN.append(True)  # fla's backend takes CPU tensors while it is open
    try:
        with patch.object(Autotuner, "run", _first_config_only(Autotuner.run)), \
                patch.object(FunctionRewriter, "ast_transformer", _loop_counters_as_tensors_transformer()), \
                patch.object(interpreter, "_patch_lang_tensor", _squeezed_index(interpreter._patch_lang_tensor)):
            yield
    finally:
        fla.INTERPRETER_OPEN.pop()
        rewritten.clear()
        rewritten.update(saved)


__all__ = ["TritonInterpreterUnavailable", "triton_interpreter"]
