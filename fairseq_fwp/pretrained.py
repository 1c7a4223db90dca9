"""fairseq's published translation models (or any packed like them) as the source of an uptraining.

    python -m fairseq_fwp.uptrain --pretrained transformer.wmt16.en-de --out models/wmt16-dpfp256 -- \\
        --fwp-feature-map dpfp --fwp-dpfp-nu 2

``--pretrained`` takes a name of fairseq's own hub (``TransformerModel.hub_models()``), an archive's URL
(http(s):// downloaded through fairseq's downloader into its cache, with its progress bar; file://), a
local archive, or a folder: what fairseq's hub archives hold, ``model.pt`` beside ``dict.SRC.txt``,
``dict.TGT.txt`` and the BPE codes (``bpecodes``). An archive is extracted once into CACHE (one folder per
archive; an extraction that fails leaves nothing there). The converted model is built from the
checkpoint's own architecture and options (the user names only the --fwp-* flags of the row), and the
output folder is laid out as the archive was: ``model.pt`` (the fast-weight model, arch
``fwp_transformer``), the dictionaries and the codes, so that fairseq-generate, fairseq-interactive and
``TransformerModel.from_pretrained`` read it with the tokenizer and BPE settings of the original (and
``--user-dir`` naming the plugin), and ``model.args``, the fairseq-train flags that build that model again,
quoted for a POSIX shell on one line (uptrain prints the finetune command with them inline).
Ensembles (``model1.pt`` ...) are refused, naming the single model to convert instead.
"""
import argparse
import glob
import hashlib
import logging
import os
import re
import shlex
import shutil
import tarfile
import urllib.parse
import zipfile

logger = logging.getLogger("fairseq_fwp.uptrain")
CACHE = os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "fairseq_fwp", "pretrained")
PLUGIN_DIR = os.path.dirname(os.path.abspath(__file__))
# Options of the model that are not what it computes: where it ran, how it was trained.
NOT_MODEL_OPTIONS = ("_name", "arch", "data", "user_dir")
# What --pretrained uses after --: the row's flags, the language pair where the checkpoint lacks it, and the
# attention transfer's batches. The model's own options come from its checkpoint.
LANGUAGE_FLAGS = {"--source-lang": "source", "-s": "source", "--target-lang": "target", "-t": "target"}
BATCH_FLAGS = ("--max-tokens", "--batch-size")
BPE_FILES = ("bpecodes", "code", "sentencepiece.bpe.model")  # the BPE codes, as fairseq's archives name them


def hub():
    """fairseq's own names of its published translation models: {name: archive URL}."""
    from fairseq.models.transformer import TransformerModel

    return {name: entry if isinstance(entry, str) else entry["path"]
            for name, entry in TransformerModel.hub_models().items()}


def fetch(pretrained):
    """The folder that holds the model `pretrained` names (see the module's docstring)."""
    models = hub()
    location = models.get(pretrained, pretrained)
    if location.startswith("file://"):
        location = urllib.parse.unquote(urllib.parse.urlparse(location).path)
    if os.path.isdir(location):
        folder = location
    elif os.path.isfile(location):
        folder = _extracted(location)
    elif urllib.parse.urlparse(location).scheme in ("http", "https", "s3"):
        folder = _downloaded(location)
    else:
        raise FileNotFoundError(f"--pretrained {pretrained}: neither a model of fairseq's hub ({', '.join(models)}) nor "
                                "an archive or folder that exists")
    _check_single_model(pretrained, folder, models)
    return folder


def _downloaded(url):
    """An archive's URL, downloaded into fairseq's cache (PYTORCH_FAIRSEQ_CACHE) and extracted into ours; an
    archive that does not extract is deleted from fairseq's cache, so that the next try downloads it anew."""
    from fairseq import file_utils

    try:
        path = file_utils.cached_path(url)
    except EnvironmentError as err:
        raise FileNotFoundError(f"could not download {url}: {err}") from err
    try:
        return _extracted(path, url)
    except ValueError as err:
        for downloaded in (path, path + ".json"):  # the file and fairseq's record of its URL
            if os.path.exists(downloaded):
                os.remove(downloaded)
        refusal = _refusal(url)
        if refusal:
            raise FileNotFoundError(f"could not download {url}: the server answered {refusal}") from err
        raise


def _refusal(url):
    """The server's answer to `url` where it is an error ("404 Not Found"), else None: fairseq's downloader
    saves whatever the server sends, its error page too."""
    import requests

    try:
        answer = requests.head(url, allow_redirects=True, timeout=60)
    except requests.RequestException:  # no answer (or not an http URL): the archive's own error stands
        return None
    return None if answer.ok else f"{answer.status_code} {answer.reason}"


def _extracted(archive, name=None):
    """A local archive, extracted once into the cache (the archive itself is left as it is). `name`: what
    the user called it (a URL), for messages."""
    name = name or archive
    if _is_checkpoint(archive):
        raise ValueError(f"{name} is a checkpoint, not an archive: give the folder that holds it beside its "
                         "dictionaries (dict.SRC.txt, dict.TGT.txt), or an archive of that folder")
    stat = os.stat(archive)
    key = hashlib.sha256(f"{os.path.abspath(archive)}:{stat.st_size}:{stat.st_mtime}".encode()).hexdigest()[:16]
    folder = os.path.join(CACHE, key)
    if os.path.isdir(folder):
        return folder
    staging = f"{folder}.part{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    wrong = _extract(archive, staging)
    if wrong:
        shutil.rmtree(staging, ignore_errors=True)
        raise ValueError(f"{name} is not a whole tar archive ({wrong}); download it again")
    entries = os.listdir(staging)  # fairseq's archives hold one top folder
    inner = os.path.join(staging, entries[0]) if len(entries) == 1 and os.path.isdir(
        os.path.join(staging, entries[0])) else staging
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    os.replace(inner, folder)
    shutil.rmtree(staging, ignore_errors=True)
    return folder


def _is_checkpoint(path):
    """Whether `path` starts as torch's checkpoints do: a zip file since torch 1.6, a pickle of torch's magic
    number before (the published archives' model.pt)."""
    import pickle

    from torch.serialization import MAGIC_NUMBER

    legacy = pickle.dumps(MAGIC_NUMBER, protocol=2)
    with open(path, "rb") as f:
        return f.read(len(legacy)) == legacy or zipfile.is_zipfile(path)


def _extract(archive, staging):
    """Extract the tar archive into `staging`; returns what is wrong with it, or None."""
    opened = False
    try:
        with tarfile.open(archive) as tar:
            opened = True
            tar.extractall(staging, filter="data")
            if not _ends_with_its_marker(tar):
                return "it ends before its end-of-archive marker"
    except (tarfile.TarError, EOFError, OSError) as err:  # OSError: a compressed stream that ends early
        return (f"it ends early or is damaged: {type(err).__name__}: {err}" if opened
                else "no tar archive, compressed or not, starts it")
    return None


def _ends_with_its_marker(tar):
    """Whether a block of zeros follows the last member, as it ends every whole tar archive: tarfile stops
    without a word where a file cut short ends at (or within) a member's header."""
    tar.fileobj.seek(tar.offset)
    return tar.fileobj.read(tarfile.BLOCKSIZE) == tarfile.NUL * tarfile.BLOCKSIZE


def _check_single_model(pretrained, folder, models):
    if os.path.isfile(os.path.join(folder, "model.pt")):
        return
    members = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "model*.pt")))
    if not members:
        raise FileNotFoundError(f"--pretrained {pretrained}: {folder} holds no model.pt")
    single = f"{pretrained}.single_model"
    alternative = f"--pretrained {single}" if single in models else "one model's own archive"
    raise ValueError(f"--pretrained {pretrained} is an ensemble of {len(members)} models ({', '.join(members)}), "
                     f"which a single fast-weight model cannot replace; convert {alternative} instead")


def _transformer_parser():
    from fairseq.models.transformer import TransformerModel

    parser = argparse.ArgumentParser()
    TransformerModel.add_args(parser)
    return parser


def model_options(checkpoint):
    """{option: value} of the checkpoint's Transformer: the options fairseq's TransformerModel defines and
    those its architectures derive from them (decoder_input_dim, ...); a legacy checkpoint keeps every option
    of its run in one flat namespace."""
    from fairseq.models.transformer.transformer_legacy import base_architecture

    derived = argparse.Namespace()
    base_architecture(derived)
    defined = {action.dest for action in _transformer_parser()._actions} | set(vars(derived))
    model = checkpoint["cfg"]["model"]
    value = (lambda name: model[name]) if hasattr(model, "keys") else (lambda name: getattr(model, name))
    names = model.keys() if hasattr(model, "keys") else vars(model)
    return {name: value(name) for name in names if name in defined and name not in NOT_MODEL_OPTIONS}


def option_flags(options):
    """The command-line flags that give `options` (model_options) to fairseq-train: every option that has a
    flag and a value (an off switch is its absence)."""
    actions = {action.dest: action for action in _transformer_parser()._actions if action.option_strings}
    flags = []
    for name, value in options.items():
        action = actions.get(name)
        if action is None or value is None or value is False:
            continue
        flags += [action.option_strings[0]] if value is True and action.nargs == 0 else [action.option_strings[0],
                                                                                          str(value)]
    return flags


def split_row_flags(argv):
    """What --pretrained takes after --: ({"source": .., "target": ..} given, the attention transfer's batch
    flags, the --fwp-* flags). Any other flag is refused by name: the model's options come from the checkpoint."""
    languages, batch, fwp = {}, [], []
    tokens = iter(argv)
    for token in tokens:
        flag, _, inline = token.partition("=")
        if flag.startswith("--fwp-"):  # each takes a value
            fwp += [token] if inline else [token, next(tokens, "")]
        elif flag in LANGUAGE_FLAGS:
            languages[LANGUAGE_FLAGS[flag]] = inline or next(tokens, "")
        elif flag in BATCH_FLAGS:
            batch += [flag, inline or next(tokens, "")]
        else:
            raise ValueError(f"{token} after --: --pretrained takes the model's own options from its checkpoint; after "
                             "-- it uses only --fwp-* flags, --source-lang and --target-lang (where the checkpoint "
                             "lacks them) and --max-tokens or --batch-size (attention transfer's batches)")
    return languages, batch, fwp


def language_pair(pretrained, folder, checkpoint, given):
    """(source, target): the checkpoint's own, or else the archive's dictionaries' (their sizes, or the pair in
    its name where both have one size), or else the one given after --."""
    task = checkpoint["cfg"]["task"]
    if task.get("_name") != "translation":
        raise ValueError(f"{folder}/model.pt is the checkpoint of a {task.get('_name')} model (its task), not of a "
                         "translation model: --pretrained converts translation models; convert a language model with "
                         "--softmax-checkpoint (docs/uptraining.md)")
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


def train_argv(pretrained, folder, checkpoint, row_argv, data=None):
    """(the fairseq-train arguments of the fast-weight twin of the checkpoint's model, the flags of its model
    alone): its translation task on `data` (default: the folder's dictionaries), arch fwp_transformer with
    the model's own options as flags (so that the row's --fwp-* flags are checked against them), the row's
    flags; the second is what OUT/model.args holds."""
    given, batch, fwp = split_row_flags(row_argv)
    source, target = language_pair(pretrained, folder, checkpoint, given)
    model = ["--user-dir", PLUGIN_DIR, "--task", "translation", "--source-lang", source, "--target-lang", target,
             "--arch", "fwp_transformer", *option_flags(model_options(checkpoint)), *fwp]
    return [data or folder, *model, *batch], model


def write_folder(folder, converted, out, argv):
    """The output folder, laid out as the archive: model.pt (the converted checkpoint, `converted`), the
    archive's dictionaries and BPE codes (a warning where it has none), and model.args (`argv`, the model's
    fairseq-train flags)."""
    bpe = [name for name in BPE_FILES if os.path.isfile(os.path.join(folder, name))]
    if not bpe:
        logger.warning(f"{folder} holds no BPE codes ({', '.join(BPE_FILES[:-1])} or {BPE_FILES[-1]}), only "
                       f"{', '.join(sorted(os.listdir(folder)))}: {out} has none either; fairseq-interactive and "
                       "from_pretrained need the codes the model was trained with (--bpe-codes FILE)")
    copied = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "dict.*.txt"))) + bpe
    os.makedirs(out, exist_ok=True)
    for name in copied:
        shutil.copy(os.path.join(folder, name), out)
    with open(os.path.join(out, "model.args"), "w") as f:
        f.write(shlex.join(argv) + "\n")
    os.replace(converted, os.path.join(out, "model.pt"))
    logger.info(f"wrote {os.path.join(out, '')}: {', '.join(sorted(copied + ['model.args', 'model.pt']))}")
