"""fairseq's options that end inside fairseq's code on any model (stock fairseq's too), with an error that names
none of them or with no end, are refused by name before any work (option_checks.py): each found by the option
contract (tests/properties/test_fairseq_options.py)."""
import re

import pytest

pytest.importorskip("fairseq")

pytestmark = pytest.mark.slow  # fairseq's command-line tools

GENERATION = [
    ("--beam 0", "a search keeps at least one hypothesis"),
    ("--nbest 0", "at least one hypothesis is printed"),
    ("--batch-size 0", "batches are made of at least one sentence"),
    ("--max-tokens 0", "batches are made of at least one token"),
    ("--required-batch-size-multiple 0", "batches are made of at least one sentence"),
    ("--print-step", "is for iterative refinement"),
    ("--retain-iter-history", "is for iterative refinement"),
    ("--log-interval 0", "log every N updates, N at least 1"),
    ("--required-seq-len-multiple 0", "padded to a multiple of at least 1"),
]


@pytest.fixture(scope="module")
def translation_model(corpora, tmp_path_factory):
    from examples.recipes.pipeline import train_translation

    folder = tmp_path_factory.mktemp("checked")
    train_translation(corpora["mt"], folder, max_update=1)
    return folder / "checkpoint_last.pt"


def assert_refused(status, output, words, why):
    last = output.strip().splitlines()[-1]
    assert status == 1 and words.split()[0] in last and why in last, output[-2000:]
    assert not re.search(r"^H-", output, re.M)


@pytest.mark.parametrize("words,why", GENERATION, ids=[words for words, _ in GENERATION])
def test_a_generation_option_fairseq_cannot_run_is_refused_by_name(corpora, translation_model, words, why):
    from examples.recipes.commands import PLUGIN_DIR, completed

    status, output = completed("generate", corpora["mt"], "--user-dir", PLUGIN_DIR, "--path", translation_model,
                               "--gen-subset", "test", "--beam", 2, "--max-len-b", 4, *words.split(), timeout=120)
    assert_refused(status, output, words, why)


@pytest.mark.parametrize("words,why", [("--log-interval 0", "log every N updates"),
                                       ("--required-seq-len-multiple 0", "padded to a multiple of at least 1")])
def test_a_training_option_fairseq_cannot_run_is_refused_by_name(corpora, tmp_path, words, why):
    from examples.recipes.commands import PLUGIN_DIR, completed

    status, output = completed("train", corpora["mt"], "--user-dir", PLUGIN_DIR, "--arch", "fwp_transformer_tiny",
                               "--optimizer", "adam", "--lr", 0.001, "--max-tokens", 500, "--max-update", 2,
                               "--no-save", "--save-dir", tmp_path, *words.split(), timeout=120)
    assert_refused(status, output, words, why)
    assert "| INFO | train_inner |" not in output
