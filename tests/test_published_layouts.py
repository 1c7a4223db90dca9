"""Uptraining fairseq's published archives as they are: 2018-2019 checkpoints whose config is `args` alone, in
the state-dict layouts fairseq upgrades when it loads them (examples/recipes/published_layouts.py). Each
stand-in is converted, then loaded through fairseq's own loader: it must come back as the fast-weight model,
compute differently where its row changes the computation, and compute as the original with softmax
attention (the same log-probability of every word)."""
import os
import re
import shlex
import subprocess
import tarfile

import pytest
import torch

pytest.importorskip("fairseq")

import fairseq_fwp  # noqa: E402,F401  (the plugin's models, and torch.load of fairseq's checkpoints)
from examples.recipes.published_layouts import write_archive  # noqa: E402
from examples.recipes.commands import python  # noqa: E402
from fairseq_fwp.models.fwp_transformer import FastWeightTransformerModel  # noqa: E402
from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention  # noqa: E402
from fairseq_fwp.uptraining import cli  # noqa: E402
from fairseq_fwp.uptraining.conversion import convert  # noqa: E402
from fairseq_fwp.uptraining.published_model import convert_pretrained  # noqa: E402
from helpers import log_probabilities  # noqa: E402

TINY = ["--encoder-layers", 2, "--decoder-layers", 2, "--encoder-embed-dim", 32, "--decoder-embed-dim", 32,
        "--encoder-ffn-embed-dim", 64, "--decoder-ffn-embed-dim", 64, "--encoder-attention-heads", 4,
        "--decoder-attention-heads", 4, "--dropout", 0]
# (layout, embeddings shared): each of the published layouts, with and without --share-all-embeddings
VARIANTS = [("args", True), ("in-proj", True), ("layer-norms", False), ("no-output-projection", True),
            ("no-output-projection", False)]
DPFP_SUM = ["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "2"]  # adds no parameter: the state dict fits softmax


@pytest.fixture(scope="module")
def archives(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    folders = {}
    for layout, shared in VARIANTS:
        folder = root / f"{layout}-{'shared' if shared else 'separate'}"
        write_archive(str(folder), "transformer_vaswani_wmt_en_de_big", layout,
                      TINY + (["--share-all-embeddings"] if shared else []))
        folders[layout, shared] = folder
    return folders


def load(path, folder):
    """The model fairseq builds from a checkpoint, as fairseq-generate does."""
    from fairseq import checkpoint_utils

    (model,), _, _ = checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides={"data": str(folder)})
    return model.eval()


def word_log_probs(model):
    """[3, 5, vocabulary]: the log-probability of every target word after each prefix, for 3 random sources."""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, 104, (3, 7), generator=g)
    prev = torch.randint(4, 104, (3, 5), generator=g)
    return log_probabilities(model, src, torch.full((3,), 7), prev)


def fast_weight_attentions(model):
    return sum(isinstance(m, FastWeightAttention) for m in model.modules())


@pytest.mark.parametrize("layout, shared", VARIANTS)
def test_a_published_layout_converts_into_the_fast_weight_model(archives, tmp_path, layout, shared):
    folder = archives[layout, shared]
    convert_pretrained(str(folder), str(tmp_path / "dpfp"), DPFP_SUM)
    converted = load(tmp_path / "dpfp" / "model.pt", tmp_path / "dpfp")
    assert isinstance(converted, FastWeightTransformerModel)
    assert fast_weight_attentions(converted) == 2 + 2 * 2  # every attention of 2 + 2 layers
    assert not torch.allclose(word_log_probs(converted), word_log_probs(load(folder / "model.pt", folder)), atol=1e-3)


@pytest.mark.parametrize("layout, shared", VARIANTS)
def test_a_published_layout_converted_with_softmax_attention_computes_as_the_original(archives, tmp_path, layout,
                                                                                       shared):
    folder = archives[layout, shared]
    convert_pretrained(str(folder), str(tmp_path / "softmax"), ["--fwp-feature-map", "softmax"])
    converted = load(tmp_path / "softmax" / "model.pt", tmp_path / "softmax")
    assert isinstance(converted, FastWeightTransformerModel)
    original = load(folder / "model.pt", folder)
    torch.testing.assert_close(word_log_probs(converted), word_log_probs(original), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout, shared", [("in-proj", True), ("no-output-projection", False)])
def test_a_legacy_softmax_checkpoint_converts_into_the_fast_weight_model(archives, tmp_path, layout, shared):
    folder = archives[layout, shared]
    out = tmp_path / "converted.pt"
    convert(str(folder / "model.pt"), str(out), [
        str(folder), "--user-dir", fairseq_fwp.__path__[0], "--task", "translation", "--source-lang", "en",
        "--target-lang", "de", "--arch", "fwp_transformer_wmt_en_de_big", *map(str, TINY), *DPFP_SUM]
        + (["--share-all-embeddings"] if shared else []))
    converted = load(out, folder)
    assert isinstance(converted, FastWeightTransformerModel) and fast_weight_attentions(converted) == 6


def tiny_archive(folder, *flags, **options):
    write_archive(str(folder), "transformer_vaswani_wmt_en_de_big", "args", TINY + list(flags), **options)
    return folder


def test_the_row_flags_are_checked_against_the_checkpoints_own_model(tmp_path):
    folder = tiny_archive(tmp_path / "deep", "--encoder-layers", 8, "--decoder-layers", 8, "--share-all-embeddings")
    convert_pretrained(str(folder), str(tmp_path / "hybrid"), ["--fwp-softmax-layers", "7"])
    converted = load(tmp_path / "hybrid" / "model.pt", tmp_path / "hybrid")
    assert fast_weight_attentions(converted) == 3 * 8 - 3  # layer 7's three attentions stay softmax
    with pytest.raises(ValueError, match="layer 8 does not exist.*8 encoder layers"):
        convert_pretrained(str(folder), str(tmp_path / "bad"), ["--fwp-softmax-layers", "8"])
    assert sorted(os.listdir(tmp_path)) == ["deep", "hybrid"]  # no --out folder, no part of a model beside it


def test_only_the_flags_uptrain_uses_are_taken_after_the_separator(archives, tmp_path):
    with pytest.raises(ValueError, match=r"--encoder-layers after --: --pretrained takes the model's own options "
                                         r"from its checkpoint"):
        convert_pretrained(str(archives["args", True]), str(tmp_path / "x"), ["--encoder-layers", "3"])


@pytest.mark.parametrize("name, target_words, given, expected", [
    ("model.en-de", None, [], ("en", "de")),  # one dictionary for both sides: the pair in the archive's name
    ("model", [f"v{i}" for i in range(90)], [], ("en", "de")),  # the dictionaries' sizes tell which is which
    ("model", None, ["--source-lang", "de", "--target-lang", "en"], ("de", "en")),  # the user says
])
def test_a_checkpoint_without_its_language_pair_takes_it_from_the_archive_or_the_flags(tmp_path, name, target_words,
                                                                                       given, expected):
    folder = tiny_archive(tmp_path / name, record_languages=False, target_words=target_words)
    _, model_args = convert_pretrained(str(folder), str(tmp_path / "out"), ["--fwp-feature-map", "dpfp"] + given)
    assert (model_args[model_args.index("--source-lang") + 1], model_args[model_args.index("--target-lang") + 1]) == \
        expected


def test_a_language_pair_that_nothing_tells_is_asked_for(tmp_path):
    folder = tiny_archive(tmp_path / "model", record_languages=False)
    with pytest.raises(ValueError, match=r"does not say its language pair .*\(dict\.de\.txt, dict\.en\.txt\) do not "
                                         r"tell which is which: give --source-lang and --target-lang after --"):
        convert_pretrained(str(folder), str(tmp_path / "out"), ["--fwp-feature-map", "dpfp"])
    folder = tiny_archive(tmp_path / "recorded")
    with pytest.raises(ValueError, match="--source-lang fr after --, but .* was trained with en as its source"):
        convert_pretrained(str(folder), str(tmp_path / "out"), ["--source-lang", "fr"])


def test_a_translation_model_whose_task_says_language_modeling_is_refused_as_no_language_model(tmp_path):
    folder = tiny_archive(tmp_path / "lm")
    checkpoint = torch.load(folder / "model.pt", weights_only=False)
    checkpoint["args"].task = "language_modeling"
    torch.save(checkpoint, folder / "model.pt")
    with pytest.raises(ValueError, match=r"model\.pt is the checkpoint of a language_modeling task, but its model, "
                                         r"transformer_vaswani_wmt_en_de_big \(fairseq's TransformerModel\), is no "
                                         r"language model: --pretrained converts a language_modeling checkpoint of "
                                         r"TransformerLanguageModel \(arch transformer_lm, "):
        convert_pretrained(str(folder), str(tmp_path / "out"), [])
    assert sorted(os.listdir(tmp_path)) == ["lm"]


@pytest.mark.parametrize("config", ["absent", "None"])
def test_a_checkpoint_without_a_config_is_named_with_what_it_lacks(tmp_path, config):
    folder = tiny_archive(tmp_path / "model")
    checkpoint = torch.load(folder / "model.pt", weights_only=False)
    del checkpoint["args"]
    if config == "None":
        checkpoint.update(args=None, cfg=None)
    torch.save(checkpoint, folder / "model.pt")
    lacks = rf"{re.escape(str(folder / 'model.pt'))} holds no model configuration \(neither `args` nor `cfg`\)"
    with pytest.raises(ValueError, match=lacks):
        convert_pretrained(str(folder), str(tmp_path / "out"), DPFP_SUM)
    with pytest.raises(ValueError, match=lacks):
        convert(str(folder / "model.pt"), str(tmp_path / "x.pt"), [
            str(folder), "--task", "translation", "-s", "en", "-t", "de", "--arch", "transformer", *map(str, TINY)])
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_an_archive_without_bpe_codes_says_what_it_holds_and_lacks(tmp_path, caplog):
    folder = tiny_archive(tmp_path / "model")
    os.remove(folder / "bpecodes")
    with caplog.at_level("INFO", logger="fairseq_fwp.uptraining"):
        cli.main(["--pretrained", str(folder), "--out", str(tmp_path / "out"), "--", *DPFP_SUM])
    assert (f"{folder} holds no BPE codes (bpecodes, code or sentencepiece.bpe.model), only dict.de.txt, dict.en.txt, "
            "model.pt") in caplog.text
    assert f"wrote {tmp_path / 'out'}/: dict.de.txt, dict.en.txt, model.args, model.pt" in caplog.text
    assert sorted(os.listdir(tmp_path / "out")) == ["dict.de.txt", "dict.en.txt", "model.args", "model.pt"]


@pytest.mark.slow  # bash
def test_the_printed_finetune_command_gives_each_argument_whole(tmp_path, monkeypatch, caplog):
    """Paths with spaces (the plugin's, --out's, --data's) reach fairseq-train as one argument each when the
    printed command runs in bash (here fairseq-train is a function that lists its arguments)."""
    from fairseq_fwp.uptraining import finetuning

    plugin = tmp_path / "my plugins" / "fairseq_fwp"
    monkeypatch.setattr(finetuning, "PLUGIN_DIR", str(plugin))
    data, out = tiny_archive(tmp_path / "my data"), tmp_path / "my models" / "dpfp"  # the archive's dictionaries
    with caplog.at_level("INFO", logger="fairseq_fwp.uptraining"):
        cli.main(["--pretrained", str(data), "--out", str(out), "--data", str(data), "--", *DPFP_SUM])
    command = caplog.text.split("next, finetune it")[1].split(":\n  ", 1)[1].splitlines()[0]
    listed = subprocess.run(["bash", "-c", 'fairseq-train() { printf "%s\\0" "$@"; }; ' + command],
                            capture_output=True, text=True, check=True).stdout.split("\0")[:-1]
    model_args = shlex.split((out / "model.args").read_text())
    assert listed[:3 + len(model_args)] == [str(data), "--user-dir", str(plugin), *model_args]
    assert listed[listed.index("--finetune-from-model") + 1] == str(out / "model.pt")


@pytest.mark.slow  # a new process
def test_a_converted_folder_finetunes_and_loads_where_the_checkout_that_converted_it_is_gone(tmp_path):
    """Converted on one machine (a workstation's checkout, run from its folder), finetuned and loaded on another
    where the plugin lives elsewhere (here, this checkout): neither model.args nor the checkpoint names a
    folder of the checkout that converted it."""
    from fairseq import options

    workstation = tmp_path / "workstation"
    workstation.mkdir()
    (workstation / "fairseq_fwp").symlink_to(fairseq_fwp.__path__[0])  # its plugin, imported from there
    folder, out = tiny_archive(tmp_path / "model", "--share-all-embeddings"), tmp_path / "dpfp"
    converted = python("-m", "fairseq_fwp.uptrain", "--pretrained", folder, "--out", out, "--", *DPFP_SUM,
                       cwd=workstation)
    assert converted.returncode == 0, converted.stderr[-3000:]
    assert f"--user-dir {workstation / 'fairseq_fwp'} " in converted.stderr  # the workstation's plugin converted it
    (workstation / "fairseq_fwp").unlink()  # that checkout is gone (or moved)
    model = shlex.split((out / "model.args").read_text())
    # the next step of docs/uptraining.md, with the plugin where it is on this machine:
    # fairseq-train DATA --user-dir fairseq_fwp "${model[@]}" --finetune-from-model OUT/model.pt ...
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(folder), "--user-dir", fairseq_fwp.__path__[0], *model, "--finetune-from-model", str(out / "model.pt")])
    assert (args.arch, args.fwp_feature_map) == ("fwp_transformer", "dpfp")
    assert str(workstation) not in repr(torch.load(out / "model.pt", weights_only=False)["cfg"])
    assert isinstance(load(out / "model.pt", out), FastWeightTransformerModel)


@pytest.fixture
def served(archives, tmp_path, monkeypatch):
    """The stand-in packed as fairseq's archives are (model.tar.bz2: one top folder), served over HTTP on
    127.0.0.1, with fairseq's download cache and ours in tmp_path."""
    from fairseq import file_utils

    from examples.recipes.published_layouts import pack
    from fairseq_fwp.uptraining import published_archives
    from helpers import serving

    root = tmp_path / "www"
    root.mkdir()
    whole = pack(archives["args", True], root / "model.tar.bz2", top="wmt-standin.en-de").read_bytes()
    (root / "truncated.tar.bz2").write_bytes(whole[:len(whole) // 2])  # its start reads; it ends early
    monkeypatch.setattr(file_utils, "PYTORCH_FAIRSEQ_CACHE", str(tmp_path / "fairseq-cache"))
    monkeypatch.setattr(published_archives, "CACHE", str(tmp_path / "cache"))
    with serving(root) as url:
        yield {"url": url, "root": root, "cache": tmp_path / "cache", "fairseq cache": tmp_path / "fairseq-cache"}


def converts(source, out):
    cli.main(["--pretrained", str(source), "--out", str(out), "--", *DPFP_SUM])
    return isinstance(load(out / "model.pt", out), FastWeightTransformerModel)


def test_every_route_of_pretrained_converts(served, archives, tmp_path, monkeypatch):
    from fairseq.models.transformer import TransformerModel

    monkeypatch.setattr(TransformerModel, "hub_models",
                        classmethod(lambda cls: {"transformer.standin.en-de": f"{served['url']}/model.tar.bz2"}))
    assert converts("transformer.standin.en-de", tmp_path / "hub")  # a name of fairseq's hub: downloaded
    assert converts(f"{served['url']}/model.tar.bz2", tmp_path / "url")
    assert converts(f"file://{served['root']}/model.tar.bz2", tmp_path / "file-url")
    assert converts(served["root"] / "model.tar.bz2", tmp_path / "archive")
    assert converts(archives["args", True], tmp_path / "folder")
    assert sorted(os.listdir(tmp_path / "hub")) == ["bpecodes", "dict.de.txt", "dict.en.txt", "model.args", "model.pt"]


def caches_are_empty(served):
    return not os.listdir(served["fairseq cache"]) and (not served["cache"].exists() or not os.listdir(served["cache"]))


def test_a_broken_archive_is_named_and_leaves_nothing_in_the_caches(served, archives, tmp_path):
    for source in (f"{served['url']}/truncated.tar.bz2", served["root"] / "truncated.tar.bz2"):
        with pytest.raises(SystemExit, match=r"truncated\.tar\.bz2 is not a whole tar archive .*download it again"):
            converts(source, tmp_path / "out")
    assert caches_are_empty(served)  # neither the download that did not extract nor a half-extracted folder


def test_a_url_the_server_refuses_is_named_with_its_answer(served, tmp_path):
    with pytest.raises(SystemExit, match=r"could not download http://\S+/missing\.tar\.bz2: the server answered 404"):
        converts(f"{served['url']}/missing.tar.bz2", tmp_path / "out")
    assert caches_are_empty(served)


def test_a_tar_cut_between_its_members_is_refused_and_downloaded_again(served, archives, tmp_path):
    """Read to its end, an uncompressed tar cut where a member starts ends without an error: its dictionaries
    alone must not be cached as the archive, so that the next try downloads it again."""
    from examples.recipes.published_layouts import pack

    whole = pack(archives["args", True], tmp_path / "whole.tar", top="wmt-standin.en-de")
    with tarfile.open(whole) as tar:
        cut = tar.getmember("wmt-standin.en-de/model.pt").offset
    (served["root"] / "model.tar").write_bytes(whole.read_bytes()[:cut])
    for source in (f"{served['url']}/model.tar", served["root"] / "model.tar"):
        with pytest.raises(SystemExit, match=r"model\.tar is not a whole tar archive \(it ends before its "
                                             r"end-of-archive marker\); download it again"):
            converts(source, tmp_path / "out")
    assert caches_are_empty(served)
    os.replace(whole, served["root"] / "model.tar")  # served whole at the same URL
    assert converts(f"{served['url']}/model.tar", tmp_path / "out")


@pytest.mark.parametrize("format", ["pickle", "zip"])  # as torch saved before 1.6 (the published ones), and since
def test_a_checkpoint_given_as_the_archive_is_told_to_give_its_folder(archives, tmp_path, format):
    checkpoint = archives["args", True] / "model.pt"
    if format == "zip":
        torch.save(torch.load(checkpoint, weights_only=False), tmp_path / "model.pt")
        checkpoint = tmp_path / "model.pt"
    with pytest.raises(SystemExit, match=r"model\.pt is a checkpoint, not an archive: give the folder that holds it"):
        converts(checkpoint, tmp_path / "out")


@pytest.mark.slow
def test_the_wmt16_recipe_runs_every_step_on_a_stand_in_of_the_big_model(tmp_path):
    """prepare (with the archive's dictionary), convert (attention transfer included), finetune, evaluate: each
    step reading what the one before wrote, on transformer_vaswani_wmt_en_de_big's layout at a tiny width."""
    import json
    import random
    import subprocess
    import sys

    from helpers import ROOT

    folder = tiny_archive(tmp_path / "wmt16.en-de", "--share-all-embeddings")
    raw, rng = tmp_path / "raw", random.Random(0)
    raw.mkdir()
    for split, name, lines in (("train", "train.tok.clean.bpe.32000", 120), ("valid", "newstest2013.tok.bpe.32000", 8),
                               ("test", "newstest2014.tok.bpe.32000", 6)):
        for language in ("en", "de"):
            (raw / f"{name}.{language}").write_text("".join(
                " ".join(f"w{rng.randrange(100)}" for _ in range(rng.randrange(3, 9))) + "\n" for _ in range(lines)))
    (tmp_path / "references.de").write_text((raw / "newstest2014.tok.bpe.32000.de").read_text())
    data, model, ckpt = tmp_path / "data", tmp_path / "dpfp-256", tmp_path / "ckpt"

    def step(*argv):
        proc = python("-m", "examples.recipes.wmt16_uptraining", *argv, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout + proc.stderr

    step("prepare", "--raw-dir", raw, "--out", data, "--pretrained", folder, "--workers", 1)
    converted = step("convert", "--data", data, "--row", "dpfp-256", "--out", model, "--attention-transfer-steps", 2)
    assert converted.count("-m fairseq_fwp.uptrain") == 1 and "attention transfer" in converted
    assert "--fwp-feature-map dpfp --fwp-dpfp-nu 2" in (model / "model.args").read_text()
    step("finetune", "--data", data, "--row", "dpfp-256", "--model", model, "--save-dir", ckpt, "--gpus", 128,
         "--precision", "fp32", "--", "--max-update", 2, "--max-tokens", 500)
    log = (ckpt / "train.log").read_text()
    assert "done training" in log and "was saved from another model" not in log and "fwp_distillation" in log
    for which in (["--checkpoint", ckpt / "checkpoint_last.pt"], ["--original"]):
        output = step("evaluate", "--data", data, *which, "--references", tmp_path / "references.de", "--",
                      "--max-len-b", 10)
        result = json.loads(output[output.index("{"):output.index("}") + 1])
        assert result["sentences"] == 6 and result["sacrebleu"] >= 0
