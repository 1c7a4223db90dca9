"""fairseq-eval-lm --tokens-per-sample L --context-window L-1 is the paper's Table 2 protocol.

The protocol, computed directly: a window of L tokens slides with stride 1;
the first window scores all its tokens, every later window only its last.
"""
import math
import re

import pytest
import torch

pytest.importorskip("fairseq")

from fairseq import checkpoint_utils  # noqa: E402
from fairseq_fwp.tasks.stream_lm import TokenStream  # noqa: E402
from examples.recipes.pipeline import eval_lm, train_lm  # noqa: E402

L = 12  # window (= training segment) length


def sliding_window_log_prob(model, tokens, eos):
    """Sum of log p(x_t | window) over the stream, and the number of tokens scored.

    Inputs are the tokens shifted right behind </s> (fairseq's LM convention).
    """
    inputs = torch.cat([torch.tensor([eos]), tokens[:-1]])
    total = 0.0

    def log_probs(window):
        return model.get_normalized_probs(model(window.unsqueeze(0)), log_probs=True)[0]

    with torch.no_grad():
        first = log_probs(inputs[:L])  # the first window scores every position
        total += first.gather(-1, tokens[:L, None]).sum().item()
        for t in range(L, len(tokens)):  # each later window scores its last token
            total += log_probs(inputs[t - L + 1: t + 1])[-1, tokens[t]].item()
    return total, len(tokens)


@pytest.mark.slow
@pytest.mark.parametrize("feature_map", ["softmax", "dpfp"])
def test_eval_lm_context_window_is_the_paper_protocol(corpora, tmp_path, feature_map):
    (tmp_path / "bin").symlink_to(corpora["lm"])
    flags = ["--fwp-feature-map", feature_map] + (["--fwp-positions", "on"] if feature_map == "softmax" else [])
    train_lm(tmp_path / "bin", tmp_path / "ckpt", *flags, max_update=5, tokens_per_sample=L)
    checkpoint = tmp_path / "ckpt" / "checkpoint_last.pt"
    out = eval_lm(tmp_path / "bin", checkpoint, "--context-window", L - 1, tokens_per_sample=L, batch_size=3)
    fairseq_loss = float(re.search(r"Loss \(base 2\): ([0-9.]+)", out).group(1))
    fairseq_count = int(re.search(r"Evaluated ([0-9,]+) tokens", out).group(1).replace(",", ""))

    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(tmp_path / "bin")})
    tokens = TokenStream(str(tmp_path / "bin" / "test"), task.dictionary).tokens
    log_prob, count = sliding_window_log_prob(model.eval(), tokens, task.dictionary.eos())
    assert fairseq_count == count
    assert abs(-log_prob / count / math.log(2) - fairseq_loss) < 2e-4
