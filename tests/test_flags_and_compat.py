"""--fwp-* flags fail at parse time with clear messages; the compat fixes hold."""
import numpy as np
import pytest

pytest.importorskip("fairseq")

from helpers import parse_args  # noqa: E402

MODELS = [("translation", "fwp_transformer_tiny"), ("language_modeling", "fwp_lm_tiny")]


@pytest.mark.parametrize("task, arch", MODELS)
@pytest.mark.parametrize(
    "flag, value, message",
    [
        # the registered names: the built-ins first (a --user-dir's may follow: tests/test_extend.py)
        ("--fwp-feature-map", "relu", "invalid choice: 'relu' (choose from 'softmax', 'linear', 'performer', 'dpfp', 'silu'"),
        ("--fwp-update-rule", "oja", "invalid choice: 'oja' (choose from 'sum', 'gated-sum', 'delta', 'gated-delta'"),
        ("--fwp-decay-form", "exp", "invalid choice: 'exp' (choose from 'auto', 'mamba2', 'logsigmoid')"),
        ("--fwp-qk-norm", "l1", "invalid choice: 'l1' (choose from 'sum', 'l2', 'none')"),
        ("--fwp-decoder-qk-norm", "l1", "invalid choice: 'l1' (choose from 'auto', 'sum', 'l2', 'none')"),
        ("--fwp-short-conv", "1", "expected 0 (none) or a kernel size >= 2, got 1"),
        ("--fwp-short-conv", "-4", "expected an integer >= 0, got -4"),
        ("--fwp-output-gate", "yes", "invalid choice: 'yes' (choose from 'on', 'off')"),
        ("--fwp-softmax-layers", "every4", "expected comma-separated layer indices such as 3,7, got 'every4'"),
        ("--fwp-backend", "gpu", "invalid choice: 'gpu' (choose from 'auto', 'reference', 'chunked', 'cuda', 'fla')"),
        ("--fwp-dpfp-nu", "0", "expected an integer >= 1, got 0"),
        ("--fwp-dpfp-nu", "two", "expected an integer >= 1, got 'two'"),
        ("--fwp-performer-features", "-3", "expected an integer >= 0, got -3"),
        ("--fwp-attn-norm", "yes", "invalid choice: 'yes' (choose from 'auto', 'on', 'off')"),
        ("--fwp-decoder-attn-norm", "1", "invalid choice: '1' (choose from 'auto', 'on', 'off')"),
        ("--fwp-performer-redraw", "-1", "expected an integer >= 0, got -1"),
        ("--fwp-performer-scaling", "yes", "invalid choice: 'yes' (choose from 'on', 'off')"),
        ("--fwp-sites", "encoder", "invalid choice: 'encoder' (choose from 'all', 'self', 'decoder-self')"),
    ],
)
def test_bad_flag_values_fail_at_parse_time(capsys, task, arch, flag, value, message):
    with pytest.raises(SystemExit):
        parse_args(task, arch, flag, value)
    err = capsys.readouterr().err
    assert f"argument {flag}: {message}" in err, err[-500:]


def test_arch_defaults_follow_the_paper():
    mt = parse_args("translation", "fwp_transformer_wmt_en_de_big")
    assert (mt.fwp_feature_map, mt.fwp_update_rule, mt.fwp_attn_norm, mt.fwp_qk_norm) == ("linear", "sum", "auto", "sum")
    assert (mt.encoder_layers, mt.decoder_layers, mt.encoder_embed_dim, mt.encoder_ffn_embed_dim,
            mt.encoder_attention_heads) == (6, 6, 1024, 4096, 16)
    lm = parse_args("language_modeling", "fwp_lm_wiki103_small")
    assert (lm.fwp_feature_map, lm.fwp_update_rule, lm.fwp_attn_norm, lm.fwp_positions) == ("linear", "delta", "off", "off")
    assert (lm.decoder_layers, lm.decoder_embed_dim, lm.decoder_attention_heads, lm.decoder_ffn_embed_dim) == (16, 128, 8, 2048)
    medium = parse_args("language_modeling", "fwp_lm_wiki103_medium", "--fwp-update-rule", "sum")
    assert (medium.decoder_embed_dim, medium.fwp_update_rule) == (256, "sum")


def test_last_batch_is_never_dropped():
    import fairseq_fwp  # noqa: F401  (applies the fixes)
    from fairseq.data import data_utils

    indices = np.arange(13, dtype=np.int64)
    batches = data_utils.batch_by_size(indices, lambda i: 4, max_sentences=8, required_batch_size_multiple=8)
    assert sorted(np.concatenate(batches).tolist()) == list(range(13))


def test_fairseq_checkpoints_load_under_weights_only_default(tmp_path):
    import argparse

    import fairseq_fwp  # noqa: F401
    import torch
    from fairseq import checkpoint_utils

    path = tmp_path / "ckpt.pt"
    torch.save({"args": argparse.Namespace(arch="x"), "model": {"w": torch.ones(2)}}, path)
    with pytest.raises(Exception):
        torch.load(path)  # torch's own default is untouched: weights_only refuses the Namespace
    state = checkpoint_utils.torch.load(path)  # what fairseq's loader calls
    assert state["args"].arch == "x"
    assert checkpoint_utils.torch.nn is torch.nn


def qk_norms(model):
    from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention

    return {(m.causal, m.options.update_rule): m.options.qk_norm for m in model.modules()
            if isinstance(m, FastWeightAttention)}


def test_the_old_sum_norm_flag_still_works_with_a_warning_naming_the_new_one(caplog):
    with caplog.at_level("WARNING", logger="fairseq_fwp.models.fwp_config"):
        args = parse_args("translation", "fwp_transformer_tiny", "--fwp-sum-norm", "off", "--fwp-update-rule", "delta")
    assert "--fwp-sum-norm is deprecated" in caplog.text and "--fwp-qk-norm none" in caplog.text
    assert args.fwp_qk_norm == "none" and args.fwp_sum_norm is None
    from helpers import build_translation_model

    model, _ = build_translation_model("--fwp-sum-norm", "off", "--fwp-update-rule", "delta")
    assert qk_norms(model) == {(False, "sum"): "none", (True, "delta"): "sum"}  # as before: the delta rule normalises


def test_without_the_old_flag_nothing_is_said_about_it(caplog):
    with caplog.at_level("WARNING"):
        parse_args("translation", "fwp_transformer_tiny", "--fwp-qk-norm", "none")
        parse_args("language_modeling", "fwp_lm_tiny")
    assert "deprecated" not in caplog.text


@pytest.mark.parametrize("task, arch", MODELS)
@pytest.mark.parametrize("old, new", [("off", "l2"), ("off", "sum"), ("on", "none")])
def test_the_old_flag_never_overrides_an_explicit_qk_norm(task, arch, old, new):
    with pytest.raises(ValueError, match=f"--fwp-sum-norm {old} disagrees with --fwp-qk-norm {new}"):
        parse_args(task, arch, "--fwp-sum-norm", old, "--fwp-qk-norm", new)
    agreed = "none" if old == "off" else "l2"
    agreeing = parse_args(task, arch, "--fwp-sum-norm", old, "--fwp-qk-norm", agreed)
    assert agreeing.fwp_qk_norm == agreed and agreeing.fwp_sum_norm is None


def test_the_decoder_self_attention_has_its_own_qk_norm():
    from helpers import build_translation_model

    model, _ = build_translation_model("--fwp-qk-norm", "none", "--fwp-decoder-qk-norm", "l2",
                                       "--fwp-update-rule", "delta")
    assert qk_norms(model) == {(False, "sum"): "none", (True, "delta"): "l2"}
    model, _ = build_translation_model("--fwp-feature-map", "silu", "--fwp-qk-norm", "none",
                                       "--fwp-update-rule", "delta", "--fwp-attn-norm", "off")
    assert qk_norms(model) == {(False, "sum"): "none", (True, "delta"): "l2"}  # auto: l2 for signed features
    with pytest.raises(ValueError, match="--fwp-update-rule delta with --fwp-decoder-qk-norm none: this rule needs "
                                         "normalised keys"):
        parse_args("language_modeling", "fwp_lm_tiny", "--fwp-decoder-qk-norm", "none")


@pytest.mark.parametrize("task, arch", MODELS)
def test_a_dpfp_nu_the_feature_map_cannot_take_fails_at_parse_time(task, arch):
    """DPFP-nu rolls r (size 2 x head_dim) by 1..nu: nu must stay below 2 x head_dim (16 in the tiny
    models, so 32); the message names the flag, the limit and the head size."""
    with pytest.raises(ValueError, match=r"--fwp-dpfp-nu 32 at the .* attention: dpfp nu must be below 2 x head_dim = 32 \(head_dim 16\)"):
        parse_args(task, arch, "--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "32")
    assert parse_args(task, arch, "--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "31").fwp_dpfp_nu == 31
    # a value no site uses passes: the flag belongs to another feature map
    assert parse_args(task, arch, "--fwp-feature-map", "linear", "--fwp-dpfp-nu", "64").fwp_dpfp_nu == 64


def test_a_translation_checkpoint_given_to_eval_lm_says_so():
    from helpers import build_translation_model

    model, _ = build_translation_model()
    with pytest.raises(ValueError, match="translation model .* fairseq-eval-lm cannot score"):
        model.supported_targets


@pytest.mark.slow  # a new process
def test_hydras_deprecation_warnings_are_silenced():
    """Every fairseq command converted its arguments through Hydra APIs that Hydra 1.3 deprecates, printing
    about 20 lines of warnings first; with the plugin loaded there are none (other warnings stay)."""
    import subprocess
    import sys

    from helpers import PLUGIN_DIR, ROOT

    code = ("import sys; from fairseq import options; from fairseq.dataclass.utils import convert_namespace_to_omegaconf; "
            f"args = options.parse_args_and_arch(options.get_training_parser(), ['/x', '--user-dir', {PLUGIN_DIR!r}, "
            "'--task', 'language_modeling', '--arch', 'fwp_lm_tiny']); convert_namespace_to_omegaconf(args); "
            "import warnings; warnings.warn('still shown')")
    stderr = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT).stderr
    warned = [line for line in stderr.splitlines() if "Warning" in line]
    assert warned == ["<string>:1: UserWarning: still shown"], stderr[-2000:]


def test_cross_self_attention_is_refused_where_the_decoder_self_attention_has_fast_weights():
    """fairseq's --cross-self-attention hands the decoder self-attention the source beside the target: a
    fast-weight memory written one target token at a time has no place for it (it crashed at the first
    forward). Where every decoder layer keeps softmax attention, it is fairseq's own."""
    from helpers import build_translation_model

    with pytest.raises(ValueError, match=r"--cross-self-attention with --fwp-feature-map linear: "):
        build_translation_model("--cross-self-attention")
    build_translation_model("--cross-self-attention", "--fwp-softmax-layers", "0,1")
