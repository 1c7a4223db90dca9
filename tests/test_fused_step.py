"""The fused decoding step (modules/fused_step.py, csrc/fast_weight_step.h) against each rule's own step, the
oracle (--fwp-backend reference keeps it): every built-in feature map with every built-in rule, at batch 1 and
in beams, with beam reorders, and the encoder-decoder attention's fused read; n-best lists of beam search
equal with and without it. The GPU's kernel (csrc/fast_weight_step_cuda.cu) runs the same source on a thread
block per (row, head): here, each phase's items must give the same bits in reverse order, as they must in any
order there; on a GPU (test_gpu_*), the kernel against the oracle on the GPU."""
import os
import types

import pytest
import torch

from fairseq_fwp.modules import fused_step as fused_step_module
from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention
from fairseq_fwp.modules.fused_step import FusedStep, loaded
from fairseq_fwp.ops import memory
from cuda_stand_in import on_gpu_and_stand_in
from helpers import ROOT, build_lm_model, build_translation_model, random_tokens
from test_attention import decoder_inputs, full_and_stepwise_decoder_outputs

pytestmark = pytest.mark.skipif(loaded() is None, reason="the csrc extension does not build here")

MAPS = [("linear", []), ("silu", ["--fwp-qk-norm", "l2"]), ("dpfp", ["--fwp-dpfp-nu", "2"]), ("performer", [])]
RULES = [("sum", []), ("gated-sum", []), ("delta", []), ("gated-delta", []), ("gla", []), ("kda", []), ("gdn2", []),
         ("delta", ["--fwp-householder-steps", "2", "--fwp-negative-eigenvalues", "on"]),
         ("gated-delta", ["--fwp-householder-steps", "2"]), ("kda", ["--fwp-householder-steps", "3"])]


def stepwise(model, d, rows, T=10, reorder_at=(0, 4), device="cpu"):
    """The LM decoded token by token for `rows` rows, the rows reordered as beam search would after the steps
    `reorder_at` (the first while the factors are held, the second once W is)."""
    tokens = torch.randint(d.nspecial, len(d), (rows, T), generator=torch.Generator().manual_seed(0)).to(device)
    order = torch.arange(rows, device=device).flip(0)
    with torch.no_grad():
        state, steps = {}, []
        for t in range(T):
            steps.append(model.decoder(tokens[:, :t + 1], incremental_state=state)[0][:, -1])
            if t in reorder_at:
                model.decoder.reorder_incremental_state_scripting(state, order)
                tokens = tokens[order]
    return torch.stack(steps, 1)


def fused_attentions(model):
    return [m for m in model.modules() if isinstance(m, FastWeightAttention) and m.fused_step is not None]


def flags_of(feature_map, map_flags, rule, rule_flags):
    flags = ["--fwp-feature-map", feature_map, *map_flags, "--fwp-update-rule", rule, *rule_flags]
    if "--fwp-negative-eigenvalues" in flags and "l2" not in flags:
        flags += ["--fwp-qk-norm", "l2"]
    if feature_map == "silu" or "--fwp-qk-norm" in flags:
        flags += ["--fwp-attn-norm", "off"]
    return flags


def fused_against_oracle(flags, rows, fused_calls, device="cpu"):
    fused, d = build_lm_model(*flags)
    oracle, _ = build_lm_model(*flags, "--fwp-backend", "reference")
    assert fused_attentions(fused) and not fused_attentions(oracle)
    torch.testing.assert_close(stepwise(fused.to(device), d, rows, device=device),
                               stepwise(oracle.to(device), d, rows, device=device), rtol=1e-5, atol=1e-5)
    counts = list(fused_calls.values())
    assert len(counts) == len(fused_attentions(fused))
    assert all(c == 10 for c in counts)


BEAMS_AND_BATCH_1 = [*[(m, mf, r, rf, 4) for m, mf in MAPS for r, rf in RULES],  # in beams
                     *[(*MAPS[0], r, rf, 1) for r, rf in RULES]]  # at batch 1


@on_gpu_and_stand_in("feature_map, map_flags, rule, rule_flags, rows", BEAMS_AND_BATCH_1,
                     [(*MAPS[2], *RULES[6], 4), (*MAPS[0], *RULES[7], 1)])  # DPFP, GDN-2, beams; DeltaProduct, 1 row
def test_gpu_every_builtin_map_and_rule_decodes_as_its_own_step(gpu, feature_map, map_flags, rule, rule_flags, rows,
                                                                 fused_calls):
    """The CUDA kernel (one thread block per (row, head)) against the rule's own step, both on the GPU."""
    assert loaded().has_cuda_kernels(), "the extension was built without its CUDA kernels"
    fused_against_oracle([*flags_of(feature_map, map_flags, rule, rule_flags), "--fwp-decoding-step", "fused"], rows,
                         fused_calls, device="cuda")  # fused in beams too


@pytest.fixture(scope="session")
def test_build():
    """The extension as the tests build it (csrc/fast_weight.cpp's FWP_TEST_ENTRY_POINTS: also each fused call
    with each phase's items in reverse order, SerialTeam in csrc/fast_weight_step.h), which the package's own
    build leaves out; once per machine and sources (torch's extension cache), about 25 s of one core at -O0 (the
    tests compare its calls in order with its calls reversed, never with the package's build)."""
    from torch.utils import cpp_extension
    from fairseq_fwp.ops.csrc_sources import source_files, sources_digest

    return cpp_extension.load(name=f"fairseq_fwp_kernels_test_{sources_digest()}", sources=source_files(False),
                              extra_cflags=["-O0", "-std=c++17", "-DFWP_TEST_ENTRY_POINTS"], verbose=False)


def use_build(monkeypatch, built, reversed_items):
    """The fused calls of `built`, each phase's items in order or reversed."""
    monkeypatch.setattr(fused_step_module, "loaded", lambda: types.SimpleNamespace(
        fused_step=built.fused_step_items_reversed if reversed_items else built.fused_step,
        fused_read=built.fused_read_items_reversed if reversed_items else built.fused_read,
        has_cuda_kernels=built.has_cuda_kernels))


def test_the_packages_build_has_no_test_entry_points():
    assert not hasattr(loaded(), "fused_step_items_reversed") and not hasattr(loaded(), "fused_read_items_reversed")


# every phase: no retrieval, retrieval under Eqs. 26-28, a decay per head and per channel, the erase gate,
# several writes per token
PHASE_RULES = [("sum", []), ("delta", ["--fwp-attn-norm", "on"]), ("gated-delta", []), ("kda", []), ("gdn2", []),
               ("delta", ["--fwp-householder-steps", "2"])]


@pytest.mark.slow  # the tests' own C++ build (test_build): about 25 s of one core on a fresh machine
@pytest.mark.parametrize("rule, rule_flags", PHASE_RULES)
@pytest.mark.parametrize("feature_map, map_flags", MAPS)
def test_each_phase_of_the_step_has_independent_items(feature_map, map_flags, rule, rule_flags, fused_calls,
                                                      test_build, monkeypatch):
    """Beams of 4 (factors, then W), every step fused, the same bits with each phase's items reversed."""
    model, d = build_lm_model(*flags_of(feature_map, map_flags, rule, rule_flags))
    use_build(monkeypatch, test_build, reversed_items=False)
    in_order = stepwise(model, d, 4)
    use_build(monkeypatch, test_build, reversed_items=True)
    assert torch.equal(stepwise(model, d, 4), in_order)
    assert set(fused_calls.values()) == {20}


@pytest.mark.slow  # the tests' own C++ build
@pytest.mark.parametrize("feature_map, flags", MAPS)
def test_each_phase_of_the_read_has_independent_items(feature_map, flags, fused_reads, test_build, monkeypatch):
    """Sources of 5 to 9 tokens: memories held as their factors."""
    model, d = build_translation_model("--fwp-feature-map", feature_map, *flags)
    use_build(monkeypatch, test_build, reversed_items=False)
    in_order = full_and_stepwise_decoder_outputs(model, d)[1]
    use_build(monkeypatch, test_build, reversed_items=True)
    assert torch.equal(full_and_stepwise_decoder_outputs(model, d)[1], in_order)
    assert len(fused_reads) == 2 * 2 * 6  # twice: two decoder layers, the steps after the first (which builds them)


@pytest.fixture
def fused_reads(monkeypatch):
    """[the attention of each fused read of a source memory]"""
    reads = []
    read = FusedStep.read
    monkeypatch.setattr(FusedStep, "read", lambda self, *args: reads.append(self) or read(self, *args))
    return reads


@pytest.fixture
def fused_calls(monkeypatch):
    """{attention's fused step: the steps it ran}; the factors give way to W after 3 written tokens."""
    monkeypatch.setattr(memory, "factored_length_limit", lambda D, Dv: 3)
    calls = {}
    call = FusedStep.__call__

    def counted(self, *args):
        calls[self] = calls.get(self, 0) + 1
        return call(self, *args)
    monkeypatch.setattr(FusedStep, "__call__", counted)
    return calls


@pytest.mark.parametrize("rule, options", [("delta", {}), ("gla", {}), ("kda", {}), ("gated-delta", {}),
                                           ("sum", {"attention_normalization": True}),
                                           ("delta", {"attention_normalization": True})])
@pytest.mark.parametrize("backend", ["chunked", "auto"])
def test_fused_steps_after_a_prompt_given_in_one_call(rule, options, backend, fused_calls):
    """A prompt given to the layer in one call (its memory as the sequence op returns it, W and z views of
    other tensors), then one token at a time: the same outputs as the rule's own steps and the full forward."""
    from fairseq_fwp.modules.attention_options import AttentionOptions

    fused = FastWeightAttention(AttentionOptions(32, 2, update_rule=rule, backend=backend, **options)).eval()
    oracle = FastWeightAttention(AttentionOptions(32, 2, update_rule=rule, backend="reference", **options)).eval()
    oracle.load_state_dict(fused.state_dict())
    x = torch.randn(9, 2, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = oracle(x, None, None)[0]
        for layer in (fused, oracle):
            state = {}
            prompt = layer(x[:5], None, None, incremental_state=state)[0]
            steps = torch.cat([layer(x[t:t + 1], None, None, incremental_state=state)[0] for t in range(5, 9)])
            torch.testing.assert_close(torch.cat([prompt, steps]), full, rtol=1e-5, atol=1e-5)
    assert fused_calls == {fused.fused_step: 4}


@pytest.mark.parametrize("flags", [["--fwp-update-rule", "sum", "--fwp-attn-norm", "on"],
                                   ["--fwp-update-rule", "delta", "--fwp-attn-norm", "on"],
                                   ["--fwp-update-rule", "gated-delta", "--fwp-short-conv", "4", "--fwp-output-gate", "on"]])
def test_attention_normalisation_short_convolutions_and_output_gates_decode_as_their_own_step(flags):
    fused, d = build_lm_model(*flags)
    oracle, _ = build_lm_model(*flags, "--fwp-backend", "reference")
    torch.testing.assert_close(stepwise(fused.eval(), d, 3), stepwise(oracle.eval(), d, 3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("feature_map, flags", MAPS + [("dpfp", ["--fwp-attn-norm", "off"])])
def test_the_encoder_decoder_attentions_fused_read_is_the_full_forwards(feature_map, flags):
    """Sources of 5 to 9 tokens (memories held as their factors), and of 40 (as W)."""
    model, d = build_translation_model("--fwp-feature-map", feature_map, *flags)
    full, steps = full_and_stepwise_decoder_outputs(model, d)
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)
    src = random_tokens(d, [40, 33])
    prev = random_tokens(d, [6, 6], seed=2)
    with torch.no_grad():
        whole = model(src, src.ne(d.pad()).sum(1), prev)[0]
        encoder_out, state = model.encoder(src, src_lengths=src.ne(d.pad()).sum(1)), {}
        pieces = [model.decoder(prev[:, :t + 1], encoder_out=encoder_out, incremental_state=state)[0]
                  for t in range(prev.shape[1])]
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=1e-5, atol=1e-5)


@on_gpu_and_stand_in("feature_map, flags", MAPS, MAPS[2:3])
def test_gpu_the_encoder_decoder_attentions_fused_read_is_the_rules_own(gpu, feature_map, flags, fused_reads):
    """On the GPU, 40 decoding steps of the fused model (its steps and reads) against the oracle's, both
    from the oracle's encoder output: no full forward, whose fla kernels may round otherwise."""
    models = [build_translation_model("--fwp-feature-map", feature_map, *flags, *backend)[0].cuda()
              for backend in (["--fwp-decoding-step", "fused"], ["--fwp-backend", "reference"])]
    d = build_translation_model()[1]
    src = random_tokens(d, [5, 9, 7]).cuda()
    prev = decoder_inputs(d, T=40).cuda()
    with torch.no_grad():
        encoder_out = models[1].encoder(src, src_lengths=src.ne(d.pad()).sum(1))
        decoded = []
        for model in models:
            state = {}
            decoded.append(torch.cat([model.decoder(prev[:, :t + 1], encoder_out=encoder_out,
                                                    incremental_state=state)[0] for t in range(40)], 1))
    assert len(fused_reads) == 2 * 39  # two decoder layers, the steps after the first (which builds the memories)
    torch.testing.assert_close(decoded[0], decoded[1], rtol=1e-5, atol=1e-5)


def test_a_users_map_and_rule_keep_their_own_steps():
    """examples/extend's Hedgehog features and Longhorn rule: the fused step is for the built-ins."""
    from test_extend import parse
    from fairseq_fwp.models.fwp_transformer import FastWeightTransformerModel
    from helpers import toy_dictionary
    import types

    d = toy_dictionary()
    model = FastWeightTransformerModel.build_model(parse("--dropout", "0"), types.SimpleNamespace(
        source_dictionary=d, target_dictionary=d))
    assert not fused_attentions(model)


def test_beam_search_gives_the_same_nbest_lists_with_and_without_the_fused_step():
    """The Multi30k shape (examples/speed/beam_search.py), beam 4: tokens equal, scores within 1e-4."""
    from examples.recipes.decoding_cost import numbered_dictionary
    from examples.speed.beam_search import MODELS, build_model, generator, make_batch, nbest, same_nbest

    dictionary = numbered_dictionary(200)
    sample = make_batch(dictionary)
    for name in ("linear", "dpfp-256"):
        model = build_model(MODELS[name][0], dictionary)
        with torch.no_grad():
            fused = nbest(generator(model, dictionary, 4, 12).generate([model], sample))
            for attention in fused_attentions(model):
                attention.fused_step = None
            own = nbest(generator(model, dictionary, 4, 12).generate([model], sample))
        assert same_nbest(fused, own, tolerance=1e-4), name


def test_the_log_says_that_decoding_is_fused(caplog):
    model, d = build_lm_model()
    with caplog.at_level("INFO", logger="fairseq_fwp.backend"):
        stepwise(model.eval(), d, 1, T=2)
    assert "--fwp-decoding-step auto fuses each decoding step of delta (csrc/fast_weight_step.h)" in caplog.text
    assert os.path.isfile(os.path.join(ROOT, "csrc", "fast_weight_step.h"))


def test_decoding_step_own_keeps_the_rules_own_step_and_decodes_the_same():
    own, d = build_lm_model("--fwp-decoding-step", "own")
    fused, _ = build_lm_model()
    assert not fused_attentions(own) and fused_attentions(fused)
    torch.testing.assert_close(stepwise(own.eval(), d, 3), stepwise(fused.eval(), d, 3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("choice, rows, runs", [("auto", 1, True), ("auto", 4, False), ("fused", 4, True)])
def test_on_a_gpu_auto_fuses_where_the_step_was_timed_faster(choice, rows, runs, monkeypatch, caplog):
    """A GPU report timed the CUDA kernel at one row only: auto keeps the rule's own step in beams there, and
    says so; --fwp-decoding-step fused runs it in beams too. (A stand-in for a CUDA tensor and build.)"""
    model, _ = build_lm_model("--fwp-decoding-step", choice)
    step = fused_attentions(model)[0].fused_step
    monkeypatch.setattr(fused_step_module, "loaded", lambda: types.SimpleNamespace(has_cuda_kernels=lambda: True))
    x = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32, shape=(1, rows, 32))
    with caplog.at_level("INFO", logger="fairseq_fwp.backend"):
        assert step.runs(x, None) is runs
    said = "--fwp-decoding-step auto: the rule's own step runs each decoding step of delta of beams on a GPU"
    assert (said in caplog.text) is (choice == "auto" and rows > 1)


def test_on_a_gpu_an_extension_without_its_cuda_kernels_leaves_the_step_to_the_rule(monkeypatch):
    """An extension built without its CUDA kernels (no nvcc where it was built) cannot run a step of CUDA tensors:
    the rule's own step does, whatever --fwp-decoding-step says. (A stand-in for a CUDA tensor and build.)"""
    model, _ = build_lm_model("--fwp-decoding-step", "fused")
    step = fused_attentions(model)[0].fused_step
    monkeypatch.setattr(fused_step_module, "loaded", lambda: types.SimpleNamespace(has_cuda_kernels=lambda: False))
    x = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32, shape=(1, 1, 32))
    assert step.runs(x, None) is False


def test_a_backend_that_cannot_run_here_stays_refused_while_decoding():
    """--fwp-backend cuda on CPU tensors: the fused step does not stand in for a refused backend."""
    from fairseq_fwp.ops import BackendUnavailableError

    model, d = build_lm_model("--fwp-backend", "cuda")
    with pytest.raises(BackendUnavailableError, match="--fwp-backend cuda: backend 'cuda' cannot run this call: the csrc kernels run on CUDA"):
        stepwise(model.eval(), d, 1, T=2)


def test_the_layer_step_benchmark_times_the_fused_and_the_rules_own_step(capsys):
    """examples/speed/layer_step.py, which the GPU check runs with --device cuda."""
    from examples.speed import layer_step

    layer_step.main(["--runs", "1", "--models", "softmax", "linear"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| softmax |")
            or line.startswith("| linear |")]
    assert [row.split(" | ")[1] for row in rows] == ["softmax attention", "fused", "the rule's own"]
    assert all(row.endswith("x |") for row in rows)


def valid_step(R=2, H=3, d=4, N=1, write=1, decay=0, map_=0, nu=1):
    """A valid fused_step call of the delta rule on W (keyword arguments of the extension's positional ones)."""
    g = torch.Generator().manual_seed(0)
    D = {0: d, 2: 2 * d * nu}[map_]
    return dict(q=torch.randn(R, H, d, generator=g), k=torch.randn(R, H, N, d, generator=g),
                v=torch.randn(R, H, N, d, generator=g), beta=torch.rand(R, H, N, generator=g) if write == 1 else None,
                log_decay=-torch.rand(R, H, generator=g) if decay == 1 else None, W=torch.zeros(R, H, d, D),
                keys=None, writes=None, z=None, projection=None, map=map_, nu=nu, input_scale=1.0, qk_norm=1,
                attention_normalization=False, normalised_retrieval=False, write=write, decay=decay, eps=1e-5)


def call_step(arguments):
    return loaded().fused_step(*arguments.values())


@pytest.mark.parametrize("change, message", [
    (dict(W=torch.zeros(2, 3, 4, 3)), r"W has shape \[2, 3, 4, 3\], expected \[2, 3, 4, 4\]|memory has D = 3"),
    (dict(W=torch.zeros(2, 3, 4, 16), map=2, nu=1), "DPFP gives D = 2 d nu = 8 features, but the memory has D = 16"),
    (dict(nu=9, map=2, W=torch.zeros(2, 3, 4, 72)), r"DPFP's nu must be in \[1, 2 d - 1\], got 9"),
    (dict(beta=torch.rand(2, 3, 2)), r"beta has shape \[2, 3, 2\], expected \[2, 3, 1\] or \[R, H\]"),
    (dict(beta=None), "beta is missing"),
    (dict(log_decay=torch.zeros(2, 3)), "log_decay is not taken with these options"),
    (dict(log_decay=torch.zeros(2, 3, 4), decay=1), r"log_decay has shape \[2, 3, 4\], expected \[2, 3, 1\] or \[R, H\]"),
    (dict(k=torch.randn(2, 3, 1, 5)), r"k has shape \[2, 3, 1, 5\], expected \[2, 3, 1, 4\]"),
    (dict(v=torch.randn(1, 3, 1, 4)), r"v has shape \[1, 3, 1, 4\], expected \[2, 3, 1, 4\]"),
    (dict(attention_normalization=True, z=torch.zeros(2, 3, 3)), r"z has shape \[2, 3, 3\], expected \[2, 3, 4\]"),
    (dict(map=3, W=torch.zeros(2, 3, 4, 6), projection=torch.randn(3, 4)),
     r"projection has shape \[3, 4\], expected \[4, 3\]"),
    (dict(map=7), "unknown feature map 7"),
])
def test_the_extensions_fused_step_checks_every_size(change, message):
    """Sizes that do not agree with each other or with the options would read and write out of bounds."""
    call_step(valid_step())  # the call before its change runs
    with pytest.raises(RuntimeError, match=message):
        call_step({**valid_step(), **change})


def test_the_extensions_fused_read_checks_every_size():
    g = torch.Generator().manual_seed(0)
    q, W = torch.randn(4, 3, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    read = lambda q, W, z=None, norm=False, map_=0: loaded().fused_read(q, W, None, None, z, None, map_, 1, 1.0, 1, norm,  # noqa: E731
                                                                        1e-5)
    read(q, W)
    for args, message in [((q, torch.randn(2, 3, 4, 5)), "memory has D = 5"),
                          ((q, torch.randn(3, 3, 4, 4)), "4 rows cannot share 3 source memories"),
                          ((q, torch.randn(2, 2, 4, 4)), r"W has shape \[2, 2, 4, 4\], expected \[2, 3, 4, 4\]"),
                          ((q, W, torch.zeros(4, 3, 4), True), r"z has shape \[4, 3, 4\], expected \[2, 3, 4\]"),
                          ((q, W, None, True), "z is missing")]:
        with pytest.raises(RuntimeError, match=message):
            read(*args)
