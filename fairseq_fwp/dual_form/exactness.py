"""When the dual form of a trained layer is exact, and the refusals that keep it so.

Corollary 1 (Eq. 12) needs W_T = W_0 + sum_t e_t x_t^T, i.e. every change of
the weight is a sum of outer products of the layer's own (input, error)
pairs. That holds for plain SGD: W <- W - lr * grad. It fails with
momentum or Adam (the step mixes past gradients and rescales them), weight
decay (adds -lr*wd*W), gradient clipping (a factor that depends on every
other parameter), fp16/bf16 (loss scaling, low-precision copies of W),
several workers (other workers' tokens), and shared weights (the update
includes the other use's gradient). Each case is refused with a message
that names the flag, before the first update.
"""
import torch
from torch import nn

NEEDS = "the dual form (W = W0 + sum_t e_t x_t^T) is exact only for plain SGD"


def check_training_config(cfg):
    """cfg: the task config; its interpolated fields mirror the run's global flags."""
    if cfg.optimizer != "sgd":
        raise ValueError(f"--dual-form-record: {NEEDS}; got --optimizer {cfg.optimizer}, use --optimizer sgd")
    flags = {"--fp16": cfg.fp16, "--bf16": cfg.bf16, "--memory-efficient-fp16": cfg.memory_efficient_fp16,
             "--amp": cfg.amp, "--use-bmuf": cfg.use_bmuf}
    for flag, on in flags.items():
        if on:
            raise ValueError(f"--dual-form-record: {NEEDS} in float32; remove {flag}")
    if cfg.clip_norm != 0:
        raise ValueError(f"--dual-form-record: {NEEDS}; gradient clipping rescales the update, "
                         f"set --clip-norm 0 (got {cfg.clip_norm})")
    if cfg.distributed_world_size > 1:
        raise ValueError(f"--dual-form-record records one process: train on one device "
                         f"(got --distributed-world-size {cfg.distributed_world_size})")


def check_optimizer(optimizer, weights):
    """optimizer: fairseq's optimizer wrapper; weights: the recorded nn.Parameters."""
    inner = getattr(optimizer, "optimizer", None)
    if type(inner) is not torch.optim.SGD:
        raise ValueError(f"--dual-form-record: {NEEDS}; the optimizer is {type(inner).__name__}")
    for group in inner.param_groups:
        if not any(p is w for p in group["params"] for w in weights):
            continue
        if group["momentum"] != 0 or group.get("nesterov"):
            raise ValueError(f"--dual-form-record: {NEEDS}; set --momentum 0 (got {group['momentum']})")
        if group["weight_decay"] != 0:
            raise ValueError(f"--dual-form-record: {NEEDS}; set --weight-decay 0 (got {group['weight_decay']})")


def check_layer(model, name):
    """The named module must be an nn.Linear whose parameters no other module uses."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        raise ValueError(f"--dual-form-record: the model has no module {name!r}; "
                         f"its linear layers are: {', '.join(linear)}") from None
    if not isinstance(module, nn.Linear):
        raise ValueError(f"--dual-form-record: {name} is a {type(module).__name__}, not an nn.Linear "
                         "(adaptive softmax and other projections are not supported)")
    for param_name in ("weight", "bias"):
        param = getattr(module, param_name)
        if param is None:
            continue
        others = [n for n, p in model.named_parameters(remove_duplicate=False)
                  if p is param and n != f"{name}.{param_name}"]
        if others:
            raise ValueError(
                f"--dual-form-record: {name}.{param_name} is shared with {', '.join(others)} "
                "(e.g. --share-decoder-input-output-embed); its update includes the other use's gradient, so "
                "the dual form of this layer alone is not exact. Train without weight tying.")
    return module
