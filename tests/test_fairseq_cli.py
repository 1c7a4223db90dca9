"""End to end through the real fairseq commands: preprocess, train, resume, generate, eval-lm."""
import re

import pytest

pytest.importorskip("fairseq")

from fairseq_fwp.synthetic_data import write_corpora  # noqa: E402
from pipeline import (  # noqa: E402
    bleu, eval_lm, generate, perplexity, preprocess_lm, preprocess_translation, train_lm, train_translation,
)

N_TEST = 203  # not a multiple of 8: the fork used to drop the last batch
COMBOS = [(fm, rule) for fm in ("linear", "performer", "dpfp") for rule in ("sum", "delta")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    mt_raw, lm_raw = write_corpora(root / "raw", n_train=3000, n_eval=N_TEST, seed=1)
    preprocess_translation(mt_raw, root / "bin-mt")
    preprocess_lm(lm_raw, root / "bin-lm")
    return root


def fwp_flags(fm, rule):
    return ["--fwp-feature-map", fm, "--fwp-update-rule", rule]


@pytest.mark.parametrize("fm, rule", COMBOS)
def test_translation_train_resume_generate(data, tmp_path, fm, rule):
    log = train_translation(data / "bin-mt", tmp_path, *fwp_flags(fm, rule), max_update=4)
    assert "FastWeightAttention" in log and f"update_rule={rule}" in log
    log = train_translation(data / "bin-mt", tmp_path, *fwp_flags(fm, rule),
                            "--restore-file", tmp_path / "checkpoint_last.pt", max_update=6)
    assert re.search(r"Loaded checkpoint .*\(epoch \d+ @ 4 updates\)", log), log[-3000:]
    assert "num_updates=6" in log

    # after 6 updates a model may repeat tokens up to fairseq's default 200: cap the length, not the test
    out = generate(data / "bin-mt", tmp_path / "checkpoint_last.pt", "--max-len-a", 1.5, "--max-len-b", 5)
    hypotheses = {int(m) for m in re.findall(r"^H-(\d+)\t", out, flags=re.M)}
    assert hypotheses == set(range(N_TEST))  # every test sentence, exactly once
    bleu(out)


@pytest.mark.parametrize("fm, rule", COMBOS)
def test_lm_train_resume_eval(data, tmp_path, fm, rule):
    log = train_lm(data / "bin-lm", tmp_path, *fwp_flags(fm, rule), max_update=4)
    assert f"update_rule={rule}" in log
    log = train_lm(data / "bin-lm", tmp_path, *fwp_flags(fm, rule), "--restore-file",
                   tmp_path / "checkpoint_last.pt", max_update=6)
    assert re.search(r"Loaded checkpoint .*\(epoch \d+ @ 4 updates\)", log), log[-3000:]

    counts = []
    for extra in ([], ["--context-window", 32]):
        out = eval_lm(data / "bin-lm", tmp_path / "checkpoint_last.pt", *extra)
        assert perplexity(out) > 1
        counts.append(re.search(r"Evaluated ([0-9,]+) tokens", out).group(1))
    assert counts[0] == counts[1]  # the sliding window scores every token once too


def test_toy_translation_is_learned(data, tmp_path):
    """A tiny DPFP + delta model learns the synthetic lexicon and reordering."""
    train_translation(data / "bin-mt", tmp_path, *fwp_flags("dpfp", "delta"), "--dropout", 0,
                      max_update=250, lr=0.003, warmup=100)
    score = bleu(generate(data / "bin-mt", tmp_path / "checkpoint_last.pt"))
    assert score >= 40, score  # chance is ~0 (random lexicon)
