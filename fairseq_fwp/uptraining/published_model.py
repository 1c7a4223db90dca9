"""What a published fairseq checkpoint is, and the fairseq-train flags that build its fast-weight twin.

``--pretrained`` (convert_pretrained) converts two kinds of fairseq's published models, told apart by the
checkpoint's task and checked against its architecture's model class:

- translation (task ``translation``, fairseq's TransformerModel: ``transformer.wmt16.en-de``, ...): the
  twin is arch ``fwp_transformer``, on the language pair that the checkpoint, its dictionaries or the
  user name;
- language models (task ``language_modeling``, fairseq's TransformerLanguageModel:
  ``transformer_lm.wiki103.adaptive``, ``transformer_lm.wmt19.en``, ...): the twin is arch
  ``fwp_transformer_lm``, with the original's adaptive input and softmax, its positions
  (``--fwp-positions on`` where it has any: the fast-weight LMs' default is none), and its blocks
  (``--tokens-per-sample``, ``--max-target-positions``).

Either way the twin is given every option of the original's model as a flag, so that the row's --fwp-*
flags are checked against them (a softmax layer that does not exist, a feature size its heads cannot
have), and the tokenizer and BPE that fairseq's hub reads the original with (``--tokenizer moses --bpe
fastbpe`` for the WMT19 models), so that ``from_pretrained`` reads the twin as it read the original. The
output folder is laid out as the archive: ``model.pt``, the dictionaries (``dict.SRC.txt`` and
``dict.TGT.txt``, or ``dict.txt``), the BPE codes, and ``model.args``.
"""
import argparse
import dataclasses
import glob
import logging
import os
import re
import shlex
import shutil
from typing import Dict, List

from . import published_archives
from .attention_transfer import DEFAULT_LR
from .conversion import convert, read_checkpoint

logger = logging.getLogger(__name__)
TRANSLATION, LANGUAGE_MODEL = "translation", "language_modeling"
TWIN_ARCHS = {TRANSLATION: "fwp_transformer", LANGUAGE_MODEL: "fwp_transformer_lm"}
NOUNS = {TRANSLATION: "translation model", LANGUAGE_MODEL: "language model"}
# Options of the model that are not what it computes: where it ran, how it was trained.
NOT_MODEL_OPTIONS = ("_name", "arch", "data", "user_dir")
# What --pretrained uses after --: the row's flags, the language pair where a translation checkpoint lacks
# it, and the attention transfer's batches. The model's own options come from its checkpoint.
LANGUAGE_FLAGS = {"--source-lang": "source", "-s": "source", "--target-lang": "target", "-t": "target"}
BATCH_FLAGS = {TRANSLATION: ("--max-tokens", "--batch-size"),
               LANGUAGE_MODEL: ("--max-tokens", "--batch-size", "--tokens-per-sample")}
BPE_FILES = ("bpecodes", "code", "sentencepiece.bpe.model")  # the BPE codes, as fairseq's archives name them
SETTINGS = ("tokenizer", "bpe")  # how fairseq's hub interface turns text into the model's tokens


@dataclasses.dataclass(frozen=True)
class Twin:
    """How the fast-weight twin of a published checkpoint is built and written."""

    task: str  # TRANSLATION or LANGUAGE_MODEL
    options: Dict[str, object]  # the original's model options (model_options)
    model_args: List[str]  # the fairseq-train flags of the twin's model, the plugin's folder aside: OUT/model.args
    argv: List[str]  # the conversion's fairseq-train arguments: the data, model_args, the batch flags
    reads_subwords: bool  # whether text reaches it through BPE codes (translation, or a BPE its settings name)


def convert_pretrained(pretrained, out, row_argv, added_modules="ungated", data=None, transfer_steps=0,
                       transfer_lr=DEFAULT_LR):
    """The whole of --pretrained: a published fairseq translation or language model (published_archives.py: a
    hub name, URL, archive or folder) converted into the fast-weight model the --fwp-* flags of `row_argv` name,
    with the original's own architecture and options (its Twin), written as a model folder at `out`; `data`
    (binarised with the archive's dictionaries) gives attention transfer its batches. Returns (the names that were not
    copied, the model's fairseq-train flags: OUT/model.args)."""
    folder = published_archives.fetch(pretrained)
    original = os.path.join(folder, "model.pt")
    logger.info(f"the original: {original} (the teacher of --criterion fwp_distillation)")
    checkpoint = read_checkpoint(original)
    hub_entry = published_archives.hub().get(pretrained)
    fast_weight_twin = twin(pretrained, folder, checkpoint, row_argv, data, hub_entry)
    converted = f"{os.path.normpath(out)}.model.pt.part"  # beside `out`: a conversion that fails makes no folder
    try:
        fresh = convert(original, converted, fast_weight_twin.argv, transfer_steps, transfer_lr, added_modules,
                        model_options=fast_weight_twin.options, checkpoint=checkpoint)
        write_folder(folder, converted, out, fast_weight_twin)
    finally:
        if os.path.exists(converted):  # what a save that failed left
            os.remove(converted)
    return fresh, fast_weight_twin.model_args


def twin(pretrained, folder, checkpoint, row_argv, data=None, hub_entry=None):
    """The Twin of the checkpoint read from `folder`/model.pt (conversion.read_checkpoint), with the row's
    flags `row_argv` (what follows --), on `data` (default: the folder's dictionaries). `hub_entry`: the
    entry of fairseq's hub table that named it (published_archives.hub), or None."""
    hub_entry = hub_entry or {}
    task = kind_of(pretrained, folder, checkpoint, hub_entry.get("task"))
    complete_model_config(checkpoint)
    dictionaries(folder, task)  # before any work
    given, batch, fwp = split_row_flags(row_argv, task)
    options = model_options(checkpoint, task)
    if task == TRANSLATION:
        source, target = language_pair(pretrained, folder, checkpoint, given)
        reading = ["--task", task, "--source-lang", source, "--target-lang", target]
    else:
        reading = ["--task", task, *_blocks(checkpoint)]
    settings = reading_settings(checkpoint, hub_entry)
    positions = ["--fwp-positions", "on"] if task == LANGUAGE_MODEL and not options.get(
        "no_token_positional_embeddings") else []
    # No --user-dir: the plugin converting it is imported already, and a folder of this machine's would stop
    # model.args (and the checkpoint's config) from working where the plugin lives elsewhere.
    model = [*reading, *[x for name, value in settings.items() for x in (f"--{name}", value)],
             "--arch", TWIN_ARCHS[task], *option_flags(options, task), *positions, *fwp]
    return Twin(task, options, model, [data or folder, *model, *batch],
                reads_subwords=task == TRANSLATION or "bpe" in settings)


def complete_model_config(checkpoint):
    """The checkpoint's model config as fairseq's builder completes it before building the model (its
    architecture's function: e.g. base_lm_architecture's pre-norm layers), so that the options read from it
    are the ones the original computes with."""
    from fairseq.models import ARCH_CONFIG_REGISTRY, MODEL_DATACLASS_REGISTRY

    from ..models.fwp_config import writable

    model = checkpoint["cfg"]["model"]
    arch = _get(model, "_name") or _get(model, "arch")
    if arch in ARCH_CONFIG_REGISTRY and arch not in MODEL_DATACLASS_REGISTRY:  # as fairseq's models.build_model
        with writable(model):
            ARCH_CONFIG_REGISTRY[arch](model)


def _get(config, name):
    return config.get(name) if hasattr(config, "keys") else getattr(config, name, None)


def kind_of(pretrained, folder, checkpoint, expected=None):
    """The checkpoint's task, TRANSLATION or LANGUAGE_MODEL, checked against its architecture's model class.
    Refuses, by name: another task, a model whose class is not its task's (a translation model given as a
    language model), and a model of another kind than `expected` (the task of the hub table whose name gave
    it)."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    path = os.path.join(folder, "model.pt")
    task = checkpoint["cfg"]["task"].get("_name")
    model = checkpoint["cfg"]["model"]
    arch = _get(model, "_name") or _get(model, "arch")
    if task not in TWIN_ARCHS:
        raise ValueError(f"{path} is the checkpoint of a {task} model (its task): --pretrained converts translation "
                         f"models ({TRANSLATION}) and language models ({LANGUAGE_MODEL})")
    if expected and expected != task:
        raise ValueError(f"--pretrained {pretrained} names a {NOUNS[expected]} of fairseq's hub, but {path} is the "
                         f"checkpoint of a {NOUNS[task]} (its task: {task}): a wrong archive at its address?")
    model_class, expected_class = ARCH_MODEL_REGISTRY.get(arch), _model_class(task)
    if model_class is None or not issubclass(model_class, expected_class):
        what = f"fairseq's {model_class.__name__}" if model_class else "an architecture this fairseq does not know"
        raise ValueError(f"{path} is the checkpoint of a {task} task, but its model, {arch} ({what}), is no "
                         f"{NOUNS[task]}: --pretrained converts a {task} checkpoint of {expected_class.__name__} "
                         f"(arch {', '.join(_archs_of(expected_class)[:3])}, ...)")
    return task


def _model_class(task):
    if task == TRANSLATION:
        from fairseq.models.transformer import TransformerModel

        return TransformerModel
    from fairseq.models.transformer_lm import TransformerLanguageModel

    return TransformerLanguageModel


def _archs_of(model_class):
    from fairseq.models import ARCH_MODEL_REGISTRY

    return [arch for arch, cls in ARCH_MODEL_REGISTRY.items() if cls is model_class]


def _parser(task):
    parser = argparse.ArgumentParser()
    _model_class(task).add_args(parser)
    return parser


def _derived(task):
    """The options the task's base architecture derives from others (decoder_input_dim, ...)."""
    derived = argparse.Namespace()
    if task == TRANSLATION:
        from fairseq.models.transformer.transformer_legacy import base_architecture

        base_architecture(derived)
    else:
        from fairseq.models.transformer_lm import base_lm_architecture

        base_lm_architecture(derived)
    return derived


def model_options(checkpoint, task=TRANSLATION):
    """{option: value} of the checkpoint's model: the options fairseq's model class of `task` defines and those
    its architectures derive from them; a legacy checkpoint keeps every option of its run in one flat
    namespace."""
    defined = {action.dest for action in _parser(task)._actions} | set(vars(_derived(task)))
    model = checkpoint["cfg"]["model"]
    names = model.keys() if hasattr(model, "keys") else vars(model)
    return {name: _get(model, name) for name in names if name in defined and name not in NOT_MODEL_OPTIONS}


def option_flags(options, task=TRANSLATION):
    """The command-line flags that give `options` (model_options) to fairseq-train: every option that has a
    flag and a value (an off switch is its absence)."""
    actions = {action.dest: action for action in _parser(task)._actions if action.option_strings}
    flags = []
    for name, value in options.items():
        action = actions.get(name)
        if action is None or value is None or value is False:
            continue
        flags += [action.option_strings[0]] if value is True and action.nargs == 0 else [action.option_strings[0],
                                                                                          str(value)]
    return flags


def _blocks(checkpoint):
    """How the language model read its text: the task's --tokens-per-sample, the model's positions and
    whether each block began with <s>."""
    task, model = checkpoint["cfg"]["task"], checkpoint["cfg"]["model"]
    flags = ["--tokens-per-sample", str(task["tokens_per_sample"])]
    positions = _get(model, "max_target_positions") or task.get("max_target_positions")
    if positions:
        flags += ["--max-target-positions", str(positions)]
    if task.get("add_bos_token"):
        flags.append("--add-bos-token")
    return flags


def reading_settings(checkpoint, hub_entry):
    """{"tokenizer": name, "bpe": name}: how fairseq's hub interface reads the model's text, as its hub table
    names them (moses and fastbpe for the WMT19 models), else as its checkpoint does; those neither names are
    left out."""
    settings = {}
    for name in SETTINGS:
        own = checkpoint["cfg"].get(name)
        value = hub_entry.get(name) or (_get(own, "_name") if own else None)
        if value:
            settings[name] = value
    return settings


def split_row_flags(argv, task=TRANSLATION):
    """What --pretrained takes after --: ({"source": .., "target": ..} given, the attention transfer's batch
    flags, the --fwp-* flags). Any other flag is refused by name: the model's options come from the checkpoint."""
    languages, batch, fwp = {}, [], []
    tokens = iter(argv)
    for token in tokens:
        flag, _, inline = token.partition("=")
        if flag.startswith("--fwp-"):  # each takes a value
            fwp += [token] if inline else [token, next(tokens, "")]
        elif flag in LANGUAGE_FLAGS and task == TRANSLATION:
            languages[LANGUAGE_FLAGS[flag]] = inline or next(tokens, "")
        elif flag in BATCH_FLAGS[task]:
            batch += [flag, inline or next(tokens, "")]
        else:
            languages_too = ", --source-lang and --target-lang (where the checkpoint lacks them)" \
                if task == TRANSLATION else ""
            raise ValueError(f"{token} after --: --pretrained takes the model's own options from its checkpoint; after "
                             f"-- it uses only --fwp-* flags{languages_too} and {', '.join(BATCH_FLAGS[task])} "
                             "(attention transfer's batches)")
    return languages, batch, fwp


def language_pair(pretrained, folder, checkpoint, given):
    """(source, target) of a translation checkpoint: its own, or else the archive's dictionaries' (their sizes,
    or the pair in its name where both have one size), or else the one given after --."""
    task = checkpoint["cfg"]["task"]
    saved = {"source": task.get("source_lang"), "target": task.get("target_lang")}
    for side, language in given.items():
        if saved[side] and saved[side] != language:
            raise ValueError(f"--{side}-lang {language} after --, but {folder}/model.pt was trained with "
                             f"{saved[side]} as its {side} language")
    pair = {side: saved[side] or given.get(side) or _language_from_dictionaries(pretrained, folder, checkpoint, side)
            for side in ("source", "target")}
    return pair["source"], pair["target"]


def _language_from_dictionaries(pretrained, folder, checkpoint, side):
    languages = sorted(re.fullmatch(r"dict\.(.+)\.txt", os.path.basename(p)).group(1)
                       for p in glob.glob(os.path.join(folder, "dict.*.txt")))
    unknown = ValueError(f"{folder}/model.pt does not say its language pair (its task's source_lang and target_lang), "
                         f"and its dictionaries ({', '.join(f'dict.{x}.txt' for x in languages) or 'none'}) do not tell "
                         "which is which: give --source-lang and --target-lang after --")
    if len(languages) != 2:
        raise unknown
    embedding = {"source": "encoder.embed_tokens.weight", "target": "decoder.embed_tokens.weight"}
    rows = checkpoint["model"][embedding[side]].shape[0]
    fitting = [x for x in languages if _dictionary_size(os.path.join(folder, f"dict.{x}.txt")) == rows]
    if len(fitting) == 1:
        return fitting[0]
    for first, second in (languages, languages[::-1]):  # one size for both: the pair named in the archive's name
        if re.search(rf"(^|[^a-z]){re.escape(first)}-{re.escape(second)}([^a-z]|$)", f"{pretrained} {folder}"):
            return first if side == "source" else second
    raise unknown


def _dictionary_size(path):
    from fairseq.data import Dictionary

    return len(Dictionary.load(path))


def dictionaries(folder, task):
    """The archive's dictionaries: dict.SRC.txt and dict.TGT.txt of a translation model, dict.txt of a
    language model; raises FileNotFoundError naming what the folder holds where they are missing."""
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "dict.*.txt"))) \
        if task == TRANSLATION else ["dict.txt"]
    if not names or not all(os.path.isfile(os.path.join(folder, name)) for name in names):
        wanted = "dict.SRC.txt and dict.TGT.txt" if task == TRANSLATION else "dict.txt"
        raise FileNotFoundError(f"{folder} holds no {wanted}, the dictionary its model was trained with, only "
                                f"{', '.join(sorted(os.listdir(folder)))}")
    return names


def write_folder(folder, converted, out, twin):
    """The output folder, laid out as the archive: model.pt (the converted checkpoint, `converted`), the
    archive's dictionaries and BPE codes (a warning where a model that reads subwords has none), and
    model.args (the twin's model flags)."""
    bpe = [name for name in BPE_FILES if os.path.isfile(os.path.join(folder, name))]
    if not bpe and twin.reads_subwords:
        logger.warning(f"{folder} holds no BPE codes ({', '.join(BPE_FILES[:-1])} or {BPE_FILES[-1]}), only "
                       f"{', '.join(sorted(os.listdir(folder)))}: {out} has none either; fairseq-interactive and "
                       "from_pretrained need the codes the model was trained with (--bpe-codes FILE)")
    copied = dictionaries(folder, twin.task) + bpe
    os.makedirs(out, exist_ok=True)
    for name in copied:
        shutil.copy(os.path.join(folder, name), out)
    with open(os.path.join(out, "model.args"), "w") as f:
        f.write(shlex.join(twin.model_args) + "\n")
    os.replace(converted, os.path.join(out, "model.pt"))
    logger.info(f"wrote {os.path.join(out, '')}: {', '.join(sorted(copied + ['model.args', 'model.pt']))}")
