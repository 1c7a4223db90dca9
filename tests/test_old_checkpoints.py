"""Checkpoints written by older code load into the computation they were trained with.

data/old_checkpoints.tar.xz holds tiny translation models and LMs saved by two older checkouts
(data/write_old_checkpoints.py says which and how), with the outputs each computed on fixed inputs:
- the "sum-norm" era, when --fwp-sum-norm on/off was a flag of its own beside --fwp-qk-norm sum/l2
  (off: no normalisation of phi(q), phi(k), except at a delta-rule site, which kept --fwp-qk-norm's);
- the "qk-norm" era, when --fwp-qk-norm none said it, and a delta-rule site normalised with sum under it.
Every combination of those flags with the four update rules and linear and silu features that its era
took is loaded through fairseq's own loader and must compute its stored outputs to 1e-5; so must an LM
whose config asks for NormFormer's --scale-* modules, which fairseq-train built none of then.
"""
import json
import os
import tarfile

import pytest
import torch

pytest.importorskip("fairseq")
import fairseq_fwp  # noqa: E402, F401  (the plugin, from this checkout: its models, and torch.load's fix)

ARCHIVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "old_checkpoints.tar.xz")


def manifest():
    with tarfile.open(ARCHIVE) as tar:
        return json.load(tar.extractfile("manifest.json"))


STORED = [entry for entry in manifest() if "refused" not in entry]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("old_checkpoints")
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(folder, filter="data")
    return folder


def test_the_archive_covers_every_combination_the_upgrade_touches():
    flags = {tuple(entry["flags"]) for entry in STORED}
    for sum_norm in ("on", "off"):
        for qk in ("sum", "l2"):
            for rule in ("sum", "delta", "gated-sum", "gated-delta"):
                assert ("--fwp-qk-norm", qk, "--fwp-update-rule", rule, "--fwp-feature-map", "linear",
                        "--fwp-sum-norm", sum_norm) in flags
    assert sum(entry["era"] == "qk-norm" and "none" in entry["flags"] for entry in STORED) >= 8
    assert sum("silu" in entry["flags"] for entry in STORED) >= 12


@pytest.mark.parametrize("entry", STORED, ids=[entry["name"] for entry in STORED])
def test_an_old_checkpoint_computes_its_stored_outputs(folder, entry, caplog):
    from fairseq import checkpoint_utils

    path = folder / f"{entry['name']}.pt"
    with caplog.at_level("WARNING"):
        (model,), _, _ = checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides={"data": str(folder)})
    assert "deprecated" not in caplog.text  # nobody gave the old flag: it is upgraded without a word
    stored = torch.load(path, weights_only=False)["outputs"]
    with torch.no_grad():
        if entry["arch"] == "fwp_lm_tiny":
            logits = model.eval()(stored["prev_output_tokens"])[0]
        else:
            logits = model.eval()(stored["src_tokens"], stored["src_lengths"], stored["prev_output_tokens"])[0]
    torch.testing.assert_close(logits, stored["logits"], rtol=1e-5, atol=1e-5)
