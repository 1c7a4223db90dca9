"""Attention transfer (fairseq_fwp/uptraining/attention_transfer.py): fast-weight attentions trained on softmax ones."""
import pytest
import torch

pytest.importorskip("fairseq")

from helpers import build_lm_model, build_translation_model, random_tokens  # noqa: E402
from fairseq_fwp.uptraining.attention_transfer import AttentionTransfer, query_padding, relative_error  # noqa: E402
from fairseq_fwp.uptraining.conversion import transfer  # noqa: E402

DPFP_DELTA = ["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "2", "--fwp-update-rule", "delta"]


def converted_pair(build, *flags):
    """A softmax model and a fast-weight model holding its shared parameters, as conversion.convert makes them."""
    teacher, d = build("--fwp-feature-map", "softmax", seed=0)
    student, _ = build(*flags, seed=1)
    state, _ = transfer(teacher.state_dict(), student.state_dict())
    student.load_state_dict(state)
    return teacher, student, d


def test_relative_error_leaves_out_padded_queries():
    teacher = torch.ones(3, 2, 4)
    student = teacher.clone()
    student[2, 1] = 10.0  # a padded query of the second sentence: not counted
    keep = torch.ones(3, 2, 1)
    keep[2, 1] = 0
    assert relative_error(student, teacher, keep).item() == 0.0
    student[0, 0] = 3.0  # an error of 2 in 4 channels of one of 5 kept positions: 16 / 20
    assert relative_error(student, teacher, keep).item() == pytest.approx(0.8)


def test_query_padding_follows_the_stack():
    src = torch.tensor([[1, 5, 6], [7, 8, 9]])  # padding index 1, left-padded source
    prev = torch.tensor([[2, 5, 1], [2, 8, 9]])  # right-padded target
    net_input = {"src_tokens": src, "prev_output_tokens": prev}
    assert query_padding("encoder.layers.0.self_attn", net_input, 1)[:, :, 0].t().tolist() == [[0, 1, 1], [1, 1, 1]]
    assert query_padding("decoder.layers.1.encoder_attn", net_input, 1)[:, :, 0].t().tolist() == [[1, 1, 0], [1, 1, 1]]
    assert query_padding("decoder.layers.0.self_attn", {"src_tokens": prev}, 1)[:, :, 0].t().tolist() == \
        [[1, 1, 0], [1, 1, 1]]


def attention_parameters(model):
    return {name for name, _ in model.named_parameters() if "_attn." in name}


@pytest.mark.parametrize("build,flags", [(build_translation_model, DPFP_DELTA),
                                         (build_lm_model, ["--fwp-positions", "on", "--decoder-learned-pos"])])
def test_every_replaced_attention_learns_and_nothing_else_moves(build, flags):
    teacher, student, d = converted_pair(build, *flags)
    teacher_before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student_before = {k: v.clone() for k, v in student.state_dict().items()}
    tokens = random_tokens(d, [9, 7, 5, 9], seed=3)
    if build is build_translation_model:
        net_input = {"src_tokens": tokens, "src_lengths": tokens.ne(d.pad()).sum(1),
                     "prev_output_tokens": random_tokens(d, [6, 8, 4, 8], seed=4, left_pad=False)}
        expected = {f"{stack}.layers.{i}.{site}" for i in range(2)
                    for stack, site in (("encoder", "self_attn"), ("decoder", "self_attn"), ("decoder", "encoder_attn"))}
    else:
        net_input = {"src_tokens": random_tokens(d, [9, 7, 5, 9], seed=3, left_pad=False)}
        expected = {f"decoder.layers.{i}.self_attn" for i in range(2)}
    transfer_ = AttentionTransfer(teacher, student, d.pad(), lr=3e-3)
    assert {name for name, _, _ in transfer_.pairs} == expected
    first, last = transfer_.run(iter([{"net_input": net_input}] * 40), steps=40, log_interval=5)
    assert set(first) == expected
    for name in expected:  # every layer's error falls on the batch it trains on
        assert last[name] < 0.5 * first[name], (name, first[name], last[name])
    after = student.state_dict()
    moved = {name for name in after if not torch.equal(after[name], student_before[name])}
    assert moved and moved <= attention_parameters(student) | {n for n in after if "feature_map" in n}
    assert all(torch.equal(v, teacher_before[k]) for k, v in teacher.state_dict().items())


def test_a_model_without_replaced_attention_is_refused():
    teacher, _ = build_lm_model("--fwp-feature-map", "softmax")
    with pytest.raises(ValueError, match="no fast-weight attention in place of a softmax one"):
        AttentionTransfer(teacher, teacher, 1)


def test_a_student_that_carries_its_state_is_refused():
    teacher, student, d = converted_pair(build_lm_model, "--fwp-positions", "on", "--decoder-learned-pos")
    student.decoder.layers[1].self_attn.enable_carry_over()
    with pytest.raises(ValueError, match="decoder.layers.1.self_attn carries its state across them"):
        AttentionTransfer(teacher, student, d.pad())
