"""FastWeightAttention inside real fairseq models (in-process, no CLI)."""
import contextlib
import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("fairseq")

from conditioning import SmallestNormaliser  # noqa: E402
from cuda_stand_in import on_gpu_and_stand_in  # noqa: E402
from helpers import build_translation_model, random_tokens  # noqa: E402
from fairseq_fwp.modules.attention_options import AttentionOptions  # noqa: E402
from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention  # noqa: E402
from fairseq_fwp.modules.state import buffer_tensors  # noqa: E402

VARIANTS = [
    (fm, rule, attn_norm)
    for fm in ("linear", "performer", "dpfp")
    for rule in ("sum", "delta")
    for attn_norm in ("on", "off")
]


def flags(fm, rule, attn_norm):
    return ["--fwp-feature-map", fm, "--fwp-update-rule", rule, "--fwp-attn-norm", attn_norm]


def decoder_inputs(d, B=3, T=7, seed=1):
    prev = random_tokens(d, [T] * B, seed=seed)
    prev[:, 0] = d.eos()
    return prev


def full_and_stepwise_decoder_outputs(model, d, device="cpu", decoder_length=None):
    """The decoder's output on a whole target prefix (of decoder_length tokens: 40 on CUDA, else 7), and the same
    built one token at a time."""
    src = random_tokens(d, [5, 9, 7]).to(device)
    src_lengths = src.ne(d.pad()).sum(1)
    prev = decoder_inputs(d, T=decoder_length or (40 if device == "cuda" else 7)).to(device)
    with torch.no_grad():
        full, _ = model(src, src_lengths, prev)
        encoder_out = model.encoder(src, src_lengths=src_lengths)
        state = {}
        steps = [model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)[0]
                 for t in range(prev.shape[1])]
    return full, torch.cat(steps, 1)


@pytest.mark.parametrize("rule", ["sum", "delta"])
def test_the_backend_flag_governs_decoding_too(rule, monkeypatch):
    """--fwp-backend reference: every decoding step is the reference backend's, and decodes what chunked does."""
    from fairseq_fwp.ops import backends

    steps = []
    kernel = backends.REFERENCE_KERNEL
    monkeypatch.setattr(backends, "REFERENCE_KERNEL", dataclasses.replace(
        kernel, step_=lambda *args: steps.append(1) or kernel.step_(*args)))
    chunked = full_and_stepwise_decoder_outputs(*build_translation_model(*flags("dpfp", rule, "on")))[1]
    assert not steps
    full, by_reference = full_and_stepwise_decoder_outputs(
        *build_translation_model(*flags("dpfp", rule, "on"), "--fwp-backend", "reference"))
    assert len(steps) == 2 * 7  # two decoder layers, seven steps
    torch.testing.assert_close(by_reference, chunked, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_reference, full, rtol=1e-5, atol=1e-5)


def test_auto_logs_each_choice_once_per_model_with_its_reason(caplog):
    model, d = build_translation_model(*flags("linear", "delta", "off"))
    with caplog.at_level("INFO", logger="fairseq_fwp.backend"):
        for _ in range(2):
            full_and_stepwise_decoder_outputs(model, d)
    lines = [r.getMessage() for r in caplog.records if r.name == "fairseq_fwp.backend"]
    assert lines == ["--fwp-backend auto runs chunked (auto on cpu torch.float32, D = 16, rule delta; not fla: "
                     "cpu tensors)",
                     "--fwp-decoding-step auto fuses each decoding step of delta (csrc/fast_weight_step.h)",
                     "--fwp-decoding-step auto fuses each decoding read of the source memory (csrc/fast_weight_step.h)"]


def relative_error(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@on_gpu_and_stand_in("rule, dtype", [(r, d) for r in ("sum", "delta") for d in (torch.float32, torch.bfloat16)],
                     [("delta", torch.bfloat16), ("sum", torch.float32)])
def test_gpu_decoding_equals_full_forward(gpu, rule, dtype):
    """On a GPU with backend auto (fla): the full forward takes the chunk kernels in bfloat16, every decoding
    step the recurrent one; each equals the other, and each the same model's full forward in float64 on the CPU,
    within 4 times the error of that model in the GPU's dtype on the CPU (the reference backend's: float32 keeps
    about 1e-6 of it; bfloat16's weights alone about 1e-2): an error that both make alike is no less an error."""
    model, d = build_translation_model(*flags("dpfp", rule, "off"))
    exact = full_and_stepwise_decoder_outputs(copy.deepcopy(model).double(), d, decoder_length=40)[0]
    rounded = copy.deepcopy(model).to(dtype)
    for layer in rounded.modules():
        if isinstance(layer, FastWeightAttention):
            layer.options = dataclasses.replace(layer.options, backend="reference")
    bound = 4 * relative_error(full_and_stepwise_decoder_outputs(rounded, d, decoder_length=40)[0], exact) + 1e-6
    full, steps = full_and_stepwise_decoder_outputs(model.to("cuda", dtype), d, "cuda")
    assert relative_error(steps, full) < (1e-4 if dtype == torch.float32 else 3e-2)
    assert relative_error(full.cpu(), exact) < bound and relative_error(steps.cpu(), exact) < bound, bound


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_decoder_state_grows_to_at_most_the_fast_weights_and_then_stays(backend):
    """A hypothesis's self-attention memory is held as its factors while they are smaller than W (10 tokens
    here: D = 32, Dv = 16), then as W, with the rule's own step (reference) and with the fused step (auto):
    no token costs more than with W, and the state stops growing."""
    model, d = build_translation_model(*flags("dpfp", "delta", "on"), "--fwp-backend", backend)
    src = random_tokens(d, [6, 6])
    prev = decoder_inputs(d, B=2, T=24)
    encoder_out = model.encoder(src, src_lengths=src.ne(d.pad()).sum(1))
    state, sizes = {}, []
    with torch.no_grad():
        for t in range(prev.shape[1]):
            model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
            sizes.append(sum(x.numel() for buf in state.values() for x in buffer_tensors(buf)))
    assert sizes[0] < sizes[9] <= sizes[10] and len(set(sizes[10:])) == 1, sizes


def test_right_padded_decoder_inputs_do_not_leak():
    """Padding in the decoder input (fairseq pads targets right) never changes earlier positions."""
    model, d = build_translation_model(*flags("linear", "delta", "on"))
    src = random_tokens(d, [5, 5])
    prev = decoder_inputs(d, B=2, T=6)
    padded = prev.clone()
    padded[0, 4:] = d.pad()
    with torch.no_grad():
        want, _ = model(src, src.ne(d.pad()).sum(1), prev)
        got, _ = model(src, src.ne(d.pad()).sum(1), padded)
    torch.testing.assert_close(got[0, :4], want[0, :4], rtol=1e-5, atol=1e-5)


def test_beam_reorder_moves_the_state():
    model, d = build_translation_model(*flags("dpfp", "delta", "off"))
    src = random_tokens(d, [5, 7, 6])
    prev = decoder_inputs(d, B=3, T=6)
    order = torch.tensor([2, 0, 0])
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=src.ne(d.pad()).sum(1))
        state = {}
        for t in range(3):
            model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)
        model.decoder.reorder_incremental_state_scripting(state, order)
        enc = model.encoder.reorder_encoder_out(enc, order)
        got = model.decoder(prev[order, :4], encoder_out=enc, incremental_state=state)[0]
        want, _ = model(src[order], src[order].ne(d.pad()).sum(1), prev[order, :4])
    torch.testing.assert_close(got[:, 0], want[:, 3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", ["fused", "own"])
def test_a_reorder_that_splits_the_beams_of_a_source_gives_each_row_its_source(fused):
    """The beams of one source read one memory (state.py: rows_per_memory); a reorder after which the rows no
    longer come in groups of one source (fairseq's beam search makes none, another search may) gives each row the
    memory of its own source, with the fused read and the rule's own."""
    model, d = build_translation_model(*flags("linear", "delta", "on"), "--fwp-decoding-step", fused)
    src = random_tokens(d, [5, 7]).repeat_interleave(2, 0)  # two sources, two beams each: rows 0, 1 read source 0
    prev = decoder_inputs(d, B=4, T=4)
    order = torch.tensor([1, 2, 0, 3])  # the pairs of rows now read sources 0, 1 and 0, 1
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=src.ne(d.pad()).sum(1))
        state = {}
        for t in range(2):
            model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)
        model.decoder.reorder_incremental_state_scripting(state, order)
        enc = model.encoder.reorder_encoder_out(enc, order)
        got = model.decoder(prev[order, :3], encoder_out=enc, incremental_state=state)[0]
        want, _ = model(src[order], src[order].ne(d.pad()).sum(1), prev[order, :3])
    torch.testing.assert_close(got[:, 0], want[:, 2], rtol=1e-5, atol=1e-5)


def test_every_attention_site_is_replaced_and_softmax_is_the_baseline():
    model, _ = build_translation_model(*flags("dpfp", "delta", "on"))
    attns = [m for m in model.modules() if isinstance(m, FastWeightAttention)]
    assert len(attns) == 2 + 2 * 2  # encoder self, decoder self and cross
    assert sum(a.options.update_rule == "delta" for a in attns) == 2  # decoder self-attention only
    baseline, _ = build_translation_model("--fwp-feature-map", "softmax")
    assert not any(isinstance(m, FastWeightAttention) for m in baseline.modules())
    self_only, _ = build_translation_model("--fwp-sites", "decoder-self")
    assert sum(isinstance(m, FastWeightAttention) for m in self_only.modules()) == 2


def test_performer_redraws_once_per_training_forward_of_the_model_and_is_fixed_in_eval():
    model, d = build_translation_model(*flags("performer", "sum", "on"))
    src = random_tokens(d, [5, 7])
    prev = decoder_inputs(d, B=2, T=5)
    layers = [m for m in model.modules() if isinstance(m, FastWeightAttention)]
    model.train()
    outputs = []
    for _ in range(2):
        torch.manual_seed(0)  # same dropout: only the features differ
        outputs.append(model(src, src.ne(d.pad()).sum(1), prev)[0])
    assert not torch.allclose(*outputs)
    assert all(int(layer.feature_map.num_steps) == 2 and int(layer.feature_map.num_draws) == 2 for layer in layers)
    # a layer called on its own (as --checkpoint-activations recomputes it) draws nothing
    x = torch.randn(5, 2, 64)
    torch.testing.assert_close(layers[0](x, x, x)[0], layers[0](x, x, x)[0])
    model.eval()
    with torch.no_grad():
        first, second = (model(src, src.ne(d.pad()).sum(1), prev)[0] for _ in range(2))
    torch.testing.assert_close(first, second)


def test_attention_returns_no_weights_and_checks_arguments():
    attn = FastWeightAttention(AttentionOptions(16, 4, update_rule="delta"))
    x = torch.randn(3, 2, 16)
    out, weights = attn(x, x, x, need_weights=True)
    assert out.shape == x.shape and weights is None
    with pytest.raises(ValueError, match="divisible"):
        FastWeightAttention(AttentionOptions(10, 4))
    with pytest.raises(ValueError, match="update_rule"):
        FastWeightAttention(AttentionOptions(16, 4, update_rule="oja"))
    with pytest.raises(ValueError, match="causal"):
        FastWeightAttention(AttentionOptions(16, 4, update_rule="delta", causal=False))


@pytest.mark.parametrize("fm, rule, attn_norm", VARIANTS)
def test_autocast_runs_every_variant_in_its_dtype(fm, rule, attn_norm):
    """Under autocast the features can be float32 (sum normalisation reduces in float32)
    while the values are bfloat16: the layer runs, in the autocast dtype, close to float32."""
    torch.manual_seed(0)
    attn = FastWeightAttention(AttentionOptions(32, 4, feature_map=fm, update_rule=rule,
                               attention_normalization=attn_norm == "on")).eval()
    x = torch.randn(9, 2, 32, requires_grad=True)
    want, _ = attn(x, x, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = attn(x, x, x)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).abs().max() / want.abs().max()).item() < 0.1
    got.float().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def paper_attention_normalised_delta(phi_q, phi_k, v, beta):
    """Eqs. 24, 26-28 as the paper writes them, one step at a time, for one head:
    z_i = z_{i-1} + phi(k_i); vbar_i = W_{i-1} phi(k_i) / (z_{i-1} . phi(k_i)), vbar_1 = 0;
    W_i = W_{i-1} + beta_i (v_i - vbar_i) phi(k_i)^T; y_i = W_i phi(q_i) / (z_i . phi(q_i))."""
    W = torch.zeros(v.shape[-1], phi_k.shape[-1], dtype=v.dtype)
    z = torch.zeros(phi_k.shape[-1], dtype=v.dtype)
    outputs = []
    for i in range(len(v)):
        vbar = torch.zeros_like(v[i]) if i == 0 else W @ phi_k[i] / (z @ phi_k[i])
        W = W + beta[i] * torch.outer(v[i] - vbar, phi_k[i])
        z = z + phi_k[i]
        outputs.append(W @ phi_q[i] / (z @ phi_q[i]))
    return torch.stack(outputs)


@pytest.mark.parametrize("fm", ["linear", "performer"])  # positive features: no 0/0 in the formula
def test_delta_rule_attention_normalisation_is_the_papers_formula(fm):
    torch.manual_seed(0)
    attn = FastWeightAttention(AttentionOptions(12, 3, feature_map=fm, update_rule="delta", attention_normalization=True,
                               eps=0.0)).double()
    attn.out_proj.weight.data.copy_(torch.eye(12))  # read the attention output itself
    attn.out_proj.bias.data.zero_()
    x = torch.randn(10, 2, 12, dtype=torch.float64)  # T x B x C
    got = attn(x, x, x)[0].view(10, 2, 3, 4)
    heads = lambda y: y.view(10, 2, 3, -1)  # noqa: E731
    phi = lambda y: F.normalize(attn.feature_map(heads(y)), p=1, dim=-1)  # noqa: E731  Eq. 29
    phi_q, phi_k, v = phi(attn.q_proj(x)), phi(attn.k_proj(x)), heads(attn.v_proj(x))
    beta = torch.sigmoid(attn.beta_proj(x))  # Eq. 21: [T, B, H]
    for b in range(2):
        for h in range(3):
            want = paper_attention_normalised_delta(phi_q[:, b, h], phi_k[:, b, h], v[:, b, h], beta[:, b, h])
            torch.testing.assert_close(got[:, b, h], want, rtol=1e-10, atol=1e-10)


def lm_gradients_after_a_training_step(flags, backend, seed, T=34,
                                       while_the_reference_runs=contextlib.nullcontext):
    """The tiny LM's parameter gradients of a log-likelihood on two rows (the second padded from 3T/4), after one
    training step (Adam's first: lr sign(g)), with --fwp-backend `backend` in float32 and with the reference in
    float64 (inside the context `while_the_reference_runs()`): ({name: float32's}, {name: float64's})."""
    from helpers import build_lm_model

    model, d = build_lm_model(*flags, "--fwp-backend", backend, seed=seed)
    reference, _ = build_lm_model(*flags, "--fwp-backend", "reference", seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(d.nspecial, len(d), (2, T), generator=g)
    x[:, 0] = d.eos()
    x[1, T - T // 4:] = d.pad()
    y = torch.randint(d.nspecial, len(d), (2, T), generator=g)

    def gradients(m):
        m.train()
        m.zero_grad()
        log_p = m.get_normalized_probs(m(x), log_probs=True).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        (-(log_p * x.ne(d.pad())).sum() / x.ne(d.pad()).sum()).backward()
        return {n: p.grad.double() for n, p in m.named_parameters() if p.grad is not None}

    gradients(model)
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(1e-3 * p.grad.sign())
    reference.load_state_dict(model.state_dict())
    got = gradients(model)
    with while_the_reference_runs():
        return got, gradients(reference.double())


# (seed, tokens): odd and even lengths, inside the first chunk (32 tokens: D = 32) and past one or two borders;
# (15, 34) and (5, 34) were the test's single draws; (10, 34) and (4, 33) come nearest the bound (0.6 and 0.8 u / m)
DISJOINT_SUPPORT_DRAWS = [(15, 34), (5, 34), (10, 34), (4, 33), (7, 17), (2, 70)]


@pytest.mark.parametrize("rule", ["sum", "delta"])
@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_float32_gradients_where_dpfp_supports_are_disjoint(rule, backend):
    """DPFP's features of a query can share no support with every key before it: z . phi(q) = 0 (Eqs. 19, 28),
    where the output is 0 and so is every exact gradient through it. Dividing by eps there sent 1 / eps
    gradients into the sum rule's chunked backward, whose rounding reached the other chunks (4e-3 of the
    largest gradient); the delta rule's d_t = z_{t-1} . phi(k_t) (Eq. 27) taken as (z_t - phi(k_t)) . phi(k_t)
    lost its small values to the cancellation (2e-2, on both backends). Both are now within the bound that
    float32 keeps near disjoint supports, 4 u / m of the largest gradient with m the smallest nonzero normaliser
    (tests/conditioning.py), on every draw."""
    flags = ["--fwp-feature-map", "dpfp", "--fwp-update-rule", rule, "--fwp-attn-norm", "on", "--fwp-output-gate", "on"]
    for seed, T in DISJOINT_SUPPORT_DRAWS:
        normaliser = SmallestNormaliser()
        got, want = lm_gradients_after_a_training_step(flags, backend, seed, T, normaliser.watching)
        largest = max(w.abs().max() for w in want.values())
        error = max((got[n] - want[n]).abs().max() / largest for n in want).item()
        assert error <= normaliser.float32_bound(), f"seed {seed}, {T} tokens: {error:.2g} of the largest gradient"


def attention_normalisation_by_site(model):
    """{decoder self-attention?: set of attention_normalization values} of a model's fast-weight layers."""
    found = {}
    for layer in (m for m in model.modules() if isinstance(m, FastWeightAttention)):
        found.setdefault(layer.causal, set()).add(layer.options.attention_normalization)
    return found


@pytest.mark.parametrize("extra, sites", [
    ([], {True: {True}, False: {True}}),  # sum rule: Table 1 everywhere
    (["--fwp-update-rule", "delta"], {True: {False}, False: {True}}),  # delta decoder: off (the paper's LM setting)
    (["--fwp-update-rule", "delta", "--fwp-attn-norm", "on"], {True: {True}, False: {True}}),
    (["--fwp-update-rule", "delta", "--fwp-decoder-attn-norm", "on"], {True: {True}, False: {True}}),
    (["--fwp-attn-norm", "off", "--fwp-decoder-attn-norm", "on"], {True: {True}, False: {False}}),
    (["--fwp-decoder-attn-norm", "off"], {True: {False}, False: {True}}),
])
def test_attention_normalisation_per_site(extra, sites):
    model, _ = build_translation_model(*extra)
    assert attention_normalisation_by_site(model) == sites


@pytest.mark.parametrize("extra, expected", [([], False), (["--fwp-attn-norm", "on"], True),
                                             (["--fwp-update-rule", "sum", "--fwp-attn-norm", "on"], True),
                                             (["--fwp-update-rule", "sum"], False)])
def test_language_model_attention_normalisation(extra, expected):
    from helpers import build_lm_model

    model, _ = build_lm_model(*extra)
    assert attention_normalisation_by_site(model) == {True: {expected}}


@pytest.mark.parametrize("fm, rule, attn_norm", [("softmax", "sum", "on")] + VARIANTS[::3])
def test_beam_search_scores_equal_a_full_forward_of_each_hypothesis(fm, rule, attn_norm):
    """fairseq's SequenceGenerator (beam 3, 14 steps: past the switch from factors to W) against a
    full forward of every hypothesis it returns: the same per-token log-probabilities."""
    from fairseq.sequence_generator import SequenceGenerator

    model, d = build_translation_model(*flags(fm, rule, attn_norm))
    src = random_tokens(d, [5, 9, 7, 6])
    sample = {"net_input": {"src_tokens": src, "src_lengths": src.ne(d.pad()).sum(1)}, "id": torch.arange(4)}
    generator = SequenceGenerator([model], d, beam_size=3, max_len_a=0, max_len_b=14, min_len=14)
    with torch.no_grad():
        hypotheses = generator.generate([model], sample)
        for i, sentence in enumerate(hypotheses):
            assert len(sentence) == 3
            for hypo in sentence:
                target = hypo["tokens"].unsqueeze(0)
                prev = torch.cat([target.new_full((1, 1), d.eos()), target[:, :-1]], 1)
                logits, _ = model(src[i: i + 1], sample["net_input"]["src_lengths"][i: i + 1], prev)
                lprobs = model.get_normalized_probs((logits, None), log_probs=True)[0]
                want = lprobs.gather(-1, target[0].unsqueeze(-1)).squeeze(-1)
                torch.testing.assert_close(hypo["positional_scores"], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("extra", [[], ["--fwp-update-rule", "sum", "--fwp-attn-norm", "on"],
                                   ["--fwp-update-rule", "gated-delta", "--fwp-short-conv", "3"]])
def test_language_model_decoding_with_left_padded_prompts_equals_full_forward(extra):
    """fairseq passes a padding mask for the decoded token when prompts are padded: padded steps
    neither write nor decay, in decoding as in the full forward."""
    from helpers import build_lm_model

    model, d = build_lm_model(*extra)
    tokens = random_tokens(d, [9, 6], left_pad=True)  # row 1 starts with 3 pads
    with torch.no_grad():
        full, _ = model(tokens)
        state, steps = {}, []
        for t in range(tokens.shape[1]):
            steps.append(model.decoder(tokens[:, : t + 1], incremental_state=state)[0][:, -1])
    real = tokens.ne(d.pad())
    torch.testing.assert_close(torch.stack(steps, 1)[real], full[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fm", ["linear", "performer", "dpfp"])
@pytest.mark.parametrize("rule", ["sum", "delta", "gated-sum", "gated-delta"])
@pytest.mark.parametrize("attn_norm", [True, False])
def test_under_autocast_decoding_equals_the_full_forward_within_bfloat16s_rounding(fm, rule, attn_norm):
    """The layer under bfloat16 autocast, token by token and over the whole sequence: the ops and the
    decoding step round alike, so the two differ by at most one rounding of bfloat16 (2^-7 of the
    largest output)."""
    if rule.startswith("gated") and attn_norm:
        pytest.skip("the gated rules take no attention normalisation")
    torch.manual_seed(0)
    attn = FastWeightAttention(AttentionOptions(32, 4, feature_map=fm, update_rule=rule, attention_normalization=attn_norm)).eval()
    x = torch.randn(20, 2, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full, _ = attn(x, x, x)
        state = {}
        steps = torch.cat([attn(x[t:t + 1], x[t:t + 1], x[t:t + 1], incremental_state=state)[0] for t in range(20)])
    assert steps.dtype == full.dtype == torch.bfloat16
    assert (steps.float() - full.float()).abs().max() <= 2 ** -7 * full.float().abs().max()
