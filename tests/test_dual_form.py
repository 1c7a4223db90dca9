"""Dual form of linear layers (fairseq_fwp/dual_form): record during the real fairseq-train, verify, explain."""
import json
import os
import re

import numpy as np
import pytest

pytest.importorskip("fairseq")

from examples.dual_form.__main__ import main as dual_form_cli  # noqa: E402
from examples.dual_form.dual import dual_weights  # noqa: E402
from fairseq_fwp.dual_form.storage import GrowingNpy, Record  # noqa: E402
from examples.recipes.pipeline import PLUGIN_DIR, fairseq  # noqa: E402
from examples.recipes.commands import python  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UPDATES = 300
# Both layouts fairseq uses: a layer inside the decoder stack runs time-first
# ([T, B, d], with a bias), the output projection batch-first (no bias).
LAYERS = ["decoder.layers.1.fc1", "decoder.output_projection"]
# Plain SGD with what the record must get right: --update-freq accumulation,
# a learning rate that changes every update, and padded last blocks.
SGD = ["--optimizer", "sgd", "--lr", 0.5, "--lr-scheduler", "inverse_sqrt", "--warmup-updates", 50,
       "--update-freq", 2]


def train(data, save_dir, *flags, task="dual_form_language_modeling", max_update=UPDATES):
    return fairseq("train", data, "--user-dir", PLUGIN_DIR, "--task", task, "--arch", "fwp_lm_tiny",
                   "--tokens-per-sample", 32, "--sample-break-mode", "none", "--max-tokens", 256,
                   "--max-update", max_update, "--save-dir", save_dir, "--no-epoch-checkpoints", "--seed", 1,
                   # ~70 short epochs: save and validate only at the end
                   "--save-interval", 1000, "--disable-validation",
                   "--log-format", "simple", "--log-interval", 25, *flags)


def record_flags(record_dir):
    return ["--dual-form-record", ",".join(LAYERS), "--dual-form-dir", record_dir]


def inner_losses(log):
    return re.findall(r"train_inner \| .*?loss=([0-9.]+)", log)


@pytest.fixture(scope="module")
def data(corpora):
    return corpora["lm"]


@pytest.fixture(scope="module")
def recorded(data, tmp_path_factory):
    """A run of UPDATES SGD updates with LAYERS recorded: (save_dir, record_dir, training log)."""
    root = tmp_path_factory.mktemp("recorded")
    log = train(data, root / "ckpt", *SGD, *record_flags(root / "record"))
    return root / "ckpt", root / "record", log


def test_growing_npy_is_a_valid_npy_after_every_append(tmp_path):
    path = str(tmp_path / "rows.npy")
    rows = GrowingNpy(path, "float16", (3,))
    assert np.load(path).shape == (0, 3)
    for n in (2, 5):
        rows.append(np.arange(3 * n).reshape(n, 3))
    loaded = np.load(path, mmap_mode="r")
    assert loaded.dtype == np.float16 and loaded.shape == (7, 3)
    assert loaded[2:].tolist() == np.arange(15).reshape(5, 3).tolist()


@pytest.mark.slow
def test_dual_form_reproduces_the_trained_layers(recorded, tmp_path):
    ckpt, record_dir, _ = recorded
    report_path = tmp_path / "verify.json"
    status = dual_form_cli(["verify", "--dir", str(record_dir), "--checkpoint", str(ckpt / "checkpoint_last.pt"),
                            "--num-queries", "128", "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    assert status == 0, report
    assert report["num_updates"] == UPDATES
    for layer in LAYERS:
        result = report["layers"][layer]
        assert result["queries"] == 128
        assert result["max_relative_error"] < 1e-4
        assert result["weight_relative_error"] < 1e-5
        assert result["weight_change_relative"] > 0.01  # the layer did learn: the check is not vacuous
    assert report["layers"]["decoder.layers.1.fc1"]["bias_relative_error"] < 1e-5

    # Without the last update's rows the dual form is off: the comparison can fail.
    record = Record(str(record_dir))
    weight, _ = dual_weights(record, LAYERS[0], record.rows_before(UPDATES - 1))
    trained, _ = dual_weights(record, LAYERS[0], record.rows_before(UPDATES))
    assert np.linalg.norm(weight - trained) / np.linalg.norm(trained) > 1e-4


@pytest.mark.slow
def test_recording_does_not_change_training(data, recorded, tmp_path):
    import torch

    ckpt, _, recorded_log = recorded
    plain_log = train(data, tmp_path / "plain", *SGD, task="language_modeling")
    assert inner_losses(plain_log) and inner_losses(plain_log) == inner_losses(recorded_log)
    load = lambda path: torch.load(path, map_location="cpu", weights_only=False)["model"]  # noqa: E731
    with_record, without = load(ckpt / "checkpoint_last.pt"), load(tmp_path / "plain" / "checkpoint_last.pt")
    assert with_record.keys() == without.keys()
    assert all(torch.equal(with_record[k], without[k]) for k in without)


@pytest.mark.parametrize("flags, message", [
    (["--optimizer", "adam"], "got --optimizer adam, use --optimizer sgd"),
    (["--optimizer", "sgd", "--momentum", "0.9"], "set --momentum 0"),
    (["--optimizer", "sgd", "--share-decoder-input-output-embed"], "is shared with decoder.embed_tokens.weight"),
])
@pytest.mark.slow
def test_refuses_settings_where_the_dual_form_is_not_exact(data, tmp_path, flags, message):
    with pytest.raises(RuntimeError, match=re.escape(message)):
        train(data, tmp_path / "ckpt", *flags, *record_flags(tmp_path / "record"), max_update=2)
    assert not os.path.exists(tmp_path / "record" / "manifest.json")  # nothing half-written to clean up


@pytest.mark.slow
def test_explain_is_deterministic(recorded, tmp_path):
    ckpt, record_dir, _ = recorded
    outputs = []
    for run in ("first", "second"):
        status = dual_form_cli(["explain", "--dir", str(record_dir), "--checkpoint", str(ckpt / "checkpoint_last.pt"),
                                "--layer", LAYERS[0], "--query", "the cats see a tree near the house",
                                "--position", "2", "--top-k", "3", "--out", str(tmp_path / run)])
        assert status == 0
        outputs.append({name: (tmp_path / run / name).read_bytes() for name in ("explain.json", "explain.md")})
    assert outputs[0] == outputs[1]
    assert (tmp_path / "first" / "attention.png").stat().st_size > 1000

    report = json.loads(outputs[0]["explain.json"])
    assert report["query"]["token"] == "see" and report["query"]["passage"] == "the cats **see**"
    attention = [t["attention"] for t in report["top"]]
    assert len(attention) == 3 and attention == sorted(attention, reverse=True)
    assert all("**" in t["passage"] for t in report["top"])
    assert sum(d["attention"] for d in report["documents"]) == pytest.approx(report["total_attention"])


@pytest.mark.slow
def test_wikitext2_demo_skips_without_the_data(tmp_path):
    demo = os.path.join(ROOT, "examples", "dual_form", "wikitext2_demo.py")
    proc = python(demo, "--data", tmp_path / "absent", "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "skipping" in proc.stdout and not os.path.exists(tmp_path / "out")
