"""A softmax checkpoint converted into the fast-weight model a fairseq-train command builds: every parameter
the two share copied, the new ones started as ungated or fresh, a complete checkpoint at update 0 saved
(what is copied and refused: the command's help, cli.py)."""
import os

import torch

from ..modules.fast_weight_attention import FastWeightAttention
from .attention_transfer import DEFAULT_LR, transfer_attention
from .differences import computation_differences

# State-dict entries that are not parameters: fairseq's version stamps and the
# sinusoidal positions' placeholder; a fast-weight model may do without them.
NOT_PARAMETERS = ("version", "_float_tensor")


def transfer(source, target):
    """Copy every entry of `source` that `target` has (state dicts).

    Returns (the new state dict, the names that kept their initialisation).
    Raises ValueError naming a parameter whose shape differs, or softmax
    parameters the target has no place for.
    """
    state = dict(target)
    unplaced = []
    for name, value in source.items():
        if name not in target:
            if not name.endswith(NOT_PARAMETERS):
                unplaced.append(name)
            continue
        value = _per_write(name, value, target[name])
        if tuple(value.shape) != tuple(target[name].shape):
            raise ValueError(f"parameter {name}: the softmax checkpoint has shape {tuple(value.shape)}, "
                             f"the fast-weight model {tuple(target[name].shape)}; convert between models of "
                             "the same shape (layers, widths, heads, vocabulary)")
        state[name] = value.to(target[name].dtype)
    if unplaced:
        raise ValueError(f"the fast-weight model has no place for these softmax parameters: {', '.join(unplaced)} "
                         "(a different number of layers? learned positions need --fwp-positions on)")
    return state, [name for name in target if name not in source]


def check_only_attentions_are_fresh(model, fresh):
    """Only the fast-weight attentions may hold parameters the softmax checkpoint has no value for (their
    write strengths, gates, convolutions, random features); anything else the softmax model was trained
    without (NormFormer's --scale-* modules, say) would start untrained. Raises ValueError naming them."""
    attentions = tuple(f"{name}." for name, module in model.named_modules() if isinstance(module, FastWeightAttention))
    outside = [name for name in fresh if not name.startswith(attentions)]
    if outside:
        raise ValueError("the softmax checkpoint has no value for these parameters of the fast-weight model, which "
                         f"belong to no fast-weight attention: {', '.join(outside)} (an option the softmax model "
                         "was trained without, e.g. NormFormer's --scale-attn, --scale-fc, --scale-heads, "
                         "--scale-resids? give the softmax model's options after --)")


def _per_write(name, value, target):
    """DeltaProduct's N keys and values per token: its key and value projections, N times the softmax
    projections' size, start as N copies of them (the extra writes then start with beta near 0:
    FastWeightAttention.start_as_ungated)."""
    stacked = name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"))
    if stacked and value.dim() and target.shape[1:] == value.shape[1:] and target.shape[0] % value.shape[0] == 0:
        return value.repeat(target.shape[0] // value.shape[0], *([1] * (value.dim() - 1)))
    return value


ADDED_MODULES = ("ungated", "fresh")


def convert(softmax_checkpoint, out, train_argv, transfer_steps=0, transfer_lr=DEFAULT_LR, added_modules="ungated",
            model_options=None, checkpoint=None):
    """Build the model fairseq-train would build from train_argv (with `model_options`, {option: value},
    applied over the parsed arguments), fill it from the softmax checkpoint, start its added gates and
    convolutions as ungated (or keep them fresh; ADDED_MODULES), train its attentions on the softmax ones
    for `transfer_steps` steps (attention_transfer.py), and save a complete checkpoint of it at `out`.
    `checkpoint`: the softmax checkpoint as read_checkpoint read it already (its weights are taken out of it),
    so that a big model's weights are read once. Returns the names that were not copied."""
    if added_modules not in ADDED_MODULES:
        raise ValueError(f"added_modules must be one of {', '.join(ADDED_MODULES)}; got {added_modules!r}")
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    from ..models.fwp_config import writable

    args = options.parse_args_and_arch(options.get_training_parser(), [str(a) for a in train_argv])
    for name, value in (model_options or {}).items():
        if hasattr(args, name):
            setattr(args, name, value)
    cfg = convert_namespace_to_omegaconf(args)
    if cfg.task._name == "language_modeling":  # the same task, whose generation reads a prompt in one call
        cfg.task._name = "fwp_language_modeling"
    torch.manual_seed(cfg.common.seed)  # the new parameters' initialisation, as fairseq-train would draw it
    checkpoint = checkpoint or read_checkpoint(softmax_checkpoint)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    settle = getattr(model, "settle_options", None)
    if settle is not None:
        with writable(cfg.model):  # options the builder settles (the LM's positions), as it settled them
            settle(cfg.model)
    differences = computation_differences(checkpoint["cfg"]["model"], cfg.model)
    if differences:
        hint = " (fwp_transformer_lm: --fwp-positions on)" if any("positional" in d for d in differences) else ""
        raise ValueError("the fast-weight model would compute differently from the softmax checkpoint beyond its "
                         f"attention; give the softmax model's options after --{hint}:\n  " + "\n  ".join(differences))
    # The softmax model as fairseq's loader builds it: its state dict upgraded from older layouts (fused
    # in_proj, layer_norms.N, no output projection) by fairseq's own upgrade_state_dict_named. Its weights
    # leave the checkpoint, which is saved again without them.
    softmax = task.build_model(checkpoint["cfg"]["model"])
    softmax.load_state_dict(checkpoint.pop("model"), strict=True, model_cfg=checkpoint["cfg"]["model"])
    state, fresh = transfer(softmax.state_dict(), model.state_dict())
    check_only_attentions_are_fresh(model, fresh)
    model.load_state_dict(state, strict=True)  # the target's own check that nothing is missing
    for attention in model.modules():
        if isinstance(attention, FastWeightAttention) and added_modules == "ungated":
            attention.start_as_ungated()
    if transfer_steps:
        transfer_attention(softmax, model, task, cfg, transfer_steps, transfer_lr)
    # a model at update 0: no optimizer state, no position in an epoch; no legacy `args`, from which fairseq's
    # loader would rebuild the softmax model
    last = checkpoint["optimizer_history"][-1]
    checkpoint.update(model=model.state_dict(), cfg=OmegaConf.to_container(cfg), args=None, last_optimizer_state=None,
                      optimizer_history=[{"criterion_name": last["criterion_name"], "optimizer_name": last["optimizer_name"],
                                          "lr_scheduler_state": {}, "num_updates": 0}],
                      extra_state={"train_iterator": {"epoch": 1, "iterations_in_epoch": 0}, "val_loss": None})
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    torch.save(checkpoint, out)
    return fresh


def read_checkpoint(path):
    """A checkpoint as fairseq's loader reads it (a legacy `args` becomes its cfg), refused by name where it
    has no config: nothing then says which model its weights are."""
    from fairseq import checkpoint_utils

    checkpoint = checkpoint_utils.load_checkpoint_to_cpu(path)
    if checkpoint.get("cfg") is None:
        raise ValueError(f"{path} holds no model configuration (neither `args` nor `cfg`): nothing says which model "
                         "its weights belong to; convert a checkpoint as fairseq-train saves it")
    return checkpoint


def final_learning_rate(checkpoint_path):
    """The learning rate a checkpoint's training had reached (its optimizer's), or None without one."""
    state = torch.load(checkpoint_path, map_location="cpu", weights_only=False).get("last_optimizer_state")
    return state["param_groups"][0]["lr"] if state else None

