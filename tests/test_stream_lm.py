"""Task fwp_stream_lm: streams, every token scored once, fast weights carried across segments (Table 4)."""
import re

import pytest
import torch

pytest.importorskip("fairseq")

from fairseq_models import build_lm_model, random_tokens, toy_dictionary  # noqa: E402
from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention  # noqa: E402
from fairseq_fwp.synthetic_data import write_corpora  # noqa: E402
from fairseq_fwp.tasks.stream_lm import StreamSegments  # noqa: E402
from pipeline import eval_lm, preprocess_lm, train_lm  # noqa: E402


@pytest.mark.parametrize("n_tokens, streams, segment", [(23, 1, 5), (23, 3, 4), (24, 4, 6), (7, 7, 2)])
def test_every_token_is_a_target_exactly_once(n_tokens, streams, segment):
    d = toy_dictionary()
    tokens = torch.randint(d.nspecial, len(d), (n_tokens,))
    data = StreamSegments(tokens, d, streams, segment)
    batches = [data.collater([i]) for i in range(len(data))]
    targets = torch.cat([b["target"] for b in batches], dim=1)   # [streams, stream length]
    inputs = torch.cat([b["net_input"]["src_tokens"] for b in batches], dim=1)
    assert torch.equal(targets[targets.ne(d.pad())], tokens)  # stream after stream, in order, once
    assert sum(b["ntokens"] for b in batches) == n_tokens
    assert (inputs[:, 0] == d.eos()).all()  # each stream's first token is predicted from </s>
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # inputs are the targets shifted right
    assert all(b["net_input"]["src_tokens"].shape[1] <= segment for b in batches)


def fast_weight_layers(model):
    return [m for m in model.modules() if isinstance(m, FastWeightAttention)]


@pytest.mark.parametrize("flags", [[], ["--fwp-update-rule", "sum", "--fwp-attn-norm", "on"],
                                   ["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "2"]])
def test_carried_segments_equal_one_long_forward(flags):
    model, d = build_lm_model(*flags)
    tokens = random_tokens(d, [17, 17], left_pad=False)
    with torch.no_grad():
        whole, _ = model(tokens)
        for layer in fast_weight_layers(model):
            layer.enable_carry_over()
        pieces = [model(tokens[:, a:b])[0] for a, b in ((0, 6), (6, 7), (7, 17))]
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=1e-5, atol=1e-5)


def test_carried_state_is_detached_and_kept_apart_for_training_and_evaluation():
    model, d = build_lm_model()
    layers = fast_weight_layers(model)
    for layer in layers:
        layer.enable_carry_over()
    tokens = random_tokens(d, [8, 8], left_pad=False)
    model.train()
    model(tokens)[0].sum().backward()
    train_state = layers[0]._carried[True]["fast_weight"]
    assert train_state.grad_fn is None and not train_state.requires_grad
    model.eval()
    with torch.no_grad():
        model(tokens)
    layers[0].reset_carried_state(training=False)  # a new validation pass
    assert False not in layers[0]._carried and layers[0]._carried[True]["fast_weight"] is train_state
    with pytest.raises(RuntimeError, match="same streams"):
        model.train()(tokens[:1])


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    _, lm_raw = write_corpora(root / "raw", n_train=600, n_eval=60, seed=3)
    preprocess_lm(lm_raw, root / "bin")
    return root / "bin"


def evaluated_tokens(output):
    return int(re.search(r"Evaluated ([0-9,]+) tokens", output).group(1).replace(",", ""))


def test_stream_task_trains_resumes_and_scores_the_whole_split(lm_data, tmp_path):
    log = train_lm(lm_data, tmp_path, max_update=8, tokens_per_sample=16, task="fwp_stream_lm")
    assert "'fwp_carry_over': on" in log
    log = train_lm(lm_data, tmp_path, "--restore-file", tmp_path / "checkpoint_last.pt",
                   max_update=10, tokens_per_sample=16, task="fwp_stream_lm")
    assert re.search(r"Loaded checkpoint .*\(epoch \d+ @ 8 updates\)", log), log[-3000:]

    checkpoint = tmp_path / "checkpoint_last.pt"
    baseline = eval_lm(lm_data, checkpoint, tokens_per_sample=16)  # language_modeling's blocks
    perplexity = {}
    for batch_size in (1, 3):
        for carry in ("on", "off"):
            out = eval_lm(lm_data, checkpoint, "--task", "fwp_stream_lm", "--fwp-carry-over", carry,
                          tokens_per_sample=16, batch_size=batch_size)
            assert evaluated_tokens(out) == evaluated_tokens(baseline)  # every token, once
            perplexity[batch_size, carry] = float(re.search(r"Perplexity: ([0-9.]+)", out).group(1))
    assert perplexity[1, "on"] != perplexity[1, "off"]  # the carried state is used
