"""Where a published fairseq model comes from: the source of an uptraining with ``--pretrained``.

    python -m fairseq_fwp.uptrain --pretrained transformer.wmt16.en-de --out models/wmt16-dpfp256 -- \\
        --fwp-feature-map dpfp --fwp-dpfp-nu 2
    python -m fairseq_fwp.uptrain --pretrained transformer_lm.wiki103.adaptive --out models/wiki103-delta -- \\
        --fwp-update-rule delta

``--pretrained`` takes a name of fairseq's own hub (``TransformerModel.hub_models()`` and
``TransformerLanguageModel.hub_models()``), an archive's URL (http(s):// downloaded through fairseq's
downloader into its cache, with its progress bar; file://), a local archive, or a folder: what fairseq's
hub archives hold, ``model.pt`` beside its dictionaries and the BPE codes. An archive is extracted once into
CACHE (one folder per archive; an extraction that fails leaves nothing there). With ``FAIRSEQ_FWP_MIRROR``
set (a folder or a URL), a hub name reads its archive, by the archive's own file name, from there instead of
fairseq's server: a cluster without the internet, or a test. What the checkpoint is and how its twin is
built: published_model.py. Ensembles (``model1.pt`` ...) are refused, naming the single model to convert
instead.
"""
import glob
import hashlib
import os
import shutil
import tarfile
import urllib.parse
import zipfile

CACHE = os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "fairseq_fwp", "pretrained")
MIRROR = "FAIRSEQ_FWP_MIRROR"


def hub():
    """fairseq's own names of its published translation and language models: {name: {"path": the archive's
    URL, "task": translation or language_modeling, and the tokenizer and BPE that fairseq's hub interface reads
    the model's text with, where its table names them}}."""
    from fairseq.models.transformer import TransformerModel
    from fairseq.models.transformer_lm import TransformerLanguageModel

    models = {}
    for task, model_class in (("translation", TransformerModel), ("language_modeling", TransformerLanguageModel)):
        for name, entry in model_class.hub_models().items():
            models[name] = dict({"path": entry} if isinstance(entry, str) else entry, task=task)
    return models


def fetch(pretrained):
    """The folder that holds the model `pretrained` names (see the module's docstring)."""
    models = hub()
    location = _location(pretrained, models)
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


def _location(pretrained, models):
    """Where the archive that `pretrained` names is: its hub entry's URL, or the file of that name on the
    mirror (MIRROR); anything else is its own location."""
    if pretrained not in models:
        return pretrained
    url, mirror = models[pretrained]["path"], os.environ.get(MIRROR)
    if not mirror:
        return url
    name = os.path.basename(urllib.parse.urlparse(url).path)
    if "://" in mirror:
        return f"{mirror.rstrip('/')}/{name}"
    location = os.path.join(mirror, name)
    if not os.path.exists(location):
        raise FileNotFoundError(f"--pretrained {pretrained}: {MIRROR}={mirror} holds no {name}, the archive of {url}")
    return location


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
                         "dictionaries (dict.SRC.txt and dict.TGT.txt, or dict.txt), or an archive of that folder")
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
