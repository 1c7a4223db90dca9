"""A session's file: what session.History saves, written whole or not at all, and checked when it loads.

The file holds the decoders' states (plain tensors, keyed by module order), the history's counts, the models'
fingerprints and a digest (SHA-256) of all of it. Loading refuses, saying what is wrong with the file: empty; not
a file torch.save wrote; cut short or corrupted (torch cannot read it); not a session; contents that differ from
the digest they were saved with (damaged); written by another model (another architecture, other parameters, or
this model in another dtype). History.load then checks that the file holds every state the model keeps.
"""
import hashlib
import os
import tempfile

import torch

FORMAT = "fairseq-fwp session 2"
EARLIER_FORMAT = "fairseq-fwp session 1"  # before the digest: loads, unchecked
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's files are zip archives


class SessionFileError(ValueError):
    """A session file that cannot be continued from, and why."""


def fingerprints(models):
    """(exact, architecture, dtypes) of the models: a digest of their classes, parameters and buffers, values
    included; one of the same without values or dtypes; the dtypes of their floating-point tensors."""
    exact, architecture, dtypes = hashlib.sha256(), hashlib.sha256(), set()
    for model in models:
        for digest in (exact, architecture):
            digest.update(type(model).__qualname__.encode())
        for name, tensor in model.state_dict().items():
            architecture.update(f"{name}{tuple(tensor.shape)}".encode())
            exact.update(name.encode())
            exact.update(str((tuple(tensor.shape), tensor.dtype)).encode())
            exact.update(_bytes(tensor))
            if tensor.is_floating_point():
                dtypes.add(str(tensor.dtype).replace("torch.", ""))
    return exact.hexdigest(), architecture.hexdigest(), sorted(dtypes)


def digest(value):
    """SHA-256 of a saved value: nested dicts, lists, tensors and numbers, the same before saving and after loading."""
    sha = hashlib.sha256()
    _update(sha, value)
    return sha.hexdigest()


def _update(sha, value):
    if isinstance(value, dict):
        sha.update(b"{")
        for key in sorted(value, key=str):
            sha.update(repr(key).encode())
            _update(sha, value[key])
        sha.update(b"}")
    elif isinstance(value, (list, tuple)):  # a saved tuple may load as either
        sha.update(b"[")
        for item in value:
            _update(sha, item)
        sha.update(b"]")
    elif isinstance(value, torch.Tensor):
        sha.update(str((tuple(value.shape), value.dtype)).encode())
        sha.update(_bytes(value))
    else:
        sha.update(repr(value).encode())


def _bytes(tensor):
    return tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def write(path, saved):
    """Writes `saved` (without its digest) and its digest to `path`, replacing the file in one step: a file that
    a crash cuts short is a temporary one, never the session."""
    saved = {**saved, "format": FORMAT}
    saved["digest"] = digest(saved)
    folder = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=".session-", dir=folder)
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(saved, file)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def read(path, device, models):
    """What `write` wrote to `path`, for `models`; SessionFileError naming what is wrong otherwise."""
    if not os.path.exists(path):
        raise SessionFileError(f"{path}: no such session file")
    with open(path, "rb") as file:
        start = file.read(len(ZIP_MAGIC))
    if not start:
        raise SessionFileError(f"{path} is empty: not a session file (a session is saved by Session.save, or by "
                               "fairseq-interactive --fwp-session-file)")
    try:
        saved = torch.load(path, map_location=device, weights_only=True)
    except Exception as error:
        if start == ZIP_MAGIC:
            raise SessionFileError(f"{path} is damaged: it is cut short or corrupted, and torch cannot read it "
                                   f"({type(error).__name__}: {_first_line(error)})") from None
        raise SessionFileError(f"{path} is not a session file: it is not a file torch.save wrote") from None
    if not isinstance(saved, dict) or saved.get("format") not in (FORMAT, EARLIER_FORMAT):
        held = f"a {type(saved).__name__}" + (f" of {', '.join(map(str, list(saved)[:5]))}" if isinstance(saved, dict)
                                              else "")
        raise SessionFileError(f"{path} is not a session file: it holds {held}, not a {FORMAT}")
    if saved["format"] == FORMAT:
        kept = {key: value for key, value in saved.items() if key != "digest"}
        if saved.get("digest") != digest(kept):
            raise SessionFileError(f"{path} is damaged: its contents differ from what was saved (they do not match "
                                   "the digest saved with them)")
    _check_models(path, saved, models)
    return saved


def _check_models(path, saved, models):
    exact, architecture, dtypes = fingerprints(models)
    if saved["fingerprint"] == exact:
        return
    if "architecture" not in saved:  # a file of the earlier format
        raise SessionFileError(f"{path} holds a session of another model: it can only continue with the model that "
                               "wrote it")
    if saved["architecture"] != architecture:
        raise SessionFileError(f"{path} holds a session of another model (another architecture): it can only "
                               "continue with the model that wrote it")
    if saved.get("dtypes") != dtypes:
        raise SessionFileError(f"{path} was saved by this model in {', '.join(saved['dtypes'])}, and the model is "
                               f"now in {', '.join(dtypes)}: cast the model back (its state was written in the "
                               "other dtype), or start a new session")
    raise SessionFileError(f"{path} holds a session of another model (the same architecture, other parameters): "
                           "it can only continue with the model that wrote it")


def _first_line(error):
    return (str(error).splitlines() or [""])[0][:200]
