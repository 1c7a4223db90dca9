"""Bad or degenerate input: clear errors at parse time, or results that stay well defined."""
import pytest
import torch

pytest.importorskip("fairseq")

from helpers import build_translation_model, parse_args, random_tokens  # noqa: E402
from fairseq_fwp.modules.attention_options import AttentionOptions  # noqa: E402
from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention  # noqa: E402
from fairseq_fwp.ops import fast_weight_delta, fast_weight_sum  # noqa: E402


@pytest.mark.parametrize("task, arch, flag, value, choices", [
    ("translation", "fwp_transformer_tiny", "--fwp-sum-norm", "maybe", "'on', 'off'"),
    ("translation", "fwp_transformer_tiny", "--fwp-output-scaling", "1", "'on', 'off'"),
    ("language_modeling", "fwp_lm_tiny", "--fwp-positions", "sinusoidal", "'on', 'off'"),
    ("fwp_stream_lm", "fwp_lm_tiny", "--fwp-carry-over", "yes", "'on', 'off'"),
])
def test_more_bad_flag_values_fail_at_parse_time(capsys, task, arch, flag, value, choices):
    with pytest.raises(SystemExit):
        parse_args(task, arch, flag, value)
    assert f"argument {flag}: invalid choice: '{value}' (choose from {choices})" in capsys.readouterr().err


@pytest.mark.parametrize("rule", ["sum", "delta"])
@pytest.mark.parametrize("attn_norm", [True, False])
def test_all_padding_and_zero_length_inputs_are_well_defined(rule, attn_norm):
    attn = FastWeightAttention(AttentionOptions(16, 2, update_rule=rule, attention_normalization=attn_norm)).eval()
    x = torch.randn(5, 3, 16)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1] = True  # row 1 is all padding
    out, _ = attn(x, x, x, key_padding_mask=padding)
    assert torch.isfinite(out).all()
    empty, _ = attn(x[:0], x[:0], x[:0])
    assert empty.shape == (0, 3, 16)
    cross = FastWeightAttention(AttentionOptions(16, 2, causal=False, attention_normalization=attn_norm)).eval()
    out, _ = cross(x, x, x, key_padding_mask=padding)  # a source of nothing but padding
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, 1], cross.out_proj.bias.expand(5, 16))  # it read an empty memory


def test_a_source_of_only_padding_in_a_batch_translates_the_others_unchanged():
    model, d = build_translation_model("--fwp-feature-map", "dpfp")
    src = random_tokens(d, [4, 6])
    prev = random_tokens(d, [5, 5], left_pad=False)
    with torch.no_grad():
        alone = model(src[1:], src[1:].ne(d.pad()).sum(1), prev[1:])[0]
        src[0] = d.pad()
        batched = model(src, src.ne(d.pad()).sum(1), prev)[0]
    assert torch.isfinite(batched).all()
    torch.testing.assert_close(batched[1:], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", [fast_weight_sum, fast_weight_delta])
def test_nan_inputs_propagate_without_crashing(op):
    """A NaN reaches the outputs from its step on and the final state, and nothing raises; fairseq's
    trainer then stops with its own message ("gradients are Nan/Inf"). The chunked delta rule solves
    each chunk as one triangular system, so a NaN also reaches earlier steps of its own chunk."""
    q, k, v = (torch.rand(1, 1, 70, 4) for _ in range(3))
    k[0, 0, 3, 1] = float("nan")
    args = (q, k, v) if op is fast_weight_sum else (q, k, v, torch.rand(1, 1, 70))
    out, W = op(*args)
    assert torch.isnan(out[0, 0, 3:]).all() and torch.isnan(W).any()
