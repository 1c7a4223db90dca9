"""The layers beyond the paper: gated rules, L2-normalised SiLU features, short
convolutions, the output gate and hybrid stacks; each part against its formula, and every
combination inside real fairseq models (decoding, beam reorders, padding, carried segments)."""
import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("fairseq")

from fairseq.modules import MultiheadAttention  # noqa: E402
from helpers import build_lm_model, build_translation_model, random_tokens  # noqa: E402
from fairseq_fwp.modules.attention_options import AttentionOptions  # noqa: E402
from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention  # noqa: E402
from fairseq_fwp.modules.gates import DecayGate, OutputGate  # noqa: E402
from fairseq_fwp.modules.short_convolution import ShortConvolution  # noqa: E402

GATED_DELTA_NET = ["--fwp-update-rule", "gated-delta", "--fwp-feature-map", "silu", "--fwp-qk-norm", "l2",
                   "--fwp-short-conv", "4", "--fwp-output-gate", "on", "--fwp-attn-norm", "off"]
VARIANTS = {
    "gated-delta": ["--fwp-update-rule", "gated-delta"],
    "gated-sum-logsigmoid": ["--fwp-update-rule", "gated-sum", "--fwp-decay-form", "logsigmoid"],
    "silu-l2-delta": ["--fwp-update-rule", "delta", "--fwp-feature-map", "silu", "--fwp-qk-norm", "l2",
                      "--fwp-attn-norm", "off"],
    "short-conv-delta": ["--fwp-update-rule", "delta", "--fwp-short-conv", "3"],
    "output-gate": ["--fwp-output-gate", "on"],
    "hybrid": ["--fwp-update-rule", "delta", "--fwp-softmax-layers", "1"],
    "gated-deltanet": GATED_DELTA_NET,
    "negative-eigenvalues": ["--fwp-update-rule", "delta", "--fwp-negative-eigenvalues", "on", "--fwp-attn-norm", "off",
                             "--fwp-qk-norm", "l2"],
    "deltaproduct-2": ["--fwp-update-rule", "delta", "--fwp-householder-steps", "2", "--fwp-negative-eigenvalues",
                       "on", "--fwp-attn-norm", "off", "--fwp-short-conv", "3", "--fwp-qk-norm", "l2"],
    "gated-deltaproduct-3": GATED_DELTA_NET + ["--fwp-householder-steps", "3", "--fwp-negative-eigenvalues", "on"],
}


def test_short_convolution_is_a_causal_depthwise_convolution_and_continues_from_its_cache():
    conv = ShortConvolution(5, 3).double()
    x = torch.randn(9, 2, 5, dtype=torch.float64)  # T x B x C
    y, cache = conv(x)
    w, b = conv.weight[:, 0], conv.bias
    for t in range(9):  # y_t = b + sum_i w_i x_{t - (K-1) + i}, zeros before the start
        want = b + sum(w[:, i] * x[t - 2 + i] for i in range(3) if t - 2 + i >= 0)
        torch.testing.assert_close(y[t], want)
    torch.testing.assert_close(cache, x[-2:].permute(1, 2, 0))
    first, cache = conv(x[:4])
    second, _ = conv(x[4:], cache)
    torch.testing.assert_close(torch.cat([first, second]), y)


@pytest.mark.parametrize("form", ["mamba2", "logsigmoid"])
def test_decays_start_close_to_one_and_stay_in_range(form):
    torch.manual_seed(0)
    gate = DecayGate(32, 4, form)
    a = gate(torch.randn(50, 3, 32)).exp()
    assert a.shape == (3, 4, 50) and bool((a > 0).all() and (a <= 1).all())
    assert a.mean() > 0.8  # at initialisation the layer is almost the ungated rule
    if form == "mamba2":  # log a = -exp(A_log) softplus(w.x + dt_bias)
        x = torch.randn(1, 1, 32)
        want = -gate.A_log.exp() * F.softplus(gate.proj(x)[0, 0] + gate.dt_bias)
        torch.testing.assert_close(gate(x)[0, :, 0], want)


def test_output_gate_is_rms_norm_times_silu_gate():
    torch.manual_seed(0)
    gate = OutputGate(8, 2)
    out, x = torch.randn(3, 2, 5, 4), torch.randn(5, 3, 8)
    g = F.silu(gate.gate(x)).view(5, 3, 2, 4).permute(1, 2, 0, 3)
    want = out / torch.sqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6) * gate.weight * g
    torch.testing.assert_close(gate(out, x), want)


def test_the_layer_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="silu.* these features are signed"):
        FastWeightAttention(AttentionOptions(16, 2, feature_map="silu", qk_norm="sum"))
    with pytest.raises(ValueError, match="gated rules"):
        FastWeightAttention(AttentionOptions(16, 2, update_rule="gated-delta", attention_normalization=True))
    with pytest.raises(ValueError, match="causal"):
        FastWeightAttention(AttentionOptions(16, 2, causal=False, short_conv=4))
    with pytest.raises(ValueError, match="normalised keys"):
        FastWeightAttention(AttentionOptions(16, 2, update_rule="gated-delta", qk_norm="none"))


def test_hybrid_stacks_keep_the_chosen_layers_softmax():
    model, _ = build_translation_model("--fwp-softmax-layers", "1")
    for stack in (model.encoder.layers, model.decoder.layers):
        assert isinstance(stack[0].self_attn, FastWeightAttention)
        assert isinstance(stack[1].self_attn, MultiheadAttention)
    assert isinstance(model.decoder.layers[1].encoder_attn, MultiheadAttention)


def decoder_inputs(d, B, T, seed):
    prev = random_tokens(d, [T] * B, seed=seed, left_pad=False)
    prev[:, 0] = d.eos()
    return prev


@pytest.mark.parametrize("name", VARIANTS)
def test_decoding_equals_full_forward_with_beam_reorders(name):
    model, d = build_translation_model(*VARIANTS[name])
    src = random_tokens(d, [5, 9]).repeat_interleave(2, 0)  # 2 sentences x 2 beams
    prev = decoder_inputs(d, 4, 14, seed=2)
    lengths = src.ne(d.pad()).sum(1)
    with torch.no_grad():
        full, _ = model(src, lengths, prev)
        enc, state, steps = model.encoder(src, src_lengths=lengths), {}, []
        for t in range(14):
            steps.append(model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)[0][:, -1])
        torch.testing.assert_close(torch.stack(steps, 1), full, rtol=1e-5, atol=1e-5)
        order = torch.tensor([1, 1, 3, 2])  # within each sentence, as beam search: every buffer moves
        model.decoder.reorder_incremental_state_scripting(state, order)
        enc = model.encoder.reorder_encoder_out(enc, order)
        prev = torch.cat([prev[order], decoder_inputs(d, 4, 3, seed=5)[:, 1:]], 1)
        got = [model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)[0][:, -1] for t in (14, 15)]
        want = model(src[order], lengths[order], prev)[0][:, 14:16]
    torch.testing.assert_close(torch.stack(got, 1), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gated-delta", "short-conv-delta", "gated-deltanet", "deltaproduct-2"])
def test_left_padding_changes_nothing(name):
    model, d = build_lm_model(*VARIANTS[name])
    tokens = random_tokens(d, [9], left_pad=False)
    padded = torch.cat([torch.full((1, 4), d.pad()), tokens], 1)
    with torch.no_grad():
        plain, _ = model(tokens)
        shifted, _ = model(padded)
    torch.testing.assert_close(shifted[:, 4:], plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gated-delta", "gated-sum-logsigmoid", "short-conv-delta", "gated-deltanet",
                                  "gated-deltaproduct-3"])
def test_carried_segments_equal_one_long_forward(name):
    model, d = build_lm_model(*VARIANTS[name])
    tokens = random_tokens(d, [17, 17], left_pad=False)
    layers = [m for m in model.modules() if isinstance(m, FastWeightAttention)]
    with torch.no_grad():
        whole, _ = model(tokens)
        for layer in layers:
            layer.enable_carry_over()
        pieces = []
        for position, (a, b) in enumerate(((0, 6), (6, 7), (7, 17))):
            for layer in layers:
                layer.start_segment(position, False)
            pieces.append(model(tokens[:, a:b])[0])
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=1e-5, atol=1e-5)


def test_gated_deltanet_layer_trains():
    model, d = build_lm_model(*GATED_DELTA_NET)
    model.train()
    tokens = random_tokens(d, [12, 12], left_pad=False)
    loss = -model.get_normalized_probs(model(tokens), log_probs=True).mean()
    loss.backward()
    unused = [n for n, p in model.named_parameters() if p.grad is None]
    assert not unused and math.isfinite(loss.item())


@pytest.mark.parametrize("rule", ["gated-sum", "gated-delta"])
def test_padded_positions_neither_write_nor_decay_a_carried_memory(rule):
    torch.manual_seed(0)
    attn = FastWeightAttention(AttentionOptions(16, 2, update_rule=rule)).eval()
    attn.enable_carry_over()
    first, second = torch.randn(5, 2, 16), torch.randn(4, 2, 16)
    pads = torch.zeros(2, 7, dtype=torch.bool)
    pads[:, :3] = True
    outputs = []
    for padded in (False, True):
        attn.start_segment(0, False)
        attn(first, first, first)
        attn.start_segment(1, False)
        x = torch.cat([torch.randn(3, 2, 16), second]) if padded else second
        out = attn(x, x, x, key_padding_mask=pads if padded else None)[0]
        outputs.append(out[-4:])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["mamba2", "logsigmoid"])
def test_training_where_the_gate_forgets_fully_stays_finite(form):
    """A gate pushed to log a < -104, where exp underflows to exactly 0 in float32: the layers pass log a
    to the ops, which take it as the full forget it is; the loss and every gradient stay finite."""
    model, d = build_lm_model(*GATED_DELTA_NET, "--fwp-decay-form", form)
    model.train()
    with torch.no_grad():
        for gate in (m.decay_gate for m in model.modules() if isinstance(m, FastWeightAttention)):
            if form == "mamba2":
                gate.A_log.fill_(math.log(16.0))
                gate.dt_bias.fill_(10.0)  # log a = -16 softplus(10 + w.x), about -160
            else:
                gate.proj.bias.fill_(-2000.0)  # log a = logsigmoid(-2000) / 16 = -125
            assert gate(torch.randn(5, 2, 64)).max() < -104
    tokens = random_tokens(d, [70, 70], left_pad=False)  # more than one chunk
    loss = -model.get_normalized_probs(model(tokens), log_probs=True).mean()
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("build, counts", [(build_translation_model, "2 encoder layers and 2 decoder layers"),
                                           (build_lm_model, "2 decoder layers")])
def test_softmax_layers_the_model_does_not_have_are_refused(build, counts):
    with pytest.raises(ValueError, match=rf"--fwp-softmax-layers 1,5: layer 5 does not exist \(the model has {counts}"):
        build("--fwp-softmax-layers", "1,5")


@pytest.mark.parametrize("form", ["mamba2", "logsigmoid"])
def test_started_as_ungated_the_gate_and_convolution_change_almost_nothing(form):
    """What uptraining relies on: a layer with a decay gate and short convolutions, started as ungated,
    computes what the same layer without them computes (the decay costs 1e-4 per step)."""
    torch.manual_seed(0)
    plain = FastWeightAttention(AttentionOptions(32, 2, update_rule="delta")).eval()
    gated = FastWeightAttention(AttentionOptions(32, 2, update_rule="gated-delta", decay_form=form, short_conv=4)).eval()
    gated.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randn(40, 3, 32)
    with torch.no_grad():
        want = plain(x, x, x)[0]
        changed = (gated(x, x, x)[0] - want).norm() / want.norm()
        gated.start_as_ungated()
        log_a = gated.decay_gate(x)
        got = gated(x, x, x)[0]
    assert changed > 0.05  # as initialised for training from scratch, the new parts change the layer
    torch.testing.assert_close(log_a, torch.full_like(log_a, -1e-4), rtol=1e-3, atol=0)
    assert (got - want).norm() / want.norm() < 3e-3  # 40 steps: writes are 20 steps old on average


def test_deltaproduct_layers_train_and_write_beta_in_0_2():
    """--fwp-householder-steps 3 --fwp-negative-eigenvalues on: three key, value and strength projections
    per token, every parameter gets a gradient, and beta lies in (0, 2)."""
    model, d = build_lm_model(*VARIANTS["gated-deltaproduct-3"])
    attention = model.decoder.layers[0].self_attn
    assert attention.options.update_rule == "gated-delta-product"
    assert attention.k_proj.out_features == attention.v_proj.out_features == 3 * 64
    assert attention.beta_proj.out_features == 3 * 4
    model.train()
    tokens = random_tokens(d, [12, 12], left_pad=False)
    loss = -model.get_normalized_probs(model(tokens), log_probs=True).mean()
    loss.backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None] and math.isfinite(loss.item())
    with torch.no_grad():
        attention.beta_proj.bias.fill_(20.0)
        beta, _ = attention._gates(torch.randn(5, 2, 64), None)
    assert beta.shape == (2, 4, 5, 3) and beta.max() > 1.99


@pytest.mark.parametrize("flags, message", [
    (["--fwp-update-rule", "sum", "--fwp-negative-eigenvalues", "on"],
     "--fwp-update-rule sum with --fwp-negative-eigenvalues on: negative eigenvalues are for rules whose writes"),
    (["--fwp-update-rule", "delta", "--fwp-negative-eigenvalues", "on", "--fwp-attn-norm", "on", "--fwp-qk-norm", "l2"],
     r"--fwp-negative-eigenvalues on with --fwp-attn-norm on .*: attention normalisation's retrieval \(Eqs. 26-28\)"),
    (["--fwp-update-rule", "gated-delta", "--fwp-negative-eigenvalues", "on", "--fwp-qk-norm", "sum"],
     r"--fwp-negative-eigenvalues on with --fwp-qk-norm sum: negative eigenvalues need unit keys \(l2\)"),
    (["--fwp-update-rule", "delta", "--fwp-negative-eigenvalues", "on", "--fwp-qk-norm", "l2",
      "--fwp-decoder-qk-norm", "sum", "--fwp-attn-norm", "off"],
     r"--fwp-negative-eigenvalues on with --fwp-decoder-qk-norm sum: negative eigenvalues need unit keys"),
    (["--fwp-update-rule", "gated-sum", "--fwp-householder-steps", "2"],
     "--fwp-update-rule gated-sum with --fwp-householder-steps 2: several writes per token are DeltaProduct's"),
    (["--fwp-update-rule", "delta", "--fwp-householder-steps", "2", "--fwp-attn-norm", "on"],
     "--fwp-householder-steps 2 with --fwp-attn-norm on .*: attention normalisation .* sums one key per token"),
])
def test_what_does_not_combine_with_negative_eigenvalues_or_deltaproduct_is_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        build_translation_model(*flags)


def test_negative_eigenvalues_are_eigenvalues_below_zero():
    """Unit keys (auto's choice where --fwp-qk-norm is none): a write's transition I - beta k k^T has the
    eigenvalue 1 - beta, below 0 wherever beta > 1."""
    model, _ = build_translation_model("--fwp-update-rule", "delta", "--fwp-negative-eigenvalues", "on",
                                       "--fwp-qk-norm", "none", "--fwp-attn-norm", "off")
    attention = model.decoder.layers[0].self_attn
    assert attention.options.qk_norm == "l2"
    with torch.no_grad():
        attention.beta_proj.bias.fill_(6.0)  # beta = 2 sigmoid(6 + ...) near 2
        x = torch.randn(6, 2, 64)
        beta, _ = attention._gates(x, None)
        k = attention._phi(attention.k_proj(x))
    smallest = 1 - beta * (k * k).sum(-1)
    assert (smallest < -0.5).all(), smallest


def test_negative_eigenvalues_double_gdn2s_erase_gate_only():
    """GDN-2's transition I - k (b * k)^T needs its erase gate b in (0, 2) for eigenvalues in [-1, 1]; its write
    gate w scales what is written and stays in (0, 1)."""
    attention = FastWeightAttention(AttentionOptions(32, 2, feature_map="silu", qk_norm="l2", update_rule="gdn2",
                                                     negative_eigenvalues=True))
    D = attention.feature_map.out_dim
    with torch.no_grad():
        attention.beta_proj.bias.fill_(5.0)
        beta, _ = attention._gates(torch.randn(6, 2, 32), None)
    erase, write = beta[..., :D], beta[..., D:]
    assert erase.max() > 1.9 and erase.max() < 2
    assert write.max() < 1 and write.min() > 0.9
