"""fairseq's published translation models (or any packed like them) as the source of an uptraining.

    python -m fairseq_fwp.uptrain --pretrained transformer.wmt16.en-de --out models/wmt16-dpfp256 -- \\
        --fwp-feature-map dpfp --fwp-dpfp-nu 2

``--pretrained`` takes a name of fairseq's own hub (``TransformerModel.hub_models()``), an archive's URL
(http(s):// through fairseq's downloader, with its progress bar and cache; file://), a local archive, or a
folder: what fairseq's hub archives hold, ``model.pt`` beside ``dict.SRC.txt``, ``dict.TGT.txt`` and the
BPE codes (``bpecodes``). The converted model is built from the checkpoint's own architecture and options
(the user names only the --fwp-* flags of the row), and the output folder is laid out as the archive was:
``model.pt`` (the fast-weight model, arch ``fwp_transformer``), the dictionaries and the codes, so that
fairseq-generate, fairseq-interactive and ``TransformerModel.from_pretrained`` read it with the tokenizer
and BPE settings of the original (and ``--user-dir`` naming the plugin). Ensembles (``model1.pt`` ...) are
refused, naming the single model to convert instead.
"""
import glob
import hashlib
import logging
import os
import shutil
import tarfile
import urllib.parse

logger = logging.getLogger("fairseq_fwp.uptrain")
CACHE = os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "fairseq_fwp", "pretrained")
PLUGIN_DIR = os.path.dirname(os.path.abspath(__file__))
# Options of the model that are not what it computes: where it ran, how it was trained.
NOT_MODEL_OPTIONS = ("_name", "arch", "data", "user_dir")


def hub():
    """fairseq's own names of its published translation models: {name: archive URL}."""
    from fairseq.models.transformer import TransformerModel

    return {name: entry if isinstance(entry, str) else entry["path"]
            for name, entry in TransformerModel.hub_models().items()}


def fetch(pretrained):
    """The folder that holds the model `pretrained` names (see the module's docstring)."""
    from fairseq import file_utils

    models = hub()
    location = models.get(pretrained, pretrained)
    if location.startswith("file://"):
        location = urllib.parse.unquote(urllib.parse.urlparse(location).path)
    if os.path.isdir(location):
        folder = location
    elif os.path.isfile(location):
        folder = _extracted(location)
    elif urllib.parse.urlparse(location).scheme in ("http", "https", "s3"):
        folder = file_utils.load_archive_file(location)  # downloads into fairseq's cache, with progress
        if folder is None:
            raise FileNotFoundError(f"could not download {location}")
    else:
        raise FileNotFoundError(f"--pretrained {pretrained}: neither a model of fairseq's hub ({', '.join(models)}) nor "
                                "an archive or folder that exists")
    _check_single_model(pretrained, folder, models)
    return folder


def _extracted(archive):
    """A local archive, extracted once into the cache (the archive itself is left as it is)."""
    stat = os.stat(archive)
    key = hashlib.sha256(f"{os.path.abspath(archive)}:{stat.st_size}:{stat.st_mtime}".encode()).hexdigest()[:16]
    folder = os.path.join(CACHE, key)
    if not os.path.isdir(folder):
        staging = folder + ".part"
        shutil.rmtree(staging, ignore_errors=True)
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")
        entries = os.listdir(staging)  # fairseq's archives hold one top folder
        inner = os.path.join(staging, entries[0]) if len(entries) == 1 and os.path.isdir(
            os.path.join(staging, entries[0])) else staging
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        os.replace(inner, folder)
        shutil.rmtree(staging, ignore_errors=True)
    return folder


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


def model_options(checkpoint):
    """{option: value} of the checkpoint's Transformer: the options fairseq's TransformerModel defines and
    those its architectures derive from them (decoder_input_dim, ...); a legacy checkpoint keeps every option
    of its run in one flat namespace."""
    import argparse

    from fairseq.models.transformer import TransformerModel
    from fairseq.models.transformer.transformer_legacy import base_architecture

    parser = argparse.ArgumentParser()
    TransformerModel.add_args(parser)
    derived = argparse.Namespace()
    base_architecture(derived)
    defined = {action.dest for action in parser._actions} | set(vars(derived))
    model = checkpoint["cfg"]["model"]
    value = (lambda name: model[name]) if hasattr(model, "keys") else (lambda name: getattr(model, name))
    names = model.keys() if hasattr(model, "keys") else vars(model)
    return {name: value(name) for name in names if name in defined and name not in NOT_MODEL_OPTIONS}


def train_argv(folder, checkpoint, fwp_argv):
    """The fairseq-train arguments a fast-weight twin of the checkpoint's model is built from: its translation
    task on the folder's dictionaries, arch fwp_transformer, the --fwp-* flags; the model's own options are
    applied over them (uptrain.convert's model_options)."""
    task = checkpoint["cfg"]["task"]
    if not (task.get("source_lang") and task.get("target_lang")):
        raise ValueError(f"{folder}/model.pt does not say its language pair (its task's source_lang and target_lang)")
    return [folder, "--user-dir", PLUGIN_DIR, "--task", "translation", "--source-lang", task["source_lang"],
            "--target-lang", task["target_lang"], "--arch", "fwp_transformer", *fwp_argv]


def write_folder(folder, converted, out):
    """The output folder, laid out as the archive: model.pt (the converted checkpoint, `converted`), and the
    archive's dictionaries and BPE codes."""
    os.makedirs(out, exist_ok=True)
    for path in glob.glob(os.path.join(folder, "dict.*.txt")) + glob.glob(os.path.join(folder, "bpecodes")) + \
            glob.glob(os.path.join(folder, "code")) + glob.glob(os.path.join(folder, "sentencepiece.bpe.model")):
        shutil.copy(path, out)
    os.replace(converted, os.path.join(out, "model.pt"))
