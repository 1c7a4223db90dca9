"""Fixes for the fairseq/torch versions we run on, applied when the plugin loads.

1. torch >= 2.6 loads with ``weights_only=True`` by default, which refuses
   fairseq checkpoints (they pickle argparse/omegaconf configs). fairseq's
   own checkpoint loader gets ``weights_only=False`` back: checkpoints are
   files the user trained, the trust model fairseq always had; so does the
   broadcast of a loaded checkpoint to the ranks of a resumed
   multi-process run.
2. fairseq-fixed 0.12.3.1 drops the last batch whenever its size is not a
   multiple of --required-batch-size-multiple (8 by default), so
   fairseq-generate silently skipped sentences and eval-lm skipped text.
   The dropped indices are put back as a final batch.
3. fairseq 0.12 turns --bf16 into --tpu (bf16 was TPU-only then), which
   crashes wherever torch_xla is missing. Without torch_xla, --bf16 stays
   on the CPU or GPU: the command-line tools convert their parsed arguments
   with the TPU switch off again, whether they were launched as console
   scripts (``fairseq-train``) or as modules (``python -m fairseq_cli.train``,
   which runs as ``__main__``).
4. fairseq writes a checkpoint from rank 0 alone, and gives a task no hook
   that runs on every rank before it does. Before each save, every rank now
   calls the task's ``prepare_checkpoint(trainer)`` where it has one:
   fwp_stream_lm gathers every rank's carried streams there.
5. fairseq parses --help before it adds the options of --arch and --task, so
   ``fairseq-train --arch fwp_... --help`` never listed the --fwp-* flags
   (nor any model's). The plugin loads before that parsing (fairseq imports
   --user-dir when it builds the parser): the parser's help then waits for
   the last parse, when every option is there.
6. fairseq 0.12 calls Hydra 1.3 through APIs Hydra deprecated, and every
   command opened with about 20 lines of Hydra's deprecation warnings; the
   plugin silences those (only those: Hydra's, about its own API).
7. --finetune-from-model loads any checkpoint whose parameters fit the model
   the command line builds, also one that computes otherwise (untied
   embeddings beside a tied conversion, another feature map of the same
   size): the plugin warns, naming every option that differs.
8. A checkpoint whose architecture, feature map or update rule a --user-dir
   registered, loaded without it, ended in fairseq's ``IndexError:
   Replacement index 1 out of range`` (its message about an unknown model
   type fails to format). Loading a model now says which registration is
   missing and which --user-dir the checkpoint was trained with.
9. --fwp-session (and --fwp-session-file) given to a task that takes none, fairseq-interactive's default
   translation among them, was "unrecognized arguments": every task without them now refuses them naming
   the tasks that take them.
10. Options that fairseq does not check and that end inside its code with an error naming none of them, or
   never end (--beam 0, --required-batch-size-multiple 0, ...), are refused by name when a task builds its
   generator, its batches, a progress bar or a translation data set (option_checks.py).
11. fairseq 0.12's --replace-unk indexes its alignment by target position, where --print-alignment hard gives
   (source, target) word pairs: every <unk> replaced was a TypeError. It reads the pairs now.
"""
import argparse
import contextvars
import functools
import importlib.util
import inspect
import logging
import os
import sys
import types
import warnings

import numpy as np
import torch

logger = logging.getLogger("fairseq_fwp")


def _patch_checkpoint_loading():
    """fairseq's checkpoint loader, and the broadcast that hands a loaded
    checkpoint to the other ranks of a resumed multi-process run, see a torch
    whose load defaults to weights_only=False."""
    from fairseq import checkpoint_utils
    from fairseq.distributed import utils as distributed_utils

    if checkpoint_utils.torch is not torch:
        return  # already patched

    @functools.wraps(torch.load)
    def load(*args, **kwargs):
        kwargs.setdefault("weights_only", False)
        return torch.load(*args, **kwargs)

    # A torch look-alike for those modules only; torch.load stays untouched elsewhere.
    proxy = types.ModuleType("torch")
    proxy.__dict__.update({k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    proxy.__getattr__ = functools.partial(getattr, torch)  # torch's lazily loaded submodules
    proxy.load = load
    checkpoint_utils.torch = proxy
    distributed_utils.torch = proxy


def _replace(owner, name, make):
    """owner.name = make(original) (wrapped as the original), once: loading the plugin again changes nothing."""
    original = getattr(owner, name)
    if getattr(original, "_fwp_replaced", False):
        return
    replacement = functools.wraps(original)(make(original))
    replacement._fwp_replaced = True
    setattr(owner, name, replacement)


def _checked_before(check, argument):
    """A `make` for _replace: the original, called after check(the value its call binds to `argument`)."""
    def make(original):
        signature = inspect.signature(original)

        def checked(*args, **kwargs):
            check(signature.bind(*args, **kwargs).arguments.get(argument))
            return original(*args, **kwargs)
        return checked
    return make


def _patch_batch_by_size():
    from fairseq.data import data_utils

    from .option_checks import check_batching

    def make(original):
        signature = inspect.signature(original)

        def batch_by_size(indices, *args, **kwargs):
            given = signature.bind(indices, *args, **kwargs).arguments
            check_batching(given.get("max_tokens"), given.get("max_sentences"),
                           given.get("required_batch_size_multiple", 1))
            batches = original(indices, *args, **kwargs)
            indices = np.fromiter(indices, dtype=np.int64) if not isinstance(indices, np.ndarray) else indices
            batched = sum(len(b) for b in batches)
            if batched < len(indices):
                kept = np.concatenate(batches) if batches else np.empty(0, dtype=np.int64)
                dropped = indices[~np.isin(indices, kept)]
                batches = list(batches) + [dropped]
            return batches
        return batch_by_size

    _replace(data_utils, "batch_by_size", make)


CLI_MODULES = ("fairseq_cli.train", "fairseq_cli.generate", "fairseq_cli.eval_lm", "fairseq_cli.validate",
               "fairseq_cli.interactive")


def _cli_modules():
    """The fairseq command-line modules loaded in this process: imported by their console scripts, or
    run as __main__ by `python -m`. The plugin loads while the tool parses its arguments."""
    main = sys.modules.get("__main__")
    for name in CLI_MODULES:
        if name in sys.modules:
            yield sys.modules[name]
        elif getattr(getattr(main, "__spec__", None), "name", None) == name:
            yield main


def _patch_bf16_without_tpu():
    if importlib.util.find_spec("torch_xla") is not None:
        return  # a TPU machine: fairseq's own behaviour

    def make(convert):
        def convert_keeping_bf16_off_tpu(args):
            if getattr(args, "bf16", False):
                args.tpu = False
            return convert(args)
        return convert_keeping_bf16_off_tpu

    for module in _cli_modules():
        if hasattr(module, "convert_namespace_to_omegaconf"):
            _replace(module, "convert_namespace_to_omegaconf", make)


def _patch_checkpoint_saving():
    from fairseq import checkpoint_utils

    def make(original):
        def save_checkpoint(cfg, trainer, epoch_itr, val_loss):
            prepare = getattr(trainer.task, "prepare_checkpoint", None)
            if prepare is not None and not cfg.no_save:
                prepare(trainer)
            return original(cfg, trainer, epoch_itr, val_loss)
        return save_checkpoint

    _replace(checkpoint_utils, "save_checkpoint", make)


class _HelpWithEveryOption(argparse._HelpAction):
    """--help that lets fairseq's first parse pass (model and task options not added yet) and prints at the
    next one; without --arch there is no next one (fairseq adds no model's options), so it prints at once."""

    def __call__(self, parser, namespace, values, option_string=None):
        if not getattr(self, "_fwp_deferred", False):
            self._fwp_deferred = True
            return
        super().__call__(parser, namespace, values, option_string)


def _patch_help_to_list_every_option():
    from fairseq import options

    def make(original):
        def parse_args_and_arch(parser, *args, **kwargs):
            input_args = args[0] if args else kwargs.get("input_args")
            arch = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
            arch.add_argument("--arch", "-a")
            arch_given = arch.parse_known_args(input_args)[0].arch is not None
            for action in parser._actions:
                if isinstance(action, argparse._HelpAction):
                    action.__class__ = _HelpWithEveryOption
                    action._fwp_deferred = not arch_given
            return original(parser, *args, **kwargs)
        return parse_args_and_arch

    _replace(options, "parse_args_and_arch", make)


# Hydra's deprecation warnings that fairseq 0.12's use of Hydra 1.3 raises in every command.
HYDRA_DEPRECATIONS = (r"hydra\.experimental\.\w+\(\) is no longer experimental", r"\s*The version_base parameter",
                      r"In '\w+': Usage of deprecated keyword in package header",
                      r"\s*'\w+' is validated against ConfigStore schema", r"\s*The strict flag")


def _silence_hydra_deprecations():
    for message in HYDRA_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def _patch_finetuning_to_compare_models():
    from fairseq import checkpoint_utils

    def make(original):
        def load_checkpoint(cfg, trainer, **passthrough):
            last = os.path.join(cfg.save_dir, f"checkpoint_last{trainer.checkpoint_suffix}.pt")
            if cfg.finetune_from_model and cfg.restore_file == "checkpoint_last.pt" and not os.path.exists(last) \
                    and os.path.exists(cfg.finetune_from_model):
                from .uptraining.differences import model_differences

                saved = checkpoint_utils.load_checkpoint_to_cpu(cfg.finetune_from_model)["cfg"]["model"]
                differences = model_differences(saved, trainer.cfg.model)
                if differences:
                    logger.warning(f"--finetune-from-model {cfg.finetune_from_model} was saved from another model than "
                                   "this command builds; give the options it was converted with:\n  "
                                   + "\n  ".join(differences))
            return original(cfg, trainer, **passthrough)
        return load_checkpoint

    _replace(checkpoint_utils, "load_checkpoint", make)


_loading_models = contextvars.ContextVar("fwp_loading_models", default=False)


def missing_registrations(path, cfg):
    """Raises ValueError where the model config of the checkpoint at `path` names an architecture, feature map
    or update rule that this process has not registered (its --user-dir was not named)."""
    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY

    from .models.fwp_config import registered_choices

    model = cfg["model"]
    get = (lambda name: model.get(name)) if hasattr(model, "get") else (lambda name: getattr(model, name, None))
    arch = get("arch") or get("_name")
    missing = [] if arch in ARCH_MODEL_REGISTRY or arch in MODEL_REGISTRY else [f"the architecture {arch}"]
    for dest, choices in registered_choices().items():
        if get(dest) is not None and str(get(dest)) not in choices:
            missing.append(f"--{dest.replace('_', '-')} {get(dest)}")
    if missing:
        user_dir = (cfg.get("common") or {}).get("user_dir")
        where = (f"it was trained with --user-dir {user_dir}, which registers them: give the same --user-dir"
                 if user_dir else "give the --user-dir that registers them")
        raise ValueError(f"{path} needs {' and '.join(missing)}, not registered in this process; {where}")


def _patch_model_loading_to_name_missing_registrations():
    from fairseq import checkpoint_utils

    def make_ensemble(original):
        def load_model_ensemble_and_task(*args, **kwargs):
            token = _loading_models.set(True)
            try:
                return original(*args, **kwargs)
            finally:
                _loading_models.reset(token)
        return load_model_ensemble_and_task

    def make_load(original):
        def load_checkpoint_to_cpu(path, *args, **kwargs):
            state = original(path, *args, **kwargs)
            if _loading_models.get() and state.get("cfg") is not None:  # a model is built from it next
                missing_registrations(path, state["cfg"])
            return state
        return load_checkpoint_to_cpu

    _replace(checkpoint_utils, "load_model_ensemble_and_task", make_ensemble)
    _replace(checkpoint_utils, "load_checkpoint_to_cpu", make_load)


class _SessionTakesItsTask(argparse.Action):
    """--fwp-session on a task that keeps no session: refused, naming the tasks that do."""

    def __call__(self, parser, namespace, values, option_string=None):
        from fairseq.tasks import TASK_REGISTRY

        from .tasks.prompt_reading import PromptReading

        tasks = [name for name, cls in TASK_REGISTRY.items() if issubclass(cls, PromptReading)]
        parser.error(f"{option_string}: --task {getattr(namespace, 'task', None)} keeps no session; give one of the "
                     f"tasks that do: --task {', '.join(tasks)} (fwp_language_modeling for a model trained with "
                     "language_modeling)")


def _patch_task_options_to_name_the_session_tasks():
    from fairseq.tasks import FairseqTask

    original = FairseqTask.__dict__["add_args"].__func__
    if getattr(original, "_fwp_replaced", False):
        return

    @functools.wraps(original)
    def add_args(cls, parser):
        original(cls, parser)
        for option, nargs in (("--fwp-session", 0), ("--fwp-session-file", 1)):
            if option not in parser._option_string_actions:
                parser.add_argument(option, nargs=nargs, action=_SessionTakesItsTask, default=argparse.SUPPRESS,
                                    help=argparse.SUPPRESS)

    add_args._fwp_replaced = True
    FairseqTask.add_args = classmethod(add_args)


def _patch_generators_to_check_their_options():
    from fairseq.tasks import FairseqTask

    from .option_checks import check_generation

    _replace(FairseqTask, "build_generator", _checked_before(check_generation, "args"))


def _patch_progress_bars_and_collaters_to_check_their_options():
    from fairseq.data import LanguagePairDataset
    from fairseq.logging import progress_bar

    from .option_checks import check_length_multiple, check_log_interval

    _replace(progress_bar, "progress_bar", _checked_before(check_log_interval, "log_interval"))
    _replace(LanguagePairDataset, "__init__", _checked_before(check_length_multiple, "pad_to_multiple"))


def _patch_unknown_word_replacement_to_read_aligned_pairs():
    from fairseq import tokenizer, utils

    def make(original):
        def replace_unk(hypo_str, src_str, alignment, align_dict, unk):
            if not alignment or not isinstance(alignment[0], (tuple, list)):
                return original(hypo_str, src_str, alignment, align_dict, unk)
            source_of = {}
            for source, target in alignment:  # --print-alignment hard: (source, target) word pairs
                source_of.setdefault(int(target), int(source))
            hypo_tokens, src_tokens = tokenizer.tokenize_line(hypo_str), tokenizer.tokenize_line(src_str)
            for i, token in enumerate(hypo_tokens):
                if token == unk and source_of.get(i, len(src_tokens)) < len(src_tokens):
                    source = src_tokens[source_of[i]]
                    hypo_tokens[i] = align_dict.get(source, source)
            return " ".join(hypo_tokens)
        return replace_unk

    _replace(utils, "replace_unk", make)


def apply():
    _silence_hydra_deprecations()
    _patch_finetuning_to_compare_models()
    _patch_model_loading_to_name_missing_registrations()
    _patch_help_to_list_every_option()
    _patch_checkpoint_loading()
    _patch_checkpoint_saving()
    _patch_batch_by_size()
    _patch_bf16_without_tpu()
    _patch_task_options_to_name_the_session_tasks()
    _patch_generators_to_check_their_options()
    _patch_progress_bars_and_collaters_to_check_their_options()
    _patch_unknown_word_replacement_to_read_aligned_pairs()
