"""End to end through the real fairseq commands: preprocess, train, generate, eval-lm."""
import re

import pytest

pytest.importorskip("fairseq")

from examples.recipes.synthetic_data import write_corpora  # noqa: E402
from examples.recipes.pipeline import (  # noqa: E402
    bleu, eval_lm, generate, perplexity, preprocess_translation, train_lm, train_translation,
)

pytestmark = pytest.mark.slow  # end to end through the fairseq command-line tools
N_TEST = 43  # the shared corpora's test split (conftest.py)

# Every feature map with each rule once, split between translation and language modelling; resuming is
# tested in test_reliability.py.
MT_COMBOS = [("linear", "sum"), ("performer", "delta"), ("dpfp", "sum")]
LM_COMBOS = [("linear", "delta"), ("performer", "sum"), ("dpfp", "delta")]


def fwp_flags(fm, rule):
    return ["--fwp-feature-map", fm, "--fwp-update-rule", rule]


@pytest.mark.parametrize("fm, rule", MT_COMBOS)
def test_translation_trains_and_generates_every_test_sentence(corpora, tmp_path, fm, rule):
    log = train_translation(corpora["mt"], tmp_path, *fwp_flags(fm, rule), max_update=4)
    assert "FastWeightAttention" in log and f"update_rule={rule}" in log
    # after a few updates a model may repeat tokens up to fairseq's default 200: cap the length, not the test
    out = generate(corpora["mt"], tmp_path / "checkpoint_last.pt", "--max-len-a", 1.5, "--max-len-b", 5)
    hypotheses = {int(m) for m in re.findall(r"^H-(\d+)\t", out, flags=re.M)}
    assert hypotheses == set(range(N_TEST))  # every test sentence, exactly once (43: not a multiple of 8)
    bleu(out)


@pytest.mark.parametrize("fm, rule", LM_COMBOS)
def test_lm_trains_and_scores_every_token(corpora, tmp_path, fm, rule):
    log = train_lm(corpora["lm"], tmp_path, *fwp_flags(fm, rule), max_update=4)
    assert f"update_rule={rule}" in log
    counts = []
    for extra in ([], ["--context-window", 32]):
        out = eval_lm(corpora["lm"], tmp_path / "checkpoint_last.pt", *extra)
        assert perplexity(out) > 1
        counts.append(re.search(r"Evaluated ([0-9,]+) tokens", out).group(1))
    assert counts[0] == counts[1]  # the sliding window scores every token once too


def test_the_backend_flag_governs_generate_as_it_governs_training(corpora, tmp_path):
    """--fwp-backend reaches fairseq-generate's decoding steps: one that cannot run here is refused there as
    in training."""
    train_translation(corpora["mt"], tmp_path, max_update=2)
    with pytest.raises(RuntimeError, match="backend 'cuda' cannot run this call: the csrc kernels run on CUDA"):
        train_translation(corpora["mt"], tmp_path / "cuda", "--fwp-backend", "cuda", max_update=1)
    with pytest.raises(RuntimeError, match="backend 'cuda' cannot run this call: the csrc kernels run on CUDA"):
        generate(corpora["mt"], tmp_path / "checkpoint_last.pt", "--model-overrides", "{'fwp_backend': 'cuda'}")


@pytest.fixture(scope="module")
def large_translation_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("large")
    mt_raw, _ = write_corpora(root / "raw", n_train=3000, n_eval=100, seed=1)
    preprocess_translation(mt_raw, root / "bin-mt")
    return root / "bin-mt"


def test_toy_translation_is_learned(large_translation_corpus, tmp_path):
    """A tiny DPFP + delta model learns the synthetic lexicon and reordering."""
    train_translation(large_translation_corpus, tmp_path, *fwp_flags("dpfp", "delta"), "--dropout", 0,
                      max_update=140, lr=0.006, warmup=40)
    score = bleu(generate(large_translation_corpus, tmp_path / "checkpoint_last.pt"))
    assert score >= 40, score  # chance is ~0 (random lexicon)
