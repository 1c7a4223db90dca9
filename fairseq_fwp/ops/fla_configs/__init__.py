"""Recorded winners of fla's autotuning, per GPU, so that a first training step on that GPU compiles one
config per kernel instead of every config of its list (README.md beside this file).

    preload()                              fla.py, once fla is imported: each of fla's autotuners starts
                                           with the configs recorded for this GPU
    record(triton_cache, gpu, capability)  the GPU check: Triton's autotune results (fla passes
                                           cache_results) into this folder

A GPU's folder holds one file per kernel in fla's own format (fla/ops/utils/cache.py: {kernel}.json with
"autotune_entries", each an "autotune_key" and its "config", under the md5 of the key), and recorded.json:
the GPU's name and capability, and the fla and Triton versions that recorded them.
"""
import functools
import hashlib
import json
import logging
import os
import re
import sys
from pathlib import Path

FOLDER = Path(__file__).parent
RECORDED = "recorded.json"
CONFIG_FIELDS = ("kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg", "ir_override")
USER_SETTINGS = ("FLA_CONFIG_DIR", "FLA_CACHE_MODE")  # fla's own config cache, set by the user
logger = logging.getLogger("fairseq_fwp.backend")


def gpu_folder_name(gpu):
    """The folder of a GPU's configs: its name as fla names its own config folders (sanitize_gpu_name)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", gpu).strip("_") or "unknown_gpu"


def key_hash(key):
    """fla's name for an autotune key in its files (AutotuneKey.key_hash)."""
    return hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def _read(path, what):
    """The JSON object in `path` whose fields `what` names; None, with a warning naming the file, where it cannot
    be read or is not such an object (a file cut short, edited by hand, or of another format): a recorded file
    is an optimisation, never a reason for training to stop."""
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or not all(isinstance(data.get(field), kind) for field, kind in what.items()):
            raise ValueError(f"not fla_configs' format (an object with {', '.join(what)})")
        return data
    except (OSError, UnicodeDecodeError, ValueError) as error:  # JSONDecodeError is a ValueError
        logger.warning(f"fla_configs: {path} skipped: {type(error).__name__}: {error}")
        return None


def folder_for(gpu, capability, fla_version, root=None):
    """The folder under `root` (default: this one) recorded on `gpu`, else one recorded on a GPU of the same
    compute capability (same architecture: the same configs compile and fit), each with this fla's version;
    None if none."""
    candidates = []
    for recorded in sorted(Path(root or FOLDER).glob(f"*/{RECORDED}")):
        about = _read(recorded, {"fla": str, "capability": list, "gpu": str})
        if about and about["fla"] == fla_version and tuple(about["capability"]) == tuple(capability):
            candidates.append((about["gpu"] != gpu, recorded.parent))
    return min(candidates)[1] if candidates else None


def load(folder):
    """{kernel name: [(autotune key as a tuple, config dict)]} of a GPU's folder (a file that cannot be read is
    skipped, with a warning)."""
    recorded = {}
    for path in sorted(Path(folder).glob("*.json")):
        if path.name == RECORDED:
            continue
        data = _read(path, {"kernel_name": str, "autotune_entries": dict})
        entries = [] if data is None else list(data["autotune_entries"].values())
        if data is None or not all(isinstance(entry, dict) and isinstance(entry.get("autotune_key"), list)
                                   and isinstance(entry.get("config"), dict) for entry in entries):
            if data is not None:
                logger.warning(f"fla_configs: {path} skipped: an entry without its autotune_key and config")
            continue
        recorded[data["kernel_name"]] = [(tuple(entry["autotune_key"]), entry["config"]) for entry in entries]
    return recorded


def _write(path, data):
    """`data` as JSON into `path`, replacing it in one step (a run stopped while writing leaves the old file)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _fla_autotuners():
    """Every autotuned kernel that fla's imported modules define (under their heuristics wrappers)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    seen = {}
    for name, module in list(sys.modules.items()):
        if name != "fla" and not name.startswith("fla."):
            continue
        for value in list(vars(module).values()):
            while isinstance(value, KernelInterface) and not isinstance(value, Autotuner):
                value = getattr(value, "fn", None)
            if isinstance(value, Autotuner):
                seen[id(value)] = value
    return list(seen.values())


def _options(config):
    """A config's settings, as a comparable dict (a triton.Config, or a recorded config dict)."""
    if isinstance(config, dict):
        return {**config.get("kwargs", {}), "num_warps": config.get("num_warps", 4),
                "num_stages": config.get("num_stages", 3), "num_ctas": config.get("num_ctas", 1)}
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1)}


def fill(autotuners, recorded):
    """Starts each autotuner's cache with its recorded winners: a recorded config only where it is one of
    the kernel's own candidates, and never over a key it has tuned. Returns how many keys were filled."""
    filled = 0
    for tuner in autotuners:
        for key, config in recorded.get(tuner.base_fn.__name__, ()):
            match = [candidate for candidate in tuner.configs if _options(candidate) == _options(config)]
            if match and key not in tuner.cache:
                tuner.cache[key] = match[0]
                filled += 1
    return filled


@functools.lru_cache(maxsize=None)
def preload():
    """Once per process, after fla is imported: fla's autotuners start with the configs recorded for this
    GPU (none where the user set fla's own FLA_CONFIG_DIR or FLA_CACHE_MODE, or where none were recorded
    for this GPU's architecture and fla version: fla autotunes as before). Returns the folder used, or None.

    fla's own config cache (those two variables) reaches only the kernels fla declares with its
    fla_cache_autotune; most of those that training runs it declares with Triton's autotune, which the
    recorded winners reach here."""
    import torch

    if any(name in os.environ for name in USER_SETTINGS) or not torch.cuda.is_available():
        return None
    import fla

    gpu = torch.cuda.get_device_name()
    folder = folder_for(gpu, torch.cuda.get_device_capability(), fla.__version__)
    if folder is None:
        return None
    filled = fill(_fla_autotuners(), load(folder))
    logger.info(f"fla starts with {filled} autotune winners recorded in {folder} (for {gpu}: fairseq_fwp/ops/"
                "fla_configs/README.md)")
    return folder


def record(triton_cache, gpu, capability, versions, root=None):
    """Adds the autotune results in Triton's cache folder (Triton's {kernel}.autotune.json, written where
    autotuning ran with cache_results: one a config list, so a key tuned in shards has several) to `gpu`'s
    folder under `root` (default: this folder), the fastest config of each kernel and key; versions: {"fla":
    ..., "triton": ...} (and anything else recorded.json should say; another fla's records there are dropped
    first). Returns (the folder, how many keys were new)."""
    folder = Path(root or FOLDER) / gpu_folder_name(gpu)
    folder.mkdir(parents=True, exist_ok=True)
    about = _read(folder / RECORDED, {"fla": str}) if (folder / RECORDED).exists() else None
    if (folder / RECORDED).exists() and (about is None or about["fla"] != versions["fla"]):
        for old in folder.glob("*.json"):  # another fla's kernels (or unknown ones): their keys and configs may
            old.unlink()  # not be this one's
    fastest = {}  # (kernel, key's name) -> (timings, key, config)
    for path in sorted(Path(triton_cache).glob("*/*.autotune.json")):
        data = json.loads(path.read_text())
        kernel, name = path.name.removesuffix(".autotune.json"), key_hash(data["key"])
        for config, timings in data["configs_timings"]:
            if (kernel, name) not in fastest or timings < fastest[kernel, name][0]:
                fastest[kernel, name] = (timings, data["key"], config)
    new = 0
    for (kernel, name), (_, key, config) in sorted(fastest.items()):
        target = folder / f"{kernel}.json"
        entries = (_read(target, {"kernel_name": str, "autotune_entries": dict}) if target.exists() else None) or \
            {"kernel_name": kernel, "triton_version": versions.get("triton"), "autotune_entries": {}}
        new += name not in entries["autotune_entries"]
        entries["autotune_entries"][name] = {
            "autotune_key": key, "config": {k: config[k] for k in CONFIG_FIELDS if config.get(k) is not None}}
        _write(target, entries)
    _write(folder / RECORDED, {"gpu": gpu, "capability": list(capability), **versions})
    return folder, new
