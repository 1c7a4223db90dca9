"""The extension points check what they take: a registration when it is made, a rule's needs at its first
call, a backend and a rule that do not go together when the arguments are parsed, and a checkpoint that
needs registrations of a --user-dir the command did not name."""
import os
import subprocess
import sys

import pytest
import torch

import fairseq_fwp  # noqa: F401  (the built-ins and fairseq's patches)
from fairseq_fwp import FeatureMap, UpdateRule, register_feature_map, register_update_rule
from fairseq_fwp.modules.feature_maps import FEATURE_MAPS
from fairseq_fwp.ops import BackendUnavailableError, Memory, UPDATE_RULES, fast_weight, fast_weight_state
from fairseq_fwp.ops import fast_weight_step_
from fairseq_fwp.ops.rules.delta import DeltaRule
from fairseq_fwp.testing import triton_interpreter
from helpers import ROOT, build_lm_model, build_translation_model, make_inputs


@pytest.fixture
def registered():
    """Registrations made by a test, removed after it."""
    rules, maps = set(UPDATE_RULES), set(FEATURE_MAPS)
    yield
    for name in set(UPDATE_RULES) - rules:
        del UPDATE_RULES[name]
    for name in set(FEATURE_MAPS) - maps:
        del FEATURE_MAPS[name]


# -- registrations --------------------------------------------------------------------------


def test_a_rule_without_its_own_step_is_refused_when_registered(registered):
    with pytest.raises(ValueError, match="update rule 'stepless': Stepless has no step"):
        @register_update_rule("stepless")
        class Stepless(UpdateRule):
            write_strength = True
    assert "stepless" not in UPDATE_RULES


def test_a_feature_map_without_out_dim_or_with_a_wrong_one_is_refused_when_registered(registered):
    with pytest.raises(ValueError, match="feature map 'sizeless': Sizeless sets no out_dim"):
        @register_feature_map("sizeless")
        class Sizeless(FeatureMap):
            def __init__(self, head_dim):
                super().__init__()

            def forward(self, x):
                return x

    with pytest.raises(ValueError, match=r"feature map 'doubling': Doubling\(64\) says out_dim = 64, but maps vectors "
                                         r"of size 64 to size 128"):
        @register_feature_map("doubling")
        class Doubling(FeatureMap):
            def __init__(self, head_dim):
                super().__init__()
                self.out_dim = head_dim

            def forward(self, x):
                return torch.cat([x.relu(), (-x).relu()], -1)
    assert "sizeless" not in FEATURE_MAPS and "doubling" not in FEATURE_MAPS


class Blocks16(FeatureMap):
    """A map of blocks of 16 channels: heads of a multiple of 16 only."""

    def __init__(self, head_dim):
        super().__init__()
        if head_dim % 16:
            raise ValueError(f"head_dim must be a multiple of 16, got {head_dim}")
        self.out_dim = head_dim

    def forward(self, x):
        return torch.nn.functional.elu(x) + 1


def test_a_map_that_needs_heads_of_a_multiple_of_16_registers_and_builds_where_they_are(registered):
    register_feature_map("blocks16")(Blocks16)
    model, _ = build_lm_model("--fwp-feature-map", "blocks16")  # heads of 16
    assert type(model.decoder.layers[0].self_attn.feature_map) is Blocks16
    with pytest.raises(ValueError, match=r"--fwp-feature-map blocks16: with heads of 8: Blocks16\(8\) cannot be "
                                         r"built \(ValueError: head_dim must be a multiple of 16, got 8\)"):
        build_lm_model("--fwp-feature-map", "blocks16", "--decoder-attention-heads", "8")


def test_a_map_that_builds_at_no_probe_size_is_refused_when_registered(registered):
    class Odd(Blocks16):
        def __init__(self, head_dim):
            if head_dim % 2 == 0:
                raise ValueError("odd heads only")
            super().__init__(head_dim)

    with pytest.raises(ValueError, match=r"feature map 'odd' cannot be built at any head size of \(64, 128, 32, 16, "
                                         r"8\) \(Odd\(64\) cannot be built \(ValueError: odd heads only\);"):
        register_feature_map("odd")(Odd)
    assert "odd" not in FEATURE_MAPS


def test_registering_a_random_map_leaves_torchs_generator_where_it_was(registered):
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)

    @register_feature_map("drawn")
    class Drawn(FeatureMap):
        def __init__(self, head_dim):
            super().__init__()
            self.projection = torch.randn(head_dim, head_dim)
            self.out_dim = head_dim

        def forward(self, x):
            return x @ self.projection
    assert torch.equal(torch.rand(3), expected)


def test_a_subclass_runs_its_own_step_on_every_backend_not_its_parents_kernels(registered):
    """A rule that subclasses the delta rule and writes another step: no backend may train it with the
    delta rule's kernels, nor --fwp-householder-steps turn it into the built-in DeltaProduct."""
    @register_update_rule("half-delta")
    class HalfDelta(DeltaRule):
        def step(self, memory, q, k, v, beta, decay):
            return super().step(memory, q, k, v, beta / 2, decay)

    rule = UPDATE_RULES["half-delta"]
    assert rule.kernels == {} and rule.product is None
    q, k, v, beta, W0 = make_inputs(1, 2, 9, 4, 3)
    for backend in ("auto", "reference"):
        out, W = fast_weight("half-delta", q, k, v, beta, W0, backend=backend)
        want, _ = fast_weight("delta", q, k, v, beta / 2, W0, backend="reference")
        torch.testing.assert_close(out, want)
    with pytest.raises(BackendUnavailableError, match="it has no kernel for the update rule 'half-delta'"):
        fast_weight("half-delta", q, k, v, beta, W0, backend="chunked")
    with pytest.raises(ValueError, match="--fwp-update-rule half-delta with --fwp-householder-steps 2: several "
                                         "writes per token are DeltaProduct's"):
        build_lm_model("--fwp-update-rule", "half-delta", "--fwp-householder-steps", "2")

    @register_update_rule("half-delta-kept")
    class KeepsTheKernels(HalfDelta):  # says that it keeps the delta rule's kernels: its own business
        kernels = DeltaRule.kernels
    assert UPDATE_RULES["half-delta-kept"].kernels == DeltaRule.kernels


def test_a_rule_that_uses_beta_without_declaring_it_is_named_at_the_first_call(registered):
    @register_update_rule("uses-beta")
    class UsesBeta(UpdateRule):
        def step(self, memory, q, k, v, beta, decay):
            memory.write_(k, beta.unsqueeze(-1) * v)
            return memory.read(q.unsqueeze(-2)).squeeze(-2)

    q, k, v, _, _ = make_inputs(1, 2, 5, 4, 3)
    with pytest.raises(ValueError, match=r"update rule 'uses-beta': its step failed on None for beta "
                                         r"\(write_strength = True\).*declares write_strength = True"):
        fast_weight("uses-beta", q, k, v)


USES_BETA = """
from fairseq_fwp import UpdateRule, register_update_rule


@register_update_rule("uses-beta")
class UsesBeta(UpdateRule):
    def step(self, memory, q, k, v, beta, decay):
        memory.write_(k, beta.unsqueeze(-1) * v)
        return memory.read(q.unsqueeze(-2)).squeeze(-2)
"""


@pytest.mark.slow
def test_fairseq_train_with_a_rule_that_uses_an_undeclared_beta_stops_with_its_name(corpora, tmp_path):
    user_dir = tmp_path / "my_rule"
    user_dir.mkdir()
    (user_dir / "__init__.py").write_text(USES_BETA)
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "fairseq-train"), corpora["lm"],
                           "--user-dir", user_dir, "--task", "language_modeling", "--arch", "fwp_lm_tiny",
                           "--fwp-update-rule", "uses-beta", "--tokens-per-sample", "32", "--max-tokens", "512",
                           "--optimizer", "adam", "--lr", "0.001", "--max-update", "2", "--no-save"],
                          capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 1, proc.stderr[-2000:]  # an error, not an abort
    assert "update rule 'uses-beta': its step failed on None for beta" in proc.stderr


# -- backends and rules -------------------------------------------------------------------


@pytest.mark.parametrize("flags, message", [
    (["--fwp-backend", "cuda", "--fwp-update-rule", "gated-delta"],
     "--fwp-backend cuda with --fwp-update-rule gated-delta: this backend has no kernel for this rule"),
    (["--fwp-backend", "cuda", "--fwp-update-rule", "delta", "--fwp-householder-steps", "2", "--fwp-qk-norm", "l2"],
     "--fwp-backend cuda with --fwp-update-rule delta: this backend has no kernel for this rule"),
])
def test_a_named_backend_without_a_kernel_for_the_rule_is_refused_when_parsed(flags, message):
    with pytest.raises(ValueError, match=message):
        build_lm_model(*flags)


def test_a_named_backend_decodes_with_the_rules_own_step_where_it_has_no_step_for_it():
    """fla trains DeltaProduct with its chunk kernel (half types) but has no recurrent form for it: its
    decoding steps run the rule's own step (here through Triton's interpreter, on CPU tensors)."""
    from fairseq_fwp.ops import fla

    if not fla.interpreting():
        pytest.skip("fla on CPU tensors needs TRITON_INTERPRET=1 (conftest.py sets it without CUDA)")
    q, _, _, _, _ = make_inputs(2, 2, 1, 4, 3, dtype=torch.float32)
    k, v = torch.nn.functional.normalize(torch.randn(2, 2, 2, 4), dim=-1), torch.randn(2, 2, 2, 3)
    beta = torch.rand(2, 2, 2)
    choices, memory, reference = [], Memory(), Memory()
    with triton_interpreter():
        got = fast_weight_step_(memory, q[:, :, 0], k, v, beta, rule="delta-product", backend="fla",
                                on_choice=choices.append)
    want = fast_weight_step_(reference, q[:, :, 0], k, v, beta, rule="delta-product", backend="reference")
    torch.testing.assert_close(got, want)
    assert choices[0].log.startswith("--fwp-backend fla decodes with the rule's own step (fla has no decoding step for "
                                     "the rule delta-product: fla has DeltaProduct's chunkwise kernel only")


def test_auto_settings_follow_a_maps_signedness_not_its_name(registered):
    @register_feature_map("signed-identity")
    class SignedIdentity(FeatureMap):
        signed = True

        def __init__(self, head_dim):
            super().__init__()
            self.out_dim = head_dim

        def forward(self, x):
            return x

    model, _ = build_translation_model("--fwp-feature-map", "signed-identity", "--fwp-update-rule", "delta",
                                       "--fwp-qk-norm", "none", "--fwp-attn-norm", "auto")
    options = model.decoder.layers[0].self_attn.options
    assert (options.qk_norm, options.attention_normalization) == ("l2", False)  # as silu gets


# -- the ops' edges --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_deltaproduct_of_no_tokens_and_its_state_alone(backend):
    B, H, N, D, Dv = 2, 3, 2, 4, 5
    q, k, v, beta = torch.rand(B, H, 0, D), torch.rand(B, H, 0, N, D), torch.rand(B, H, 0, N, Dv), torch.rand(B, H, 0, N)
    out, W = fast_weight("delta-product", q, k, v, beta, backend=backend)
    assert out.shape == (B, H, 0, Dv) and W.shape == (B, H, Dv, D)
    T = 7
    q = torch.rand(B, H, T, D, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.rand(B, H, T, N, D, dtype=torch.float64), dim=-1)
    v, beta = torch.rand(B, H, T, N, Dv, dtype=torch.float64), torch.rand(B, H, T, N, dtype=torch.float64)
    _, want = fast_weight("delta-product", q, k, v, beta, backend="reference")
    torch.testing.assert_close(fast_weight_state("delta-product", k, v, beta, backend=backend), want)


# -- the command line and checkpoints -------------------------------------------------------


@pytest.mark.slow  # a new process
def test_fairseq_train_help_without_an_architecture_prints_the_help():
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "fairseq-train"), "--user-dir",
                           os.path.join(ROOT, "fairseq_fwp"), "--help"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: fairseq-train"), proc.stderr[-2000:]


LOAD_WITHOUT_THE_USER_DIR = """
import sys
import fairseq_fwp
from fairseq import checkpoint_utils
try:
    checkpoint_utils.load_model_ensemble_and_task([sys.argv[1]], arg_overrides={"data": sys.argv[2]})
except ValueError as err:
    print(err)
"""


@pytest.mark.slow  # a new process
def test_a_checkpoint_of_a_user_dirs_architecture_names_what_is_missing(tmp_path):
    """A checkpoint of examples/extend's architecture, loaded without its --user-dir."""
    from examples.recipes.published_layouts import write_archive
    from fairseq_fwp.uptraining.published_model import convert_pretrained

    write_archive(str(tmp_path / "softmax"), "transformer", "args", [
        "--encoder-layers", 1, "--decoder-layers", 1, "--encoder-embed-dim", 32, "--decoder-embed-dim", 32,
        "--encoder-attention-heads", 2, "--decoder-attention-heads", 2, "--share-all-embeddings"])
    user_dir = os.path.join(ROOT, "examples", "extend")
    convert_pretrained(str(tmp_path / "softmax"), str(tmp_path / "extend"), [])
    checkpoint = torch.load(tmp_path / "extend" / "model.pt", weights_only=False)
    model = checkpoint["cfg"]["model"]  # as if trained with --user-dir examples/extend --arch ...
    model.arch, model.fwp_feature_map, model.fwp_update_rule = "fwp_transformer_hedgehog_longhorn", "hedgehog", "longhorn"
    checkpoint["cfg"]["common"]["user_dir"] = user_dir
    torch.save(checkpoint, tmp_path / "extend" / "model.pt")
    proc = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_THE_USER_DIR, str(tmp_path / "extend" / "model.pt"),
                           str(tmp_path / "extend")], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert (f"needs the architecture fwp_transformer_hedgehog_longhorn and --fwp-feature-map hedgehog and "
            f"--fwp-update-rule longhorn, not registered in this process; it was trained with --user-dir {user_dir}"
            in proc.stdout), proc.stdout + proc.stderr[-2000:]
