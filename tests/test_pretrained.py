"""uptrain --pretrained on a stand-in for fairseq's published models: a small softmax Transformer (fairseq's own
`transformer` arch), trained here on BPE'd synthetic pairs and packed as fairseq packs its archives (one
folder: model.pt, the dictionaries, bpecodes), served as a file:// URL, a local archive and a folder."""
import os
import re
import subprocess
import sys
import tarfile

import pytest
import torch

pytest.importorskip("fairseq")

from examples.recipes import translation  # noqa: E402
from examples.recipes.commands import PLUGIN_DIR, fairseq  # noqa: E402
from helpers import ROOT  # noqa: E402
from test_raw_text import corpus_pairs  # noqa: E402

SMALL_TRANSFORMER = ["--arch", "transformer", "--encoder-layers", "2", "--decoder-layers", "2",
                     "--encoder-embed-dim", "64", "--decoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
                     "--decoder-ffn-embed-dim", "128", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
                     "--share-all-embeddings"]


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    """A packed softmax model: model.tar.gz with model/{model.pt, dict.src.txt, dict.tgt.txt, bpecodes}."""
    root = tmp_path_factory.mktemp("published")
    prepared = root / "prepared"
    translation.prepare(corpus_pairs(root, 800), "src", "tgt", str(prepared), merges=40)
    fairseq("train", prepared / "bin", "--source-lang", "src", "--target-lang", "tgt", *SMALL_TRANSFORMER, "--optimizer", "adam", "--lr", "0.003", "--lr-scheduler",
            "inverse_sqrt", "--warmup-updates", "20", "--max-tokens", "2000", "--max-update", "60", "--seed", "1",
            "--no-epoch-checkpoints", "--no-save-optimizer-state", "--save-dir", root / "trained")
    folder = root / "model"
    folder.mkdir()
    os.replace(root / "trained" / "checkpoint_last.pt", folder / "model.pt")
    for name in ("dict.src.txt", "dict.tgt.txt"):
        (folder / name).write_bytes((prepared / "bin" / name).read_bytes())
    (folder / "bpecodes").write_bytes((prepared / "bpe" / "codes").read_bytes())
    with tarfile.open(root / "model.tar.gz", "w:gz") as tar:
        tar.add(folder, arcname="model")
    return {"root": root, "prepared": prepared, "folder": folder, "archive": root / "model.tar.gz"}




@pytest.mark.slow
def test_a_published_model_converts_in_one_command_and_translates(archive, tmp_path):
    out = tmp_path / "dpfp"
    proc = subprocess.run([sys.executable, "-m", "fairseq_fwp.uptrain", "--pretrained",
                           f"file://{archive['archive']}", "--out", out, "--data", archive["prepared"] / "bin", "--",
                           "--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "2"], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["bpecodes", "dict.src.txt", "dict.tgt.txt", "model.args", "model.pt"]
    # the next step, as uptrain prints it, runs as written: finetuning at the checkpoint's own architecture
    command = proc.stderr.split("next, finetune it")[1].split(":\n  ", 1)[1].splitlines()[0]
    finetuned = subprocess.run(["bash", "-c", command + " --max-update 2"], capture_output=True, text=True,
                               cwd=ROOT, env=dict(os.environ, PATH=os.path.dirname(sys.executable) + ":" + os.environ["PATH"]))
    assert finetuned.returncode == 0, finetuned.stdout[-3000:] + finetuned.stderr[-3000:]
    log = finetuned.stdout + finetuned.stderr
    assert "done training" in log and "was saved from another model" not in log
    model_cfg = torch.load(out / "model.pt", weights_only=False)["cfg"]["model"]
    model_cfg = model_cfg if isinstance(model_cfg, dict) else vars(model_cfg)
    assert (model_cfg["arch"], model_cfg["encoder_layers"], model_cfg["fwp_dpfp_nu"]) == ("fwp_transformer", 2, 2)
    assert archive["archive"].exists()  # the user's archive is left as it is
    output = fairseq("generate", archive["prepared"] / "bin", "--user-dir", PLUGIN_DIR, "--path", out / "model.pt",
                     "--gen-subset", "test", "--beam", 4, "--remove-bpe", "--scoring", "sacrebleu")
    assert re.search(r"BLEU = [0-9.]+", output) and len(re.findall(r"^H-\d+", output, flags=re.M)) == 20

    import fairseq_fwp  # noqa: F401  (the plugin's models, for the hub interface)
    from fairseq.models.transformer import TransformerModel

    model = TransformerModel.from_pretrained(str(out), checkpoint_file="model.pt", bpe="subword_nmt",
                                             bpe_codes=str(out / "bpecodes"))
    sources = open(archive["prepared"] / "raw" / "test.src").read().splitlines()[:2]
    assert all(isinstance(line, str) for line in model.translate(sources, beam=2))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["archive", "folder"])
def test_a_local_archive_or_folder_converts_as_the_url_does(archive, tmp_path, form):
    out = tmp_path / "gated"
    proc = subprocess.run([sys.executable, "-m", "fairseq_fwp.uptrain", "--pretrained", archive[form], "--out", out,
                           "--", "--fwp-update-rule", "gated-delta"], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "model.pt").exists()


def test_an_ensemble_is_refused_naming_its_single_model(tmp_path, monkeypatch):
    from fairseq_fwp.uptraining import published_archives

    for name in ("model1.pt", "model2.pt", "dict.en.txt"):
        (tmp_path / name).write_text("")
    hub = {"x.ensemble": {"path": str(tmp_path), "task": "translation"},
           "x.ensemble.single_model": {"path": "u", "task": "translation"}}
    monkeypatch.setattr(published_archives, "hub", lambda: hub)
    with pytest.raises(ValueError, match=r"ensemble of 2 models \(model1.pt, model2.pt\).*--pretrained "
                                         r"x.ensemble.single_model instead"):
        published_archives.fetch("x.ensemble")
    with pytest.raises(FileNotFoundError, match="neither a model of fairseq's hub"):
        published_archives.fetch(str(tmp_path / "missing.tar.gz"))
