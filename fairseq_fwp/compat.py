"""Fixes for the fairseq/torch versions we run on, applied when the plugin loads.

1. torch >= 2.6 loads with ``weights_only=True`` by default, which refuses
   fairseq checkpoints (they pickle argparse/omegaconf configs). fairseq's
   own checkpoint loader gets ``weights_only=False`` back: checkpoints are
   files the user trained, the trust model fairseq always had.
2. fairseq-fixed 0.12.3.1 drops the last batch whenever its size is not a
   multiple of --required-batch-size-multiple (8 by default), so
   fairseq-generate silently skipped sentences and eval-lm skipped text.
   The dropped indices are put back as a final batch.
"""
import functools
import types

import numpy as np
import torch


def _patch_checkpoint_loading():
    from fairseq import checkpoint_utils

    if isinstance(checkpoint_utils.torch, types.ModuleType) and checkpoint_utils.torch is not torch:
        return  # already patched

    @functools.wraps(torch.load)
    def load(*args, **kwargs):
        kwargs.setdefault("weights_only", False)
        return torch.load(*args, **kwargs)

    # A torch look-alike for that one module only; torch.load stays untouched elsewhere.
    proxy = types.ModuleType("torch")
    proxy.__dict__.update({k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    proxy.load = load
    checkpoint_utils.torch = proxy


def _patch_batch_by_size():
    from fairseq.data import data_utils

    original = data_utils.batch_by_size
    if getattr(original, "_fwp_keeps_last_batch", False):
        return

    @functools.wraps(original)
    def batch_by_size(indices, *args, **kwargs):
        batches = original(indices, *args, **kwargs)
        indices = np.fromiter(indices, dtype=np.int64) if not isinstance(indices, np.ndarray) else indices
        batched = sum(len(b) for b in batches)
        if batched < len(indices):
            kept = np.concatenate(batches) if batches else np.empty(0, dtype=np.int64)
            dropped = indices[~np.isin(indices, kept)]
            batches = list(batches) + [dropped]
        return batches

    batch_by_size._fwp_keeps_last_batch = True
    data_utils.batch_by_size = batch_by_size


def apply():
    _patch_checkpoint_loading()
    _patch_batch_by_size()
