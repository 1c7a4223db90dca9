"""Uptraining (fairseq_fwp/uptraining/conversion.py): a softmax checkpoint converted into a fast-weight model."""
import re

import pytest
import torch

pytest.importorskip("fairseq")

from examples.recipes.commands import PLUGIN_DIR, fairseq  # noqa: E402
from fairseq_fwp.uptraining.cli import main  # noqa: E402
from fairseq_fwp.uptraining.conversion import convert, transfer  # noqa: E402
from examples.recipes.pipeline import COMMON_TRAIN  # noqa: E402


def test_transfer_copies_what_is_shared_and_names_what_does_not_fit():
    source = {"a.weight": torch.ones(2, 3), "b.bias": torch.ones(2), "decoder.version": torch.ones(1)}
    target = {"a.weight": torch.zeros(2, 3), "b.bias": torch.zeros(2), "beta_proj.weight": torch.zeros(4)}
    state, fresh = transfer(source, target)
    assert torch.equal(state["a.weight"], torch.ones(2, 3)) and fresh == ["beta_proj.weight"]
    with pytest.raises(ValueError, match=r"parameter a.weight: the softmax checkpoint has shape \(2, 3\), "
                                         r"the fast-weight model \(3, 3\)"):
        transfer(source, dict(target, **{"a.weight": torch.zeros(3, 3)}))
    with pytest.raises(ValueError, match="no place for these softmax parameters: c.weight"):
        transfer(dict(source, **{"c.weight": torch.ones(1)}), target)


MT_MODEL = ["--arch", "fwp_transformer_tiny", "--dropout", "0", "--max-tokens", "2000", "--lr", "0.002",
            "--warmup-updates", "10", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"]
DPFP_DELTA = ["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "2", "--fwp-update-rule", "delta"]


@pytest.fixture(scope="module")
def softmax_translation(tmp_path_factory, corpora):
    root = tmp_path_factory.mktemp("uptrain")
    (root / "bin").symlink_to(corpora["mt"])
    fairseq("train", root / "bin", *COMMON_TRAIN, *MT_MODEL, "--fwp-feature-map", "softmax", "--max-update", 15,
            "--save-dir", root / "softmax")
    return root


@pytest.mark.slow
def test_a_converted_translation_model_generates_and_finetunes(softmax_translation, tmp_path):
    root = softmax_translation
    converted = tmp_path / "converted.pt"
    fresh = convert(str(root / "softmax" / "checkpoint_last.pt"), str(converted),
                    [str(root / "bin"), "--user-dir", PLUGIN_DIR, *COMMON_TRAIN, *MT_MODEL, *DPFP_DELTA])
    assert fresh and all("beta_proj" in name or "feature_map" in name for name in fresh)
    softmax = torch.load(root / "softmax" / "checkpoint_last.pt", weights_only=False)["model"]
    ours = torch.load(converted, weights_only=False)["model"]
    shared = [name for name in softmax if name in ours]
    assert len(shared) > 40 and all(torch.equal(softmax[name], ours[name]) for name in shared)
    # scored as it is: the quality before any update
    output = fairseq("generate", root / "bin", "--user-dir", PLUGIN_DIR, "--path", converted, "--gen-subset", "test",
                     "--beam", 2, "--scoring", "sacrebleu")
    assert re.search(r"BLEU = [0-9.]+", output)
    log = fairseq("train", root / "bin", *COMMON_TRAIN, *MT_MODEL, *DPFP_DELTA, "--max-update", 4,
                  "--finetune-from-model", converted, "--save-dir", tmp_path / "uptrained")
    updates = [int(n) for n in re.findall(r"num_updates=(\d+)", log)]
    assert updates == [1, 2, 3, 4]  # from update 0, with a fresh optimizer


@pytest.mark.slow
def test_added_gates_and_convolutions_start_as_ungated(softmax_translation, tmp_path):
    root = softmax_translation
    converted = tmp_path / "converted.pt"
    convert(str(root / "softmax" / "checkpoint_last.pt"), str(converted),
            [str(root / "bin"), "--user-dir", PLUGIN_DIR, *COMMON_TRAIN, *MT_MODEL, "--fwp-feature-map", "dpfp",
             "--fwp-update-rule", "gated-delta", "--fwp-short-conv", "3"])
    ours = torch.load(converted, weights_only=False)["model"]
    conv = ours["decoder.layers.0.self_attn.convolutions.k.weight"]
    assert torch.equal(conv[:, 0, -1], torch.ones(conv.shape[0])) and not conv[:, 0, :-1].any()
    A = ours["decoder.layers.0.self_attn.decay_gate.A_log"].exp()
    dt = torch.nn.functional.softplus(ours["decoder.layers.0.self_attn.decay_gate.dt_bias"])
    torch.testing.assert_close(A * dt, torch.full_like(A, 1e-4))  # log a = -1e-4 for every input
    assert not ours["decoder.layers.0.self_attn.decay_gate.proj.weight"].any()


@pytest.mark.slow
def test_attention_transfer_before_saving_trains_the_attentions_only(softmax_translation, tmp_path, caplog):
    root = softmax_translation
    converted = tmp_path / "transferred.pt"
    with caplog.at_level("INFO", logger="fairseq_fwp.uptraining"):
        convert(str(root / "softmax" / "checkpoint_last.pt"), str(converted),
                [str(root / "bin"), "--user-dir", PLUGIN_DIR, *COMMON_TRAIN, *MT_MODEL, *DPFP_DELTA],
                transfer_steps=3)
    assert "attention transfer 3/3: relative error" in caplog.text
    softmax = torch.load(root / "softmax" / "checkpoint_last.pt", weights_only=False)["model"]
    ours = torch.load(converted, weights_only=False)["model"]
    moved = {name for name in softmax if name in ours and not torch.equal(softmax[name], ours[name])}
    assert {"encoder.layers.0.self_attn.q_proj.weight", "decoder.layers.1.encoder_attn.k_proj.weight"} <= moved
    assert all("_attn." in name for name in moved)  # embeddings, feed-forward layers and norms are the softmax's
    unbatched = [a for a in MT_MODEL if a not in ("--max-tokens", "2000")]
    with pytest.raises(ValueError, match="give --max-tokens or --batch-size"):
        convert(str(root / "softmax" / "checkpoint_last.pt"), str(tmp_path / "x.pt"),
                [str(root / "bin"), "--user-dir", PLUGIN_DIR, *COMMON_TRAIN, *unbatched], transfer_steps=3)
    with pytest.raises(SystemExit):  # a negative step count is refused at parse time
        main(["--softmax-checkpoint", "x.pt", "--out", "y.pt", "--attention-transfer-steps", "-1", "--", "data"])


@pytest.mark.slow
def test_a_converted_language_model_and_shapes_that_differ(corpora, tmp_path):
    (tmp_path / "bin").symlink_to(corpora["lm"])
    lm = ["--task", "language_modeling", "--arch", "fwp_lm_tiny", "--tokens-per-sample", 32,
          "--sample-break-mode", "none", "--max-tokens", 512, "--lr", "0.002", "--warmup-updates", 5]
    fairseq("train", tmp_path / "bin", *COMMON_TRAIN, *lm, "--fwp-feature-map", "softmax", "--fwp-positions", "on",
            "--decoder-learned-pos", "--max-update", 3, "--save-dir", tmp_path / "softmax")
    source = str(tmp_path / "softmax" / "checkpoint_last.pt")
    base = [str(tmp_path / "bin"), "--user-dir", PLUGIN_DIR, *map(str, COMMON_TRAIN + lm)]
    convert(source, str(tmp_path / "delta.pt"), base + ["--fwp-positions", "on", "--decoder-learned-pos"])
    output = fairseq("eval-lm", tmp_path / "bin", "--user-dir", PLUGIN_DIR, "--path", tmp_path / "delta.pt",
                     "--gen-subset", "test", "--tokens-per-sample", 32)
    assert re.search(r"Perplexity: [0-9.]+", output)
    with pytest.raises(ValueError, match=r"--fwp-positions on\):\n  no_token_positional_embeddings: softmax False, "
                                         "fast-weight True"):
        convert(source, str(tmp_path / "x.pt"), base)  # the Delta Net's default: no positions
    with pytest.raises(ValueError, match="decoder_ffn_embed_dim: softmax 128, fast-weight 64"):
        convert(source, str(tmp_path / "x.pt"), base + ["--fwp-positions", "on", "--decoder-learned-pos",
                                                        "--decoder-ffn-embed-dim", "64"])


def distillation_setup(root, *flags):
    """The task, criterion and a converted DPFP-delta student of the fixture's data, and one training batch."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    teacher = str(root / "softmax" / "checkpoint_last.pt")
    argv = [str(root / "bin"), *map(str, COMMON_TRAIN + MT_MODEL + DPFP_DELTA), "--criterion", "fwp_distillation",
            "--teacher-checkpoint", teacher, *flags]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    student = task.build_model(cfg.model)
    student.load_state_dict(transfer(torch.load(teacher, weights_only=False)["model"], student.state_dict())[0])
    task.load_dataset("valid")
    batches = task.get_batch_iterator(task.dataset("valid"), max_tokens=500, seed=1).next_epoch_itr(shuffle=False)
    return task, task.build_criterion(cfg.criterion), student, next(batches)


@pytest.mark.slow
def test_distillation_adds_the_teachers_divergence_and_validates_on_the_plain_loss(softmax_translation):
    from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion

    task, criterion, student, sample = distillation_setup(softmax_translation, "--distillation-weight", "0.25")
    plain = LabelSmoothedCrossEntropyCriterion(task, False, 0.1)
    student.train()
    torch.manual_seed(0)
    loss, _, log = criterion(student, sample)
    torch.manual_seed(0)  # the same dropout (none here) and FAVOR+ draws (none for DPFP)
    smoothed, _, plain_log = plain(student, sample)
    # the divergence, written out: sum over target tokens of sum_v p_t(v) (log p_t(v) - log p_s(v))
    teacher = criterion._teacher[0]
    with torch.no_grad():
        log_t = teacher.get_normalized_probs(teacher(**sample["net_input"]), log_probs=True)
        log_s = student.get_normalized_probs(student(**sample["net_input"]), log_probs=True)
    keep = sample["target"].ne(task.target_dictionary.pad())
    divergence = (log_t.exp() * (log_t - log_s)).sum(-1)[keep].sum()
    assert divergence > 0.1
    torch.testing.assert_close(log["distillation_loss"], divergence)
    torch.testing.assert_close(loss, 0.75 * smoothed + 0.25 * divergence)
    assert log["nll_loss"] == plain_log["nll_loss"]
    loss.backward()  # the student learns, the teacher is left as it was and is no part of the criterion
    assert student.decoder.layers[0].self_attn.beta_proj.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in teacher.parameters())
    assert not list(criterion.parameters()) and not criterion.state_dict()
    student.eval()
    torch.testing.assert_close(criterion(student, sample)[0], plain(student, sample)[0])


@pytest.mark.slow
def test_a_student_equal_to_its_teacher_diverges_by_nothing(softmax_translation):
    task, criterion, _, sample = distillation_setup(softmax_translation, "--fwp-feature-map", "softmax",
                                                    "--fwp-update-rule", "sum", "--distillation-weight", "1")
    twin = criterion._teacher[0].__class__.build_model(criterion._teacher[0].args, task)
    twin.load_state_dict(criterion._teacher[0].state_dict())
    _, _, log = criterion(twin.train(), sample)
    assert abs(log["distillation_loss"].item()) < 1e-4


@pytest.mark.slow
def test_distillation_finetunes_a_converted_model_with_fairseq_train(softmax_translation, tmp_path):
    root = softmax_translation
    teacher = root / "softmax" / "checkpoint_last.pt"
    converted = tmp_path / "converted.pt"
    convert(str(teacher), str(converted), [str(root / "bin"), *map(str, COMMON_TRAIN + MT_MODEL + DPFP_DELTA)])
    log = fairseq("train", root / "bin", *COMMON_TRAIN, *MT_MODEL, *DPFP_DELTA, "--max-update", 3,
                  "--criterion", "fwp_distillation", "--teacher-checkpoint", teacher, "--distillation-weight", 0.5,
                  "--finetune-from-model", converted, "--save-dir", tmp_path / "distilled")
    assert len(re.findall(r"distillation_loss=[0-9.]+", log)) == 3
    assert re.search(r"\| valid \| .*\| loss [0-9.]+", log) and not re.search(r"\| valid \|.*distillation", log)
    assert (tmp_path / "distilled" / "checkpoint_best.pt").exists()


@pytest.mark.parametrize("flags, message", [
    (["--distillation-weight", "1.5"], "argument --distillation-weight: expected a number in [0, 1], got 1.5"),
    (["--distillation-weight", "half"], "argument --distillation-weight: expected a number in [0, 1], got 'half'"),
])
def test_bad_distillation_weights_fail_at_parse_time(capsys, flags, message):
    from helpers import parse_args

    with pytest.raises(SystemExit):
        parse_args("translation", "fwp_transformer_tiny", "--criterion", "fwp_distillation", *flags)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_distillation_without_a_teacher_is_refused(softmax_translation):
    from fairseq import tasks
    from helpers import parse_args
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    cfg = convert_namespace_to_omegaconf(parse_args("translation", "fwp_transformer_tiny", "--criterion",
                                                    "fwp_distillation"))
    cfg.task.data = str(softmax_translation / "bin")
    with pytest.raises(ValueError, match="--criterion fwp_distillation needs --teacher-checkpoint"):
        tasks.setup_task(cfg.task).build_criterion(cfg.criterion)


@pytest.mark.slow
def test_a_model_that_computes_differently_is_refused_naming_every_difference(softmax_translation, tmp_path):
    """Projections of 2 and 4 heads have the same shapes, and so do pre- and post-norm layers: shapes alone
    would convert them silently into another model."""
    root = softmax_translation
    source = str(root / "softmax" / "checkpoint_last.pt")
    base = [str(root / "bin"), "--user-dir", PLUGIN_DIR, *map(str, COMMON_TRAIN + MT_MODEL + DPFP_DELTA)]
    with pytest.raises(ValueError) as refused:
        convert(source, str(tmp_path / "x.pt"), base + ["--encoder-attention-heads", "2", "--decoder-attention-heads",
                                                        "2", "--encoder-normalize-before"])
    message = str(refused.value)
    for difference in ("encoder_attention_heads: softmax 4, fast-weight 2",
                       "decoder_attention_heads: softmax 4, fast-weight 2",
                       "encoder_normalize_before: softmax False, fast-weight True"):
        assert difference in message, message
    assert not (tmp_path / "x.pt").exists()


NORMFORMER = ["--scale-attn", "--scale-fc", "--scale-heads", "--scale-resids"]


@pytest.mark.slow
def test_normformers_parameters_are_converted_or_refused_by_name(corpora, tmp_path):
    """NormFormer's options (--scale-attn, --scale-fc, --scale-heads, --scale-resids) add parameters to each
    layer (fairseq-train built them only after transformer_config kept the options): a softmax LM with them
    converts with them copied; a conversion that adds or drops them names them."""
    (tmp_path / "bin").symlink_to(corpora["lm"])
    lm = ["--task", "language_modeling", "--arch", "fwp_lm_tiny", "--tokens-per-sample", 32,
          "--sample-break-mode", "none", "--max-tokens", 512, "--lr", "0.002", "--warmup-updates", 5,
          "--fwp-positions", "on"]
    base = [str(tmp_path / "bin"), "--user-dir", PLUGIN_DIR, *map(str, COMMON_TRAIN + lm)]
    for name, flags in (("plain", []), ("normformer", NORMFORMER)):
        fairseq("train", *base, "--fwp-feature-map", "softmax", *flags, "--max-update", 2,
                "--save-dir", tmp_path / name)
    normformer = str(tmp_path / "normformer" / "checkpoint_last.pt")
    fresh = convert(normformer, str(tmp_path / "converted.pt"), base + NORMFORMER)
    assert not [name for name in fresh if any(part in name for part in ("attn_ln", "ffn_layernorm", "c_attn",
                                                                         "w_resid"))]
    softmax = torch.load(normformer, weights_only=False)["model"]
    ours = torch.load(tmp_path / "converted.pt", weights_only=False)["model"]
    assert torch.equal(ours["decoder.layers.1.c_attn"], softmax["decoder.layers.1.c_attn"])
    with pytest.raises(ValueError, match=r"no place for these softmax parameters: decoder\.layers\.0\.c_attn"):
        convert(normformer, str(tmp_path / "x.pt"), base)
    with pytest.raises(ValueError, match=r"no value for these parameters .*: decoder\.layers\.0\.c_attn, "
                                         r"decoder\.layers\.0\.w_resid, decoder\.layers\.0\.attn_ln\.weight"):
        convert(str(tmp_path / "plain" / "checkpoint_last.pt"), str(tmp_path / "x.pt"), base + NORMFORMER)


def test_deltaproducts_extra_writes_start_as_copies_with_beta_near_zero():
    """Converted into DeltaProduct (N = 2): the key and value projections are two copies of the softmax
    ones, and started as ungated the second write's beta is sigmoid(-10): the layer starts as the delta rule
    it extends (to 1e-4)."""
    from fairseq_fwp.modules.attention_options import AttentionOptions
    from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention

    torch.manual_seed(0)
    delta = FastWeightAttention(AttentionOptions(32, 2, update_rule="delta")).eval()
    product = FastWeightAttention(AttentionOptions(32, 2, update_rule="delta-product", householder_steps=2)).eval()
    softmax_like = {name: x for name, x in delta.state_dict().items() if not name.startswith("beta_proj")}
    state, fresh = transfer(softmax_like, product.state_dict())
    assert fresh == ["beta_proj.weight", "beta_proj.bias"]
    assert torch.equal(state["k_proj.weight"], delta.k_proj.weight.detach().repeat(2, 1))
    product.load_state_dict(state)
    product.beta_proj.weight.data[:2] = delta.beta_proj.weight.data
    product.beta_proj.bias.data[:2] = delta.beta_proj.bias.data
    product.start_as_ungated()
    x = torch.randn(20, 3, 32)
    with torch.no_grad():
        want, got = delta(x, x, x)[0], product(x, x, x)[0]
    assert (got - want).abs().max() / want.abs().max() < 1e-3


def test_an_option_a_saved_config_lacks_counts_as_its_default():
    import argparse

    from fairseq_fwp.uptraining.differences import model_differences

    built = argparse.Namespace(fwp_feature_map="dpfp", fwp_dpfp_nu=2, fwp_decoder_qk_norm="auto",
                               fwp_householder_steps=1, fwp_negative_eigenvalues="off")
    saved = argparse.Namespace(fwp_feature_map="dpfp", fwp_dpfp_nu=2)  # converted before the last three existed
    assert model_differences(saved, built) == []
    saved.fwp_dpfp_nu, built.fwp_householder_steps = 3, 2
    assert model_differences(saved, built) == ["fwp_dpfp_nu: saved 3, built 2", "fwp_householder_steps: saved 1, built 2"]


@pytest.mark.slow
def test_finetuning_a_conversion_with_other_options_warns_naming_them(softmax_translation, tmp_path):
    """Parameters of the same shapes load silently into a model that computes otherwise (DPFP-nu changes no
    parameter): fairseq-train --finetune-from-model says which options differ."""
    root = softmax_translation
    converted = tmp_path / "converted.pt"
    convert(str(root / "softmax" / "checkpoint_last.pt"), str(converted),
            [str(root / "bin"), "--user-dir", PLUGIN_DIR, *COMMON_TRAIN, *MT_MODEL, *DPFP_DELTA])
    other = [flag if flag != "2" else "1" for flag in DPFP_DELTA]  # --fwp-dpfp-nu 1
    log = fairseq("train", root / "bin", *COMMON_TRAIN, *MT_MODEL, *other, "--max-update", 1,
                  "--finetune-from-model", converted, "--save-dir", tmp_path / "finetuned")
    assert "was saved from another model than this command builds" in log and "fwp_dpfp_nu: saved 2, built 1" in log
    log = fairseq("train", root / "bin", *COMMON_TRAIN, *MT_MODEL, *DPFP_DELTA, "--max-update", 1,
                  "--finetune-from-model", converted, "--save-dir", tmp_path / "same")
    assert "was saved from another model" not in log
