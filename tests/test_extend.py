"""examples/extend: a user's own --user-dir registers a feature map (Hedgehog), an update rule with only
its step (Longhorn) and an architecture, without editing the plugin, and the fairseq tools run it."""
import os
import re
import types

import pytest
import torch

pytest.importorskip("fairseq")

from examples.recipes.pipeline import COMMON_TRAIN, fairseq, generate  # noqa: E402
from helpers import ROOT, random_tokens, toy_dictionary  # noqa: E402

USER_DIR = os.path.join(ROOT, "examples", "extend")
ARCH = ["--user-dir", USER_DIR, "--arch", "fwp_transformer_hedgehog_longhorn"]


def parse(*flags):
    from fairseq import options

    return options.parse_args_and_arch(options.get_training_parser(),
                                       ["/nonexistent-data", "--task", "translation", *ARCH, *flags])


def test_the_registrations_are_flag_choices_with_the_architectures_defaults(capsys):
    args = parse()
    assert (args.fwp_feature_map, args.fwp_update_rule) == ("hedgehog", "longhorn")
    with pytest.raises(SystemExit):
        parse("--help")
    usage = capsys.readouterr().out
    assert "hedgehog" in usage and "longhorn" in usage


def test_incremental_decoding_equals_the_full_forward_and_auto_runs_the_reference(caplog):
    from fairseq_fwp.models.fwp_transformer import FastWeightTransformerModel
    from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention

    d = toy_dictionary()
    torch.manual_seed(0)
    model = FastWeightTransformerModel.build_model(parse("--dropout", "0"), types.SimpleNamespace(
        source_dictionary=d, target_dictionary=d)).eval()
    attention = model.decoder.layers[0].self_attn
    assert isinstance(attention, FastWeightAttention) and attention.feature_map.out_dim == 2 * 16
    src = random_tokens(d, [5, 9, 7])
    prev = random_tokens(d, [8, 8, 8], seed=1)
    with torch.no_grad(), caplog.at_level("INFO", logger="fairseq_fwp.backend"):
        full, _ = model(src, src.ne(d.pad()).sum(1), prev)
        encoder_out = model.encoder(src, src_lengths=src.ne(d.pad()).sum(1))
        state = {}
        steps = torch.cat([model.decoder(prev[:, :t + 1], encoder_out=encoder_out, incremental_state=state)[0]
                           for t in range(prev.shape[1])], 1)
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)
    logged = [line for line in caplog.text.splitlines() if "--fwp-backend auto runs" in line]
    documented = open(os.path.join(ROOT, "docs", "extending.md")).read()
    assert logged and logged[0][logged[0].index("--fwp-backend"):] in documented  # the line as the docs show it


@pytest.mark.slow
def test_fairseq_train_and_generate_run_the_extension(corpora, tmp_path):
    log = fairseq("train", corpora["mt"], *COMMON_TRAIN, *ARCH[2:], "--user-dir", USER_DIR, "--lr", 0.003,
                  "--warmup-updates", 10, "--max-tokens", 2000, "--max-update", 20, "--save-dir", tmp_path)
    assert "num_updates 20" in log or "num_updates=20" in log
    output = generate(corpora["mt"], tmp_path / "checkpoint_last.pt", "--user-dir", USER_DIR)
    assert len(re.findall(r"^H-\d+", output, flags=re.M)) == 43  # every test sentence, at beam 4


def test_the_users_rule_carries_its_state_across_segments_and_through_a_checkpoint():
    """A language model with the user's map and rule (reference only): segments carried one into the next
    compute what one long forward computes, and the carried state survives a state dict."""
    from fairseq import options

    from fairseq_fwp.models.fwp_transformer_lm import FastWeightTransformerLanguageModel
    from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention

    args = options.parse_args_and_arch(options.get_training_parser(), [
        "/nonexistent-data", "--task", "language_modeling", "--arch", "fwp_lm_tiny", "--user-dir", USER_DIR,
        "--fwp-feature-map", "hedgehog", "--fwp-update-rule", "longhorn", "--dropout", "0"])
    d = toy_dictionary()
    torch.manual_seed(0)
    task = types.SimpleNamespace(source_dictionary=d, target_dictionary=d)
    model = FastWeightTransformerLanguageModel.build_model(args, task).eval()
    layers = [m for m in model.modules() if isinstance(m, FastWeightAttention)]
    tokens = random_tokens(d, [13, 13], left_pad=False)
    with torch.no_grad():
        whole, _ = model(tokens)
        for layer in layers:
            layer.enable_carry_over()
        pieces = []
        for position, (a, b) in enumerate(((0, 5), (5, 13))):
            for layer in layers:
                layer.start_segment(position, False)
            pieces.append(model(tokens[:, a:b])[0])
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=1e-5, atol=1e-5)
    model.train()
    for layer in layers:
        layer.start_segment(0, True)
    model(tokens)
    restored = FastWeightTransformerLanguageModel.build_model(args, task)
    for layer in (m for m in restored.modules() if isinstance(m, FastWeightAttention)):
        layer.enable_carry_over()
    restored.load_state_dict(model.state_dict())
    saved, loaded = layers[0].streams.last(True), restored.decoder.layers[0].self_attn.streams.last(True)
    torch.testing.assert_close(loaded.memory.materialized(), saved.memory.materialized())
