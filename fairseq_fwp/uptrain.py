"""Uptraining: a trained softmax Transformer turned into a fast-weight one (Kasai et al., 2021,
"Finetuning Pretrained Transformers into RNNs"), then finetuned briefly.

    python -m fairseq_fwp.uptrain --softmax-checkpoint SOFTMAX.pt --out CONVERTED.pt -- \\
        DATA --user-dir fairseq_fwp --arch ARCH [model flags] --fwp-feature-map dpfp ...
    fairseq-train DATA --user-dir fairseq_fwp --arch ARCH [the same flags] [training flags] \\
        --finetune-from-model CONVERTED.pt --save-dir DIR

Everything after ``--`` is what fairseq-train will be given: the fast-weight
model is built from it, every parameter it shares with the softmax checkpoint
(embeddings, projections, feed-forward layers, norms: the same names in both)
is copied, and the new ones (the delta rule's beta projection, decay and
output gates, short convolutions, random features) are initialised afresh
(a new parameter outside the fast-weight attentions stops the conversion);
DeltaProduct's N key and value projections start as N copies of the
softmax ones, its extra writes with beta near 0:
by default (``--added-modules ungated``) decay gates at a_t = exp(-1e-4) and
short convolutions as identities (FastWeightAttention.start_as_ungated), so
that the converted model starts as its softmax source's nearest fast-weight
twin; the output gate's RMS norm has no such setting. ``--added-modules
fresh`` keeps them as initialised for training from scratch (Mamba-2's
spread of decays, random convolutions). A parameter whose shape
differs, or a softmax parameter the fast-weight model has no place for, stops
the conversion with its name, and so does every model option that makes the
two compute differently although the shapes agree (COMPUTATION_FIELDS: heads,
layers, widths, normalize-before, layernorm-embedding, embedding scale,
positions, shared embeddings). The converted file is a complete fairseq
checkpoint: fairseq-generate and fairseq-eval-lm score it as it is (the
quality before any update), and ``--finetune-from-model`` starts training
from it with fresh optimizer, learning-rate schedule, meters and data
iterator (a resumed run continues from its own checkpoint_last.pt instead).

``--attention-transfer-steps N`` first trains only the converted attentions, N steps on the training
batches, to reproduce the softmax attentions they replace (attention_transfer.py), so that finetuning
starts from a model that already attends almost as the softmax one did.

``--pretrained NAME|URL|PATH --out FOLDER -- <--fwp-* flags>`` converts one of fairseq's published
translation or language models (pretrained.py fetches it, published_model.py says what it is and builds
the fairseq-train flags of its fast-weight twin) into a folder laid out as its archive, and prints the
command that finetunes it.
"""
import argparse
import dataclasses
import itertools
import logging
import os
import shlex
import sys

import torch

from .attention_transfer import DEFAULT_LR
from .modules.fast_weight_attention import FastWeightAttention

logger = logging.getLogger("fairseq_fwp.uptrain")
# State-dict entries that are not parameters: fairseq's version stamps and the
# sinusoidal positions' placeholder; a fast-weight model may do without them.
NOT_PARAMETERS = ("version", "_float_tensor")
# The model options that define what a Transformer computes (beyond its attention), as fairseq names
# them: two models that differ in one of them are different models, even where every parameter has
# the same shape (2 or 4 heads over the same projections; pre- or post-norm layers).
COMPUTATION_FIELDS = (
    "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
    "encoder_embed_dim", "decoder_embed_dim", "encoder_ffn_embed_dim", "decoder_ffn_embed_dim",
    "decoder_input_dim", "decoder_output_dim", "activation_fn",
    "encoder_normalize_before", "decoder_normalize_before", "no_decoder_final_norm", "layernorm_embedding",
    "no_scale_embedding", "no_token_positional_embeddings", "encoder_learned_pos", "decoder_learned_pos",
    "share_all_embeddings", "share_decoder_input_output_embed", "adaptive_input", "adaptive_input_factor",
    "adaptive_input_cutoff", "adaptive_softmax_cutoff", "adaptive_softmax_factor", "tie_adaptive_weights",
    "tie_adaptive_proj", "character_embeddings", "cross_self_attention", "no_cross_attention",
)


def computation_differences(source, target, labels=("softmax", "fast-weight")):
    """``name: softmax X, fast-weight Y`` (or other labels) for every COMPUTATION_FIELDS option the two model
    configs set differently (options one of them lacks are skipped; unset counts as off; a number typed on a
    command line, which some of fairseq's options keep as its text, equals the number, and 4 equals 4.0)."""
    def value(cfg, name):
        x = getattr(cfg, name, None)
        return str(False if x is None else x)

    def number_or_text(text):
        try:
            return float(text)
        except ValueError:
            return text

    missing = object()
    return [f"{name}: {labels[0]} {value(source, name)}, {labels[1]} {value(target, name)}" for name in COMPUTATION_FIELDS
            if getattr(source, name, missing) is not missing and getattr(target, name, missing) is not missing
            and number_or_text(value(source, name)) != number_or_text(value(target, name))]


def model_differences(saved, model):
    """computation_differences, and every --fwp-* option the two configs set differently: how a model saved
    (a conversion) and the one a command builds would compute differently although their parameters fit. An
    option a config lacks (saved before the flag existed) counts as the flag's default, which computes as
    the code before it did."""
    from .models.fwp_config import FastWeightConfig
    from .ops.rules import update_rule

    defaults = {field.name: field.default for field in dataclasses.fields(FastWeightConfig)}
    names = sorted({name for cfg in (saved, model) for name in (cfg.keys() if hasattr(cfg, "keys") else vars(cfg))
                    if name.startswith("fwp_") and name != "fwp_sum_norm"})

    def value(cfg, name):
        given = getattr(cfg, name, None)
        given = str(defaults.get(name) if given is None else given)
        if name == "fwp_decay_form" and given == "auto":  # what auto computes: the rule's own form
            return update_rule(value(cfg, "fwp_update_rule")).decay_form
        return given

    saved_value, built_value = ({name: value(cfg, name) for name in names} for cfg in (saved, model))
    return computation_differences(saved, model, ("saved", "built")) + [
        f"{name}: saved {saved_value[name]}, built {built_value[name]}" for name in names
        if saved_value[name] != built_value[name]]


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

    from .models.fwp_config import writable

    args = options.parse_args_and_arch(options.get_training_parser(), [str(a) for a in train_argv])
    for name, value in (model_options or {}).items():
        if hasattr(args, name):
            setattr(args, name, value)
    cfg = convert_namespace_to_omegaconf(args)
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


def transfer_attention(teacher, model, task, cfg, steps, lr):
    """Attention transfer on the training batches fairseq-train would read (attention_transfer.py)."""
    from fairseq import utils

    from .attention_transfer import AttentionTransfer

    if cfg.dataset.max_tokens is None and cfg.dataset.batch_size is None:
        raise ValueError("attention transfer reads training batches: give --max-tokens or --batch-size after --")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    teacher.to(device), model.to(device)
    split = cfg.dataset.train_subset
    task.load_dataset(split, combine=False, epoch=1)

    def batches():
        for epoch in itertools.count(1):  # as many epochs as the steps need, reshuffled each time
            yield from task.get_batch_iterator(
                dataset=task.dataset(split), max_tokens=cfg.dataset.max_tokens, max_sentences=cfg.dataset.batch_size,
                max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
                ignore_invalid_inputs=True, required_batch_size_multiple=cfg.dataset.required_batch_size_multiple,
                seed=cfg.common.seed, epoch=epoch, num_workers=0).next_epoch_itr(shuffle=True)

    moved = (utils.move_to_cuda(sample) if device == "cuda" else sample for sample in batches())
    AttentionTransfer(teacher, model, task.target_dictionary.pad(), lr).run(moved, steps)
    model.cpu()


def convert_pretrained(pretrained, out, row_argv, added_modules="ungated", data=None, transfer_steps=0,
                       transfer_lr=DEFAULT_LR):
    """A published fairseq translation or language model (pretrained.py: a hub name, URL, archive or folder)
    converted into the fast-weight model the --fwp-* flags of `row_argv` name, with the original's own
    architecture and options (published_model.py), written as a model folder at `out`; `data` (binarised
    with the archive's dictionaries) gives attention transfer its batches. Returns (the names that were not
    copied, the model's fairseq-train flags: OUT/model.args)."""
    from . import pretrained as archives
    from . import published_model

    folder = archives.fetch(pretrained)
    original = os.path.join(folder, "model.pt")
    logger.info(f"the original: {original} (the teacher of --criterion fwp_distillation)")
    checkpoint = read_checkpoint(original)
    twin = published_model.twin(pretrained, folder, checkpoint, row_argv, data, archives.hub().get(pretrained))
    converted = f"{os.path.normpath(out)}.model.pt.part"  # beside `out`: a conversion that fails makes no folder
    try:
        fresh = convert(original, converted, twin.argv, transfer_steps, transfer_lr, added_modules,
                        model_options=twin.options, checkpoint=checkpoint)
        published_model.write_folder(folder, converted, out, twin)
    finally:
        if os.path.exists(converted):  # what a save that failed left
            os.remove(converted)
    return fresh, twin.model_args


def finetune_command(out, data, model_args):
    """The fairseq-train command that finetunes a conversion of --pretrained at `out`, its model's flags
    (`model_args`, what model.args holds) inline, with the finetuning recipe of its task (FINETUNE_RECIPES);
    more flags may follow it."""
    task = model_args[model_args.index("--task") + 1]
    recipe = FINETUNE_RECIPES[task] + (ADAPTIVE_LOSS if "--adaptive-softmax-cutoff" in model_args else [])
    if task == "language_modeling" and "--max-target-positions" in model_args:  # segments within its positions
        positions = int(model_args[model_args.index("--max-target-positions") + 1])
        segment = recipe.index("--tokens-per-sample") + 1
        recipe[segment] = str(min(int(recipe[segment]), positions))
    return shlex.join(["fairseq-train", data or "DATA", *model_args, "--finetune-from-model",
                       os.path.join(out, "model.pt"), *recipe, "--save-dir", os.path.join(out, "finetuned")])


# Finetuning after --pretrained, with warmup anew. Translation as the published models were trained (Ott et
# al., 2018). A language model on fwp_stream_lm: 6 streams of 512-token segments (the 3,072 tokens per batch
# of Baevski and Auli's WikiText-103 model; shorter where its positions are fewer) with the fast weights
# carried from one segment to the next (the paper's Table 4), Adam at a tenth of a from-scratch rate.
FINETUNE_RECIPES = {
    "translation": ["--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--optimizer", "adam",
                    "--adam-betas", "(0.9,0.98)", "--lr", "0.0005", "--lr-scheduler", "inverse_sqrt",
                    "--warmup-updates", "1000", "--max-tokens", "3584"],
    "language_modeling": ["--task", "fwp_stream_lm", "--tokens-per-sample", "512", "--batch-size", "6",
                          "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--clip-norm", "0.1", "--lr", "0.0001",
                          "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "1000"],
}
# An adaptive softmax (the WikiText-103 model's) trains with its own loss, which needs fairseq's own DDP.
ADAPTIVE_LOSS = ["--criterion", "adaptive_loss", "--ddp-backend", "legacy_ddp"]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: python -m fairseq_fwp.uptrain --softmax-checkpoint FILE --out FILE -- "
                         "<the fairseq-train arguments of the fast-weight model>\n"
                         "   or: python -m fairseq_fwp.uptrain --pretrained NAME|URL|PATH --out FOLDER -- "
                         "<the --fwp-* flags of the fast-weight model>")
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--softmax-checkpoint", help="a checkpoint of fairseq-train (give the fast-weight model's "
                                                     "fairseq-train arguments after --)")
    source.add_argument("--pretrained", metavar="NAME|URL|PATH",
                        help="a published fairseq translation or language model: a name of fairseq's hub (e.g. "
                             "transformer.wmt16.en-de, transformer_lm.wiki103.adaptive), an archive's URL, a local "
                             "archive or folder (give only the --fwp-* flags after --; --out is then a folder)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--data", help="with --pretrained: the training data, binarised with the archive's "
                                       "dictionaries (attention transfer's batches; the printed finetune command)")
    parser.add_argument("--attention-transfer-steps", type=int, default=0, metavar="N",
                        help="train the converted attentions on the softmax ones for N steps first (default 0: none)")
    parser.add_argument("--attention-transfer-lr", type=float, default=DEFAULT_LR, metavar="LR",
                        help=f"the attention transfer's Adam learning rate (default {DEFAULT_LR})")
    parser.add_argument("--added-modules", choices=ADDED_MODULES, default="ungated",
                        help="decay gates and short convolutions the softmax model lacks: ungated (a_t = exp(-1e-4), "
                             "identity convolutions; default) or fresh (as for training from scratch)")
    args = parser.parse_args(argv[:split])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.attention_transfer_steps < 0:
        parser.error(f"--attention-transfer-steps must be >= 0, got {args.attention_transfer_steps}")
    if args.pretrained:
        if args.attention_transfer_steps and not args.data:
            parser.error("--attention-transfer-steps reads training batches: with --pretrained, give --data (the "
                         "training data, binarised with the archive's dictionaries) and --max-tokens after --")
        try:
            fresh, model_args = convert_pretrained(args.pretrained, args.out, argv[split + 1:], args.added_modules,
                                                   args.data, args.attention_transfer_steps, args.attention_transfer_lr)
        except (ValueError, FileNotFoundError) as err:
            raise SystemExit(f"uptrain: {err}")
        logger.info(f"initialised afresh: {', '.join(fresh) if fresh else 'nothing'}\nnext, finetune it"
                    f"{'' if args.data else ' on your training data binarised with its dictionaries'} (more flags may "
                    f"follow: --max-update, --update-freq, --fp16, ...):\n  "
                    f"{finetune_command(args.out, args.data, model_args)}")
        return
    if args.data:
        parser.error("--data is for --pretrained: with --softmax-checkpoint the data comes first after --")
    fresh = convert(args.softmax_checkpoint, args.out, argv[split + 1:], args.attention_transfer_steps,
                    args.attention_transfer_lr, args.added_modules)
    logger.info(f"wrote {args.out}; initialised afresh: {', '.join(fresh) if fresh else 'nothing'}; the softmax "
                f"training had reached --lr {final_learning_rate(args.softmax_checkpoint)}")


if __name__ == "__main__":
    main()
