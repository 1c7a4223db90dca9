"""The GPU tests' cases that the GPU check runs (scripts/gpu_check_plugin.py deselects the others there).

On a cold GPU machine every new head count H, head size D or Dv, dtype, or state-or-none costs each of fla's
autotuned kernels a new autotuning: every config of its list compiled (48 for some) and timed, about 1.2 s
each. So the check runs the GPU tests at a few shapes, which other parts share: the first is the heads of
examples/speed/train_step.py's GPT-2-small rows (12 heads of 64), over three chunks of 64, the last partial;
then one decoding step (fla's recurrent kernels, cheap to compile), and float32's recurrent kernels with
D != Dv. float16 reaches fla's chunk kernels in the check's half-precision trainings (--fp16, --amp).
A GPU test may draw its GPU cases from these directly.

The selection narrows the files whose GPU tests reach fla's kernels (FLA_FILES: scripts/gpu_check_plan.py
counts each file's kernels); the others (the csrc kernels: one nvcc build, whatever the case) run whole.
"""
import os

import torch

FLA_FILES = ("test_fla.py", "test_channel_rules.py", "test_attention.py")
SHAPES = ((2, 12, 200, 64, 64), (2, 2, 1, 128, 128), (2, 4, 333, 64, 48))  # (B, H, T, D, Dv)
DTYPES = (torch.bfloat16, torch.float32)


def is_shape(value):
    return isinstance(value, tuple) and len(value) == 5 and all(isinstance(x, int) for x in value)


def selected(path, params):
    """Whether the GPU check runs a GPU test case of the file at `path` with these parameters (pytest's
    callspec.params): outside FLA_FILES every case; in them, each shape among SHAPES and each dtype among
    DTYPES (a parameter of another kind selects nothing)."""
    if os.path.basename(str(path)) not in FLA_FILES:
        return True
    return all(value in SHAPES for value in params.values() if is_shape(value)) and all(
        value in DTYPES for value in params.values() if isinstance(value, torch.dtype))
