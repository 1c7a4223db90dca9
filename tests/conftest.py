import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The repo (tests run without `pip install -e .`) and the quickstart pipeline.
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "quickstart"))

# Without a GPU, fla's Triton kernels run through Triton's CPU interpreter
# (tests/test_fla_interpreted.py). Triton reads this when a kernel is defined,
# so it must be set before fla (and with it triton) is first imported. With a
# GPU, fla's tests run its real kernels, and the GPU check runs the interpreted
# ones in a process of their own.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
