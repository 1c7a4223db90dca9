"""On-disk record of a training run in the dual form (paper Sec. 3, Corollary 1).

One directory per run:

    manifest.json           layers, dims, dtype, bytes per token, data, what each array means
    updates.npy             one row per optimizer update: update, lr, sample_size, scale, first_row, num_rows
    index.npy               one row per recorded token: update, sample_id, position, token_offset
    <layer>/W0.npy          initial weight [d_out, d_in] (float32)
    <layer>/b0.npy          initial bias [d_out] (only for layers with a bias)
    <layer>/keys.npy        training inputs x_t [N, d_in]
    <layer>/grads.npy       output gradients g_t = dL/dy_t [N, d_out], before the optimizer's scaling

Row r of every layer's keys/grads and of index.npy is the same token. The
error signal of Eq. 12 is e_t = scale[update_t] * g_t with scale = -lr /
sample_size (fairseq divides the summed gradient by the sample size before
the step). Keeping the scale per update, not inside e_t, keeps float16
records usable: lr / sample_size is ~1e-3, and the scaled values would
underflow in float16.

The row arrays are .npy files that grow in place: each append writes the
rows at the end and rewrites a fixed-size header with the new shape, so the
files are valid (np.load(..., mmap_mode="r")) after every update.
"""
import json
import os

import numpy as np

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
INDEX_DTYPE = np.dtype([("update", "<i4"), ("sample_id", "<i8"), ("position", "<i4"), ("token_offset", "<i8")])
UPDATE_DTYPE = np.dtype([("update", "<i4"), ("lr", "<f8"), ("sample_size", "<f8"), ("scale", "<f8"),
                         ("first_row", "<i8"), ("num_rows", "<i8"), ("mismatch", "<f8")])
STORAGE_DTYPES = ("float32", "float16")


def _header_text(dtype, shape):
    return repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(shape)})


def _npy_header(dtype, shape, size):
    """A version-1.0 .npy header of exactly `size` bytes (numpy accepts the padding spaces)."""
    preamble = np.lib.format.MAGIC_PREFIX + bytes([1, 0])
    body_len = size - len(preamble) - 2
    text = _header_text(dtype, shape).ljust(body_len - 1) + "\n"
    return preamble + body_len.to_bytes(2, "little") + text.encode("latin1")


class GrowingNpy:
    """An .npy file of rows [N, *row_shape] that grows by appending rows."""

    def __init__(self, path, dtype, row_shape=()):
        self.path, self.dtype, self.row_shape = path, np.dtype(dtype), tuple(row_shape)
        self.rows = 0
        # Sized for the longest row count, so a growing shape never moves the data.
        longest = len(_header_text(self.dtype, (2 ** 63 - 1, *self.row_shape))) + 12
        self._header_size = -(-longest // 64) * 64
        self._file = open(path, "w+b")
        self._write_header()

    def _write_header(self):
        self._file.seek(0)
        self._file.write(_npy_header(self.dtype, (self.rows, *self.row_shape), self._header_size))
        self._file.flush()

    def append(self, rows):
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        if rows.shape[1:] != self.row_shape:
            raise ValueError(f"{self.path}: rows of shape {rows.shape[1:]}, expected {self.row_shape}")
        self._file.seek(0, os.SEEK_END)
        self._file.write(rows.tobytes())
        self.rows += len(rows)
        self._write_header()


def ensure_no_record(record_dir):
    if os.path.exists(os.path.join(record_dir, MANIFEST)):
        raise FileExistsError(f"--dual-form-dir {record_dir} already holds a record; a record starts at update 0 "
                              "of a fresh run, so pick an empty directory")


def layer_dir(record_dir, layer):
    return os.path.join(record_dir, layer)


class RecordWriter:
    """Creates a record directory and appends one optimizer update at a time."""

    def __init__(self, record_dir, layer_dims, dtype, metadata):
        """layer_dims: {layer name: (d_in, d_out, has_bias)}; metadata: extra manifest entries (data, task)."""
        if dtype not in STORAGE_DTYPES:
            raise ValueError(f"--dual-form-dtype must be one of {STORAGE_DTYPES}, got {dtype!r}")
        ensure_no_record(record_dir)
        self.dir, self.dtype = record_dir, dtype
        os.makedirs(record_dir, exist_ok=True)
        self.index = GrowingNpy(os.path.join(record_dir, "index.npy"), INDEX_DTYPE)
        self.updates = GrowingNpy(os.path.join(record_dir, "updates.npy"), UPDATE_DTYPE)
        self.keys, self.grads = {}, {}
        for name, (d_in, d_out, _) in layer_dims.items():
            os.makedirs(layer_dir(record_dir, name), exist_ok=True)
            self.keys[name] = GrowingNpy(os.path.join(layer_dir(record_dir, name), "keys.npy"), dtype, (d_in,))
            self.grads[name] = GrowingNpy(os.path.join(layer_dir(record_dir, name), "grads.npy"), dtype, (d_out,))
        self._write_manifest(layer_dims, metadata)

    def _write_manifest(self, layer_dims, metadata):
        item = np.dtype(self.dtype).itemsize
        layers = {name: {"d_in": d_in, "d_out": d_out, "has_bias": has_bias,
                         "bytes_per_token": (d_in + d_out) * item}
                  for name, (d_in, d_out, has_bias) in layer_dims.items()}
        manifest = {
            "format_version": FORMAT_VERSION,
            "dtype": self.dtype,
            "layers": layers,
            "bytes_per_token": sum(v["bytes_per_token"] for v in layers.values()) + INDEX_DTYPE.itemsize,
            "index_fields": {
                "update": "optimizer update (0-based) whose step applied this row",
                "sample_id": "fairseq dataset index of the training sample (block)",
                "position": "position in the sample's src_tokens",
                "token_offset": "offset in the training token stream of the input token at that position "
                                "(-1: the eos fairseq puts before the first block)",
            },
            "error_signal": "e_t = scale[update] * g_t, scale = -lr / sample_size (updates.npy)",
            **metadata,
        }
        with open(os.path.join(self.dir, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2)

    def write_initial_weights(self, name, weight, bias):
        np.save(os.path.join(layer_dir(self.dir, name), "W0.npy"), weight.astype(np.float32))
        if bias is not None:
            np.save(os.path.join(layer_dir(self.dir, name), "b0.npy"), bias.astype(np.float32))

    def append_update(self, update, lr, sample_size, scale, index_rows, keys, grads, mismatch):
        """keys/grads: {layer: array [n, d]} for the n rows of index_rows."""
        first_row = self.index.rows
        for name in self.keys:
            self.keys[name].append(keys[name])
            self.grads[name].append(grads[name])
        self.index.append(index_rows)
        self.updates.append(np.array([(update, lr, sample_size, scale, first_row, len(index_rows), mismatch)],
                                     dtype=UPDATE_DTYPE))


class Record:
    """Read access to a record directory (memory-mapped)."""

    def __init__(self, record_dir):
        path = os.path.join(record_dir, MANIFEST)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no dual-form record in {record_dir} ({MANIFEST} missing); "
                                    "train with --task dual_form_language_modeling --dual-form-record ...")
        with open(path) as f:
            self.manifest = json.load(f)
        self.dir = record_dir
        self.updates = np.load(os.path.join(record_dir, "updates.npy"))
        # Rows are appended before their update's line: rows past the last
        # complete update (a run killed mid-append) are ignored.
        self.num_rows = int(self.updates["first_row"][-1] + self.updates["num_rows"][-1]) if len(self.updates) else 0
        self.index = np.load(os.path.join(record_dir, "index.npy"), mmap_mode="r")[:self.num_rows]

    @property
    def layers(self):
        return list(self.manifest["layers"])

    def check_layer(self, layer):
        if layer not in self.manifest["layers"]:
            raise KeyError(f"layer {layer!r} is not in the record; recorded: {', '.join(self.layers)}")

    def initial_weights(self, layer):
        """(W0 [d_out, d_in], b0 [d_out] or None)."""
        self.check_layer(layer)
        d = layer_dir(self.dir, layer)
        bias = np.load(os.path.join(d, "b0.npy")) if self.manifest["layers"][layer]["has_bias"] else None
        return np.load(os.path.join(d, "W0.npy")), bias

    def keys(self, layer):
        self.check_layer(layer)
        return np.load(os.path.join(layer_dir(self.dir, layer), "keys.npy"), mmap_mode="r")[:self.num_rows]

    def grads(self, layer):
        self.check_layer(layer)
        return np.load(os.path.join(layer_dir(self.dir, layer), "grads.npy"), mmap_mode="r")[:self.num_rows]

    def rows_before(self, num_updates):
        """Number of rows written by updates 0 .. num_updates-1 (the state of a checkpoint at num_updates)."""
        if num_updates > len(self.updates):
            raise ValueError(f"the checkpoint has {num_updates} updates but the record only {len(self.updates)}: "
                             "it is not from the recorded run")
        done = self.updates[:num_updates]
        return int(done["first_row"][-1] + done["num_rows"][-1]) if num_updates else 0

    def row_scales(self, rows):
        """scale (= -lr / sample_size) of each of the first `rows` rows, float64."""
        return np.repeat(self.updates["scale"], self.updates["num_rows"])[:rows]

    def disk_bytes(self):
        total = 0
        for root, _, files in os.walk(self.dir):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        return total
