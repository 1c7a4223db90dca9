"""Raw text in, raw text out: the recipes' BPE tools as fairseq's own --bpe reads them,
fairseq-interactive and the hub interface on a plugin checkpoint, and TensorBoard logging."""
import os
import re

import pytest

pytest.importorskip("fairseq")

from examples.recipes import bpe, text, translation  # noqa: E402
from examples.recipes.commands import PLUGIN_DIR, fairseq  # noqa: E402
from examples.recipes.synthetic_data import write_corpora  # noqa: E402


def corpus_pairs(root, n_train=1500):
    mt_raw, _ = write_corpora(root / "synthetic", n_train=n_train, n_eval=20, seed=5)
    read = lambda split, side: text.read_lines(os.path.join(mt_raw, f"{split}.{side}"))  # noqa: E731
    return {split: [(read(split, "src"), read(split, "tgt"))] for split in ("train", "valid", "test")}


@pytest.mark.parametrize("tool", bpe.BPE_TOOLS)
def test_codes_are_applied_as_fairseqs_own_bpe_applies_them(tool, tmp_path):
    from argparse import Namespace

    from fairseq.data import encoders

    lines = [" ".join(pair) for pair in zip(*corpus_pairs(tmp_path, 300)["train"][0])]
    corpus = tmp_path / "text"
    text.write_lines(corpus, lines)
    codes = str(tmp_path / "codes")
    bpe.learn(tool, [corpus], codes, merges=40)
    ours = bpe.apply(tool, codes, lines)
    assert any("@@ " in line for line in ours)  # words were split
    fairseq_bpe = encoders.build_bpe(Namespace(bpe=bpe.FAIRSEQ_BPE[tool], bpe_codes=codes))
    assert [fairseq_bpe.encode(line) for line in lines] == ours
    assert [fairseq_bpe.decode(line) for line in ours] == lines


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained on BPE'd synthetic pairs through the translation recipe's steps."""
    root = tmp_path_factory.mktemp("raw_text")
    translation.prepare(corpus_pairs(root), "src", "tgt", str(root / "prepared"), merges=40)
    save = root / "checkpoints"
    translation.train(str(root / "prepared" / "bin"), str(save), "fwp_transformer_tiny", [],
                      ["--optimizer", "adam", "--lr", "0.003", "--lr-scheduler", "inverse_sqrt",
                       "--warmup-updates", "20", "--max-tokens", "2000", "--max-update", "60",
                       "--no-epoch-checkpoints", "--tensorboard-logdir", str(root / "tensorboard")])
    return root


@pytest.mark.slow
def test_interactive_and_hub_translate_raw_text_as_generate_does(trained):
    prepared, checkpoint = trained / "prepared", trained / "checkpoints" / "checkpoint_last.pt"
    generated = translation.translate_and_score(str(prepared), str(checkpoint), "src", "tgt", ["--beam", "4"],
                                                str(trained / "test"))
    expected = text.read_lines(str(trained / "test.hyp.detok"))
    assert generated["sentences"] == len(expected) == 20
    sources = text.read_lines(str(prepared / "raw" / "test.src"))
    codes = str(prepared / "bpe" / "codes")
    output = fairseq("interactive", str(prepared / "bin"), "--user-dir", PLUGIN_DIR, "--path", str(checkpoint),
                     "--source-lang", "src", "--target-lang", "tgt", "--beam", "4", "--tokenizer", "moses",
                     "--bpe", "subword_nmt", "--bpe-codes", codes, "--input", str(prepared / "raw" / "test.src"))
    interactive = [line.split("\t")[2] for line in output.splitlines() if re.match(r"^D-\d+\t", line)]
    assert interactive == expected

    from fairseq_fwp.models.fwp_transformer import FastWeightTransformerModel

    hub = FastWeightTransformerModel.from_pretrained(
        str(checkpoint.parent), checkpoint_file=checkpoint.name, data_name_or_path=str(prepared / "bin"),
        source_lang="src", target_lang="tgt", tokenizer="moses", bpe="subword_nmt", bpe_codes=codes)
    assert hub.translate(sources, beam=4) == expected


@pytest.mark.slow
def test_tensorboard_event_files_are_written(trained):
    events = [name for _, _, files in os.walk(trained / "tensorboard") for name in files]
    assert any(name.startswith("events.out.tfevents") for name in events), events
