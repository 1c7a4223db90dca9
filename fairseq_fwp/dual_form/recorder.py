"""Hooks that record, for chosen nn.Linear layers, every (x_t, e_t) pair of training.

Corollary 1 (Eq. 12): W_T = W_0 + sum_t e_t x_t^T with e_t = -lr * dL/dy_t.
In fairseq one update is
    grad = (1 / sample_size) * sum over the --update-freq micro-batches of sum_t g_t x_t^T
    W   <- W - lr * grad                     (plain SGD)
where g_t is the gradient of the summed loss w.r.t. the layer output y_t
(Trainer.train_step: multiply_grads(1 / sample_size), then the optimizer
step). So e_t = scale * g_t with scale = -lr / sample_size, one scale per
update. A bias is the same layer on a constant input 1: b_T = b_0 + sum_t e_t.

Per token the recorder keeps x_t (forward hook on the module) and g_t (a
hook on the output tensor), for non-padding positions only. Before each
step it checks the rows against the gradient the optimizer is about to
apply (along a fixed random direction), so a missed token, a second use of
the layer or any rescaling of the gradient stops training with an error
instead of giving a silently wrong record.
"""
import logging

import numpy as np
import torch

from .exactness import check_layer, check_optimizer
from .storage import INDEX_DTYPE, RecordWriter, ensure_no_record

logger = logging.getLogger(__name__)

# Largest relative disagreement between the recorded rows and the applied
# gradient. Float32 round-off is ~1e-6 here; one missing token of a
# 1000-token batch is ~1e-3.
CONSISTENCY_TOLERANCE = 1e-4
BATCH_FIRST, TIME_FIRST = "batch_first", "time_first"


def probe_layouts(model, modules, token):
    """For each module, whether its input is [B, T, d] or [T, B, d] (fairseq layers run time-first).

    One forward of a 2 x 3 batch in eval mode, without gradients and with
    the RNG state restored, so the training run is unchanged.
    """
    shapes = {name: [] for name in modules}
    handles = [m.register_forward_hook(lambda mod, inp, out, name=name: shapes[name].append(tuple(inp[0].shape)))
               for name, m in modules.items()]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(torch.full((2, 3), token, dtype=torch.long))
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    layouts = {}
    for name, seen in shapes.items():
        if not seen:
            raise ValueError(f"--dual-form-record: {name} is never called as a module in the forward pass "
                             "(e.g. fairseq's MultiheadAttention reads q/k/v_proj weights directly); "
                             "its updates cannot be recorded")
        if len(seen) > 1:
            raise ValueError(f"--dual-form-record: {name} runs {len(seen)} times per forward pass; "
                             "only layers applied once per token can be recorded")
        if seen[0][:2] == (2, 3) and len(seen[0]) == 3:
            layouts[name] = BATCH_FIRST
        elif seen[0][:2] == (3, 2) and len(seen[0]) == 3:
            layouts[name] = TIME_FIRST
        else:
            raise ValueError(f"--dual-form-record: {name} reads inputs of shape {seen[0]} for a batch of "
                             "2 sequences x 3 tokens; only per-token layers ([B, T, d] or [T, B, d]) can be recorded")
    return layouts


def _batch_first(tensor, layout):
    return tensor.transpose(0, 1) if layout == TIME_FIRST else tensor


class LayerTap:
    """The x_t read and the g_t = dL/dy_t received by one nn.Linear, per micro-batch."""

    def __init__(self, module, layout):
        self.module, self.layout = module, layout
        self.mask = None  # [B, T] non-padding positions while recording; None otherwise (validation)
        self.keys, self.grads = [], []
        module.register_forward_hook(self._on_forward)

    def _on_forward(self, module, inputs, output):
        if self.mask is None:
            return
        mask = self.mask
        self.keys.append(_batch_first(inputs[0], self.layout)[mask].detach().float().cpu())
        output.register_hook(lambda grad: self.grads.append(_batch_first(grad, self.layout)[mask].float().cpu()))

    def take(self):
        """(X [n, d_in], G [n, d_out]) of the micro-batches since the last take."""
        if len(self.keys) != len(self.grads):
            raise RuntimeError(f"{len(self.keys)} forward passes but {len(self.grads)} backward passes were recorded")
        keys = torch.cat(self.keys) if self.keys else torch.empty(0, self.module.in_features)
        grads = torch.cat(self.grads) if self.grads else torch.empty(0, self.module.out_features)
        self.keys, self.grads = [], []
        return keys, grads


def consistency(keys, grads, weight, bias, sample_size, direction):
    """Relative disagreement between the recorded rows and weight.grad (and bias.grad).

    Compares grad @ v with (1 / sample_size) * sum_t g_t (x_t . v) for a fixed
    direction v, relative to the size of the terms of that sum (not of the
    sum, which may cancel).
    """
    if weight.grad is None:
        raise RuntimeError("the layer got no gradient")
    keys, grads = keys.double(), grads.double()
    along = keys @ direction
    recorded = grads.T @ along / sample_size
    applied = weight.grad.double() @ direction
    terms = (grads.norm(dim=1) * along.abs()).sum() / sample_size
    mismatch = ((recorded - applied).norm() / terms.clamp_min(1e-30)).item()
    if bias is not None:
        recorded_b = grads.sum(0) / sample_size
        terms_b = grads.norm(dim=1).sum() / sample_size
        mismatch = max(mismatch, ((recorded_b - bias.grad.double()).norm() / terms_b.clamp_min(1e-30)).item())
    return mismatch


class DualFormRecorder:
    """Records the dual form of the named layers of `model` into `record_dir`, one update at a time."""

    def __init__(self, model, layer_names, record_dir, dtype, pad, probe_token, metadata):
        self.modules = {name: check_layer(model, name) for name in layer_names}
        layouts = probe_layouts(model, self.modules, probe_token)
        ensure_no_record(record_dir)
        self.taps = {name: LayerTap(m, layouts[name]) for name, m in self.modules.items()}
        self.record_dir, self.dtype, self.pad = record_dir, dtype, pad
        self.metadata = {**metadata, "layouts": layouts}
        generator = torch.Generator().manual_seed(0)  # own generator: training's RNG stream is untouched
        self.directions = {name: torch.randn(m.in_features, generator=generator, dtype=torch.float64)
                           for name, m in self.modules.items()}
        self.initial_weights = None  # taken at the first micro-batch: after any --restore-file loading
        self.writer = None  # opened at the first step, once the optimizer is known to be plain SGD
        self._reset_update(None)
        per_token = sum(m.in_features + m.out_features for m in self.modules.values())
        logger.info(f"dual-form record of {', '.join(layer_names)} into {record_dir}: "
                    f"{per_token} {dtype} values per token")

    def _reset_update(self, update_num):
        self.update_num, self.index_rows, self.sample_size, self.last_was_dummy = update_num, [], 0.0, False
        for tap in self.taps.values():
            tap.keys, tap.grads = [], []

    def _take_initial_weights(self, update_num):
        if update_num != 0:
            raise ValueError(f"--dual-form-record must see the run from update 0, but training resumes at update "
                             f"{update_num}: use a fresh --save-dir (or --reset-optimizer --reset-lr-scheduler)")
        self.initial_weights = {name: (m.weight.detach().cpu().numpy().copy(),
                                       None if m.bias is None else m.bias.detach().cpu().numpy().copy())
                                for name, m in self.modules.items()}

    def _open_writer(self):
        dims = {name: (m.in_features, m.out_features, m.bias is not None) for name, m in self.modules.items()}
        self.writer = RecordWriter(self.record_dir, dims, self.dtype, self.metadata)
        for name, (weight, bias) in self.initial_weights.items():
            self.writer.write_initial_weights(name, weight, bias)

    def micro_batch(self, sample, blocks, update_num, ignore_grad, run):
        """Runs `run()` (forward + backward of one micro-batch) with the hooks on; returns its result."""
        if self.initial_weights is None:
            self._take_initial_weights(update_num)
        if update_num != self.update_num:  # a new update; drops rows of an attempt that never stepped (OOM)
            self._reset_update(update_num)
        # As Trainer.train_step: every micro-batch adds to sample_size, and a
        # dummy last one (ignore_grad: loss * 0, so no gradient) zeroes it.
        self.last_was_dummy = ignore_grad
        if ignore_grad:
            result = run()
            self.sample_size += float(result[1])
            return result
        mask = sample["net_input"]["src_tokens"].ne(self.pad)
        for tap in self.taps.values():
            tap.mask = mask
        try:
            result = run()
        finally:
            for tap in self.taps.values():
                tap.mask = None
        self.index_rows.append(self._index(sample["id"], mask, blocks, update_num))
        self.sample_size += float(result[1])
        return result

    @staticmethod
    def _index(sample_ids, mask, blocks, update_num):
        """Index rows of the non-padding tokens; blocks: [start, end) in the token stream of each sample."""
        lengths = blocks[sample_ids.numpy(), 1] - blocks[sample_ids.numpy(), 0]
        if not np.array_equal(mask.sum(1).numpy(), lengths):
            raise ValueError("dual-form record: src_tokens do not line up with the training blocks "
                             "(unsupported dataset options?)")
        batch, position = mask.nonzero(as_tuple=True)
        ids = sample_ids[batch].numpy()
        rows = np.empty(len(ids), dtype=INDEX_DTYPE)
        rows["update"] = update_num
        rows["sample_id"] = ids
        rows["position"] = position.numpy()
        # src_tokens[p] of a block starting at stream offset s is stream[s + p - 1] (TokenBlockDataset)
        rows["token_offset"] = blocks[ids, 0] + rows["position"] - 1
        return rows

    def before_step(self, optimizer, update_num):
        """Called just before optimizer.step(): checks and writes this update's rows."""
        if self.writer is None:
            check_optimizer(optimizer, [p for m in self.modules.values() for p in m.parameters()])
            self._open_writer()
        if update_num != self.update_num:
            raise RuntimeError(f"dual-form record: update {update_num} ran no micro-batch through the recorder")
        lr = self._lr(optimizer)
        sample_size = 0.0 if self.last_was_dummy else self.sample_size  # as Trainer.train_step
        normaliser = sample_size or 1.0  # as Trainer: multiply_grads(1 / (sample_size or 1.0))
        keys, grads, mismatch = {}, {}, 0.0
        for name, tap in self.taps.items():
            keys[name], grads[name] = tap.take()
            m = self.modules[name]
            layer_mismatch = consistency(keys[name], grads[name], m.weight, m.bias, normaliser, self.directions[name])
            if layer_mismatch > CONSISTENCY_TOLERANCE:
                raise RuntimeError(
                    f"dual-form record of {name} does not match the gradient applied at update {update_num} "
                    f"(relative mismatch {layer_mismatch:.2e}); is the layer used outside its own forward, "
                    "or is the gradient rescaled?")
            mismatch = max(mismatch, layer_mismatch)
        index_rows = np.concatenate(self.index_rows) if self.index_rows else np.empty(0, dtype=INDEX_DTYPE)
        self.writer.append_update(update_num, lr, sample_size, -lr / normaliser, index_rows,
                                  {n: k.numpy() for n, k in keys.items()}, {n: g.numpy() for n, g in grads.items()},
                                  mismatch)
        self._reset_update(None)

    def _lr(self, optimizer):
        """The learning rate of this step; one for all recorded layers, as the record keeps one scale per update."""
        rates = set()
        for name, m in self.modules.items():
            group = next((g for g in optimizer.optimizer.param_groups if any(p is m.weight for p in g["params"])), None)
            if group is None:
                raise RuntimeError(f"dual-form record: {name} is not in any optimizer parameter group (frozen?)")
            rates.add(float(group["lr"]))
        if len(rates) > 1:
            raise ValueError(f"dual-form record: the recorded layers have different learning rates {sorted(rates)}")
        return rates.pop()
