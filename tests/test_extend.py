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
    assert "runs reference" in caplog.text and "no kernel for the update rule 'longhorn'" in caplog.text


@pytest.mark.slow
def test_fairseq_train_and_generate_run_the_extension(corpora, tmp_path):
    log = fairseq("train", corpora["mt"], *COMMON_TRAIN, *ARCH[2:], "--user-dir", USER_DIR, "--lr", 0.003,
                  "--warmup-updates", 10, "--max-tokens", 2000, "--max-update", 20, "--save-dir", tmp_path)
    assert "num_updates 20" in log or "num_updates=20" in log
    output = generate(corpora["mt"], tmp_path / "checkpoint_last.pt", "--user-dir", USER_DIR)
    assert len(re.findall(r"^H-\d+", output, flags=re.M)) == 43  # every test sentence, at beam 4
