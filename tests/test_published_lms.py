"""uptrain --pretrained on fairseq's published language models (transformer_lm.wiki103.adaptive, the
transformer_lm.wmt19.* models), through stand-ins saved as the 2019 fairseq that wrote them saved
(examples/recipes/published_layouts.py: `args` alone, arch transformer_lm_wiki103 at a tiny width, adaptive
input and softmax, tied; dict.txt). Each is converted, then loaded through fairseq's own loader: it must come
back as the fast-weight LM, with every weight it carries equal to the original's, compute as the original
with softmax attention (the same log-probability of every word, the adaptive softmax's tail clusters
included), and otherwise differ where the row changes the computation."""
import os
import re

import pytest
import torch

pytest.importorskip("fairseq")

import fairseq_fwp  # noqa: E402,F401  (the plugin's models, and torch.load of fairseq's checkpoints)
from examples.recipes import rows  # noqa: E402
from examples.recipes.published_layouts import LM_LAYOUTS, pack, write_lm_archive  # noqa: E402
from fairseq_fwp.models.fwp_transformer_lm import FastWeightTransformerLanguageModel  # noqa: E402
from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention  # noqa: E402
from fairseq_fwp.uptraining import cli, published_archives  # noqa: E402
from fairseq_fwp.uptraining.conversion import NOT_PARAMETERS  # noqa: E402
from fairseq_fwp.uptraining.finetuning import finetune_command  # noqa: E402
from fairseq_fwp.uptraining.published_model import convert_pretrained  # noqa: E402
from helpers import log_probabilities, serving  # noqa: E402

# transformer_lm_wiki103 (16 layers of 1024, 8 heads, adaptive input and softmax with cutoffs 20000,60000,
# tied) at a tiny width, over the 104 types of w0 ... w99
TINY_WIKI103 = ["--decoder-layers", 2, "--decoder-embed-dim", 32, "--decoder-ffn-embed-dim", 64,
                "--decoder-attention-heads", 4, "--adaptive-input-cutoff", "20,60", "--adaptive-softmax-cutoff",
                "20,60", "--tokens-per-sample", 64, "--dropout", 0]


@pytest.fixture(scope="module")
def archives(tmp_path_factory):
    """A random-weight stand-in of transformer_lm.wiki103.adaptive in each layout."""
    root = tmp_path_factory.mktemp("published-lms")
    folders = {}
    for layout in LM_LAYOUTS:
        write_lm_archive(str(root / layout), "transformer_lm_wiki103", layout, TINY_WIKI103)
        folders[layout] = root / layout
    return folders


def load(path, folder):
    """The model fairseq builds from a checkpoint, as fairseq-eval-lm does."""
    from fairseq import checkpoint_utils

    (model,), _, _ = checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides={"data": str(folder)})
    return model.eval()


def word_log_probs(model):
    """[3, 24, vocabulary]: the log-probability of every word after each prefix of 3 random lines."""
    tokens = torch.randint(4, 104, (3, 24), generator=torch.Generator().manual_seed(0))
    return log_probabilities(model, tokens)


def assert_computes_as_the_original(converted, original):
    """The same prediction of every word at every position, to float rounding: over the whole vocabulary, so
    that the adaptive softmax's head, cluster logits, tail projections and cutoffs are compared too (a tail
    projection or a cluster's logits left uncopied moves them by far more than the tolerance)."""
    got, want = word_log_probs(converted), word_log_probs(original)
    assert got.shape[-1] == len(original.decoder.dictionary)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def converted_layers(model):
    return [layer.self_attn for layer in model.decoder.layers]


@pytest.mark.parametrize("layout, row", [("args", row) for row in sorted(rows.WIKITEXT103_UPTRAINING)]
                         + [("in-proj", "delta")])
def test_each_row_converts_carrying_every_weight_of_the_original(archives, tmp_path, layout, row):
    folder = archives[layout]
    out = tmp_path / row
    fresh, _ = convert_pretrained(str(folder), str(out), rows.WIKITEXT103_UPTRAINING[row].flags_for())
    original, converted = load(folder / "model.pt", folder), load(out / "model.pt", out)
    assert isinstance(converted, FastWeightTransformerLanguageModel)
    assert all(isinstance(attention, FastWeightAttention) for attention in converted_layers(converted))
    ours = torch.load(out / "model.pt", weights_only=False)["model"]
    carried = [name for name in original.state_dict() if not name.endswith(NOT_PARAMETERS)]
    assert len(carried) > 40 and all(torch.equal(original.state_dict()[name], ours[name]) for name in carried)
    assert all(".self_attn." in name for name in fresh)  # only the attentions have anything new
    assert sorted(os.listdir(out)) == ["dict.txt", "model.args", "model.pt"]
    assert not torch.allclose(word_log_probs(converted), word_log_probs(original), atol=1e-3)


@pytest.mark.parametrize("layout", LM_LAYOUTS)
def test_converted_with_softmax_attention_it_computes_as_the_original(archives, tmp_path, layout):
    folder = archives[layout]
    convert_pretrained(str(folder), str(tmp_path / "softmax"), ["--fwp-feature-map", "softmax"])
    converted = load(tmp_path / "softmax" / "model.pt", tmp_path / "softmax")
    assert isinstance(converted, FastWeightTransformerLanguageModel)
    assert_computes_as_the_original(converted, load(folder / "model.pt", folder))


def test_an_option_the_checkpoint_lacks_takes_the_value_the_originals_architecture_gives_it(archives, tmp_path):
    """A checkpoint saved without decoder_normalize_before: fairseq's loader fills in the option's default
    (post-norm), and its builder's architecture function (base_lm_architecture) makes the layers pre-norm;
    the twin is pre-norm too, and computes as the original."""
    folder = tmp_path / "older"
    folder.mkdir()
    checkpoint = torch.load(archives["args"] / "model.pt", weights_only=False)
    del checkpoint["args"].decoder_normalize_before
    torch.save(checkpoint, folder / "model.pt")
    (folder / "dict.txt").write_bytes((archives["args"] / "dict.txt").read_bytes())
    _, model_args = convert_pretrained(str(folder), str(tmp_path / "softmax"), ["--fwp-feature-map", "softmax"])
    assert "--decoder-normalize-before" in model_args
    converted = load(tmp_path / "softmax" / "model.pt", tmp_path / "softmax")
    assert_computes_as_the_original(converted, load(folder / "model.pt", folder))


def test_a_checkpoint_of_another_task_is_refused_naming_it(archives, tmp_path):
    folder = tmp_path / "masked"
    folder.mkdir()
    checkpoint = torch.load(archives["args"] / "model.pt", weights_only=False)
    checkpoint["args"].task = "masked_lm"
    torch.save(checkpoint, folder / "model.pt")
    (folder / "dict.txt").write_bytes((archives["args"] / "dict.txt").read_bytes())
    with pytest.raises(ValueError, match=r"masked/model\.pt is the checkpoint of a masked_lm model \(its task\): "
                                         r"--pretrained converts translation models \(translation\) and language "
                                         r"models \(language_modeling\)"):
        convert_pretrained(str(folder), str(tmp_path / "out"), [])


def test_the_twin_keeps_the_originals_adaptive_input_softmax_positions_and_blocks(archives, tmp_path):
    _, model_args = convert_pretrained(str(archives["args"]), str(tmp_path / "delta"), ["--fwp-update-rule", "delta"])
    text = " ".join(model_args)
    for flags in ("--task language_modeling --tokens-per-sample 64 --max-target-positions 64",
                  "--arch fwp_transformer_lm",
                  "--adaptive-input --adaptive-input-factor 4.0 --adaptive-input-cutoff 20,60",
                  "--adaptive-softmax-cutoff 20,60", "--tie-adaptive-weights --tie-adaptive-proj",
                  "--decoder-normalize-before --no-decoder-final-norm", "--fwp-positions on --fwp-update-rule delta"):
        assert flags in text
    model = load(tmp_path / "delta" / "model.pt", tmp_path / "delta")
    assert model.decoder.embed_positions is not None and model.decoder.adaptive_softmax is not None
    assert model.max_positions() == 64


def test_the_row_flags_are_checked_against_the_originals_own_model(archives, tmp_path):
    folder = str(archives["args"])
    with pytest.raises(ValueError, match=r"--fwp-softmax-layers 2: layer 2 does not exist \(the model has 2 decoder "
                                         r"layers, counted from 0\)"):
        convert_pretrained(folder, str(tmp_path / "x"), ["--fwp-softmax-layers", "2"])
    with pytest.raises(ValueError, match="(?s)would compute differently .*no_token_positional_embeddings: "
                                         "softmax False, fast-weight True"):
        convert_pretrained(folder, str(tmp_path / "x"), ["--fwp-positions", "off"])
    convert_pretrained(folder, str(tmp_path / "hybrid"), ["--fwp-softmax-layers", "1"])
    hybrid = load(tmp_path / "hybrid" / "model.pt", tmp_path / "hybrid")
    assert [isinstance(a, FastWeightAttention) for a in converted_layers(hybrid)] == [True, False]
    assert sorted(os.listdir(tmp_path)) == ["hybrid"]  # no folder, nor part of one, for a refused conversion


@pytest.mark.parametrize("flags, refused", [
    (["--source-lang", "en"], "--source-lang"), (["--decoder-layers", "3"], "--decoder-layers")])
def test_only_the_flags_uptrain_uses_are_taken_after_the_separator(archives, tmp_path, flags, refused):
    with pytest.raises(ValueError, match=rf"{refused} after --: --pretrained takes the model's own options from its "
                                         r"checkpoint; after -- it uses only --fwp-\* flags and --max-tokens, "
                                         r"--batch-size, --tokens-per-sample"):
        convert_pretrained(str(archives["args"]), str(tmp_path / "x"), flags)


def test_an_archive_without_its_dictionary_is_refused_naming_what_it_holds(archives, tmp_path):
    folder = tmp_path / "no-dict"
    folder.mkdir()
    (folder / "model.pt").write_bytes((archives["args"] / "model.pt").read_bytes())
    with pytest.raises(FileNotFoundError, match=r"no-dict holds no dict\.txt, the dictionary its model was trained "
                                                r"with, only model\.pt"):
        convert_pretrained(str(folder), str(tmp_path / "out"), [])
    assert sorted(os.listdir(tmp_path)) == ["no-dict"]


def test_an_ensemble_of_language_models_is_refused(archives, tmp_path):
    for name in ("model1.pt", "model2.pt"):
        (tmp_path / name).write_bytes((archives["args"] / "model.pt").read_bytes())
    (tmp_path / "dict.txt").write_bytes((archives["args"] / "dict.txt").read_bytes())
    with pytest.raises(SystemExit, match=r"is an ensemble of 2 models \(model1\.pt, model2\.pt\), which a single "
                                         r"fast-weight model cannot replace; convert one model's own archive instead"):
        cli.main(["--pretrained", str(tmp_path), "--out", str(tmp_path / "out"), "--"])


def test_a_character_language_model_converts_and_computes_as_the_original(tmp_path):
    """fairseq's character-level input (a convolution over each word's characters) is an input embedding like
    another: converted with softmax attention, the model computes as the original."""
    folder = tmp_path / "char"
    write_lm_archive(str(folder), "transformer_lm_big", "args", [
        "--decoder-layers", 2, "--decoder-embed-dim", 32, "--decoder-ffn-embed-dim", 64, "--decoder-attention-heads",
        4, "--character-embeddings", "--character-filters", "[(1, 8), (2, 8)]", "--character-embedding-dim", 4,
        "--char-embedder-highway-layers", 1, "--tokens-per-sample", 64, "--dropout", 0])
    convert_pretrained(str(folder), str(tmp_path / "softmax"), ["--fwp-feature-map", "softmax"])
    converted = load(tmp_path / "softmax" / "model.pt", tmp_path / "softmax")
    assert "--character-embeddings" in (tmp_path / "softmax" / "model.args").read_text()
    assert_computes_as_the_original(converted, load(folder / "model.pt", folder))


# -- the routes: fairseq's hub, a mirror of it, a URL, an archive, a folder ------------------------------------


@pytest.fixture
def served(archives, tmp_path, monkeypatch):
    """The stand-in packed as the published archive is (adaptive_lm_wiki103.v2.tar.bz2: one top folder), served
    over HTTP on 127.0.0.1 as fairseq's hub entry transformer_lm.wiki103.adaptive, with fairseq's download cache
    and ours in tmp_path."""
    from fairseq import file_utils
    from fairseq.models.transformer_lm import TransformerLanguageModel

    root = tmp_path / "www"
    root.mkdir()
    whole = pack(archives["args"], root / "adaptive_lm_wiki103.v2.tar.bz2", top="adaptive_lm_wiki103.v2").read_bytes()
    (root / "truncated.tar.bz2").write_bytes(whole[:len(whole) // 2])
    monkeypatch.setattr(file_utils, "PYTORCH_FAIRSEQ_CACHE", str(tmp_path / "fairseq-cache"))
    monkeypatch.setattr(published_archives, "CACHE", str(tmp_path / "cache"))
    with serving(root) as url:
        hub = {"transformer_lm.wiki103.adaptive": f"{url}/adaptive_lm_wiki103.v2.tar.bz2",
               "transformer_lm.wiki103.truncated": f"{url}/truncated.tar.bz2"}
        monkeypatch.setattr(TransformerLanguageModel, "hub_models", classmethod(lambda cls: hub))
        yield {"url": url, "root": root, "cache": tmp_path / "cache", "fairseq cache": tmp_path / "fairseq-cache"}


def converts(source, out):
    cli.main(["--pretrained", str(source), "--out", str(out), "--", "--fwp-update-rule", "delta"])
    return isinstance(load(out / "model.pt", out), FastWeightTransformerLanguageModel)


def test_every_route_of_pretrained_converts_a_language_model(served, archives, tmp_path, monkeypatch):
    assert converts("transformer_lm.wiki103.adaptive", tmp_path / "hub")  # a name of fairseq's hub: downloaded
    assert converts(f"{served['url']}/adaptive_lm_wiki103.v2.tar.bz2", tmp_path / "url")
    assert converts(f"file://{served['root']}/adaptive_lm_wiki103.v2.tar.bz2", tmp_path / "file-url")
    assert converts(served["root"] / "adaptive_lm_wiki103.v2.tar.bz2", tmp_path / "archive")
    assert converts(archives["args"], tmp_path / "folder")
    for mirror in (served["url"], str(served["root"])):  # the hub's archive, by its file name, from a mirror
        monkeypatch.setenv(published_archives.MIRROR, mirror)
        assert converts("transformer_lm.wiki103.adaptive", tmp_path / f"mirror-{len(mirror)}")
    assert sorted(os.listdir(tmp_path / "hub")) == ["dict.txt", "model.args", "model.pt"]


def test_a_mirror_without_the_archive_is_named(served, tmp_path, monkeypatch):
    monkeypatch.setenv(published_archives.MIRROR, str(tmp_path))
    with pytest.raises(SystemExit, match=rf"--pretrained transformer_lm.wiki103.adaptive: {published_archives.MIRROR}="
                                         rf"{re.escape(str(tmp_path))} holds no adaptive_lm_wiki103\.v2\.tar\.bz2, the "
                                         r"archive of http://"):
        converts("transformer_lm.wiki103.adaptive", tmp_path / "out")


def test_a_broken_language_model_archive_is_named_and_leaves_nothing_in_the_caches(served, tmp_path):
    with pytest.raises(SystemExit, match=r"truncated\.tar\.bz2 is not a whole tar archive .*download it again"):
        converts("transformer_lm.wiki103.truncated", tmp_path / "out")
    assert not os.listdir(served["fairseq cache"]) and not os.path.exists(served["cache"])
    assert not os.path.exists(tmp_path / "out")


def test_a_language_models_name_whose_archive_holds_a_translation_model_is_refused(served, tmp_path, monkeypatch):
    from examples.recipes.published_layouts import write_archive

    write_archive(str(tmp_path / "mt"), "transformer", "args", ["--encoder-layers", 1, "--decoder-layers", 1,
                                                                "--encoder-embed-dim", 16, "--decoder-embed-dim", 16])
    pack(tmp_path / "mt", served["root"] / "adaptive_lm_wiki103.v2.tar.bz2", top="adaptive_lm_wiki103.v2")
    with pytest.raises(SystemExit, match=r"--pretrained transformer_lm.wiki103.adaptive names a language model of "
                                         r"fairseq's hub, but \S+/model\.pt is the checkpoint of a translation model "
                                         r"\(its task: translation\)"):
        converts("transformer_lm.wiki103.adaptive", tmp_path / "out")


# -- trained stand-ins, through fairseq's commands -------------------------------------------------------------

# The stand-in trained on the suite's LM corpus (40 types): the same architecture at a tiny width
TRAINED_WIKI103 = ["--decoder-layers", 2, "--decoder-embed-dim", 32, "--decoder-ffn-embed-dim", 64,
                   "--decoder-attention-heads", 4, "--adaptive-input-cutoff", "10,20", "--adaptive-softmax-cutoff",
                   "10,20", "--tokens-per-sample", 64]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpora):
    """transformer_lm.wiki103.adaptive's stand-in trained for 8 updates on the suite's LM corpus, packed as the
    published archive in a mirror of fairseq's server (FAIRSEQ_FWP_MIRROR)."""
    from examples.recipes.published_layouts import train_lm_archive

    root = tmp_path_factory.mktemp("trained-lm")
    train_lm_archive(str(root / "adaptive_lm_wiki103.v2"), corpora["lm"], root / "ckpt", TRAINED_WIKI103, updates=8)
    (root / "mirror").mkdir()
    pack(root / "adaptive_lm_wiki103.v2", root / "mirror" / "adaptive_lm_wiki103.v2.tar.bz2")
    return {"folder": root / "adaptive_lm_wiki103.v2", "mirror": root / "mirror", "bin": corpora["lm"]}


def perplexity(output):
    return float(re.search(r"Perplexity: ([0-9.]+)", output).group(1))


@pytest.mark.slow
def test_the_wiki103_lm_converts_by_its_hub_name_scores_finetunes_with_carry_over_and_scores_again(trained, tmp_path):
    import subprocess
    import sys

    from examples.recipes.commands import PLUGIN_DIR, fairseq
    from helpers import ROOT

    out = tmp_path / "wiki103-delta"
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), **{published_archives.MIRROR: str(trained["mirror"])},
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    converted = subprocess.run([sys.executable, "-m", "fairseq_fwp.uptrain", "--pretrained",
                                "transformer_lm.wiki103.adaptive", "--out", out, "--data", trained["bin"], "--",
                                "--fwp-update-rule", "delta"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert converted.returncode == 0, converted.stderr[-3000:]
    scored = {task: perplexity(fairseq("eval-lm", trained["bin"], "--user-dir", PLUGIN_DIR, "--path", out / "model.pt",
                                       "--gen-subset", "test", "--task", task, "--tokens-per-sample", 64,
                                       "--batch-size", 1)) for task in ("language_modeling", "fwp_stream_lm")}
    assert all(1 < value < 1000 for value in scored.values()), scored  # a perplexity, before any update
    command = converted.stderr.split("next, finetune it")[1].split(":\n  ", 1)[1].splitlines()[0]
    assert "--task fwp_stream_lm --tokens-per-sample 64 --batch-size 6" in command  # within its 64 positions
    finetuned = subprocess.run(["bash", "-c", command + " --max-update 2 --num-workers 0"], capture_output=True,
                               text=True, cwd=tmp_path, env=env)
    log = finetuned.stdout + finetuned.stderr
    assert finetuned.returncode == 0 and "done training" in log, log[-3000:]
    assert "was saved from another model" not in log
    assert "adaptive_loss" in command and "num_updates 2" in log
    after = fairseq("eval-lm", trained["bin"], "--user-dir", PLUGIN_DIR, "--path", out / "finetuned" /
                    "checkpoint_last.pt", "--gen-subset", "test", "--task", "fwp_stream_lm", "--tokens-per-sample", 64,
                    "--batch-size", 1)
    assert 1 < perplexity(after) < 1000


@pytest.mark.slow
def test_the_long_context_protocols_are_fairseq_eval_lms(trained, tmp_path):
    """examples/recipes/long_context.py's blocks and context windows score as fairseq-eval-lm does, and its
    carried state through the whole split as fwp_stream_lm with one stream does."""
    import json

    from examples.recipes import long_context
    from examples.recipes.commands import PLUGIN_DIR, fairseq

    convert_pretrained(str(trained["folder"]), str(tmp_path / "delta"), ["--fwp-update-rule", "delta"])
    original, converted = trained["folder"] / "model.pt", tmp_path / "delta" / "model.pt"
    long_context.main(["--data", str(trained["bin"]), "--model", f"original={original}", "--model",
                       f"converted={converted}", "--contexts", "64", "512", "--segment", "32", "--stride", "16",
                       "--out", str(tmp_path / "context")])
    results = json.loads((tmp_path / "context" / "context.json").read_text())["models"]

    def eval_lm(checkpoint, *flags):
        return perplexity(fairseq("eval-lm", trained["bin"], "--user-dir", PLUGIN_DIR, "--path", checkpoint,
                                  "--gen-subset", "test", "--batch-size", 4, *flags))

    assert results["original"]["carried"]["64"]["perplexity"] == pytest.approx(
        eval_lm(original, "--tokens-per-sample", 64), rel=2e-3)  # blocks of 64
    assert results["original"]["sliding"]["64"]["perplexity"] == pytest.approx(
        eval_lm(original, "--tokens-per-sample", 64, "--context-window", 48), rel=2e-3)
    assert results["converted"]["carried"]["512"]["perplexity"] == pytest.approx(  # the split: 488 tokens
        eval_lm(converted, "--task", "fwp_stream_lm", "--tokens-per-sample", 32, "--batch-size", 1), rel=2e-3)
    assert results["original"]["carried"]["512"] is None and results["original"]["sliding"]["512"] is None
    assert all(results["converted"][protocol][context] is not None for protocol in results["converted"]
               for context in ("64", "512"))
    assert (tmp_path / "context" / "context.png").stat().st_size > 10_000


@pytest.fixture(scope="module")
def wmt19_mirror(tmp_path_factory, corpora):
    """A stand-in of transformer_lm.wmt19.*: moses-tokenised text, fastBPE codes learned on it, a Transformer LM
    with learned positions and shared input and output embeddings, trained for 5 updates, packed under the
    three published archives' names in a mirror."""
    from examples.recipes import bpe, text
    from examples.recipes.commands import fairseq
    from examples.recipes.published_layouts import train_lm_archive

    root = tmp_path_factory.mktemp("wmt19")
    codes = root / "bpecodes"
    bpe.learn("fastbpe", [os.path.join(corpora["raw_lm"], "train.txt")], str(codes), merges=30)
    for split in ("train", "valid", "test"):
        lines = text.read_lines(os.path.join(corpora["raw_lm"], f"{split}.txt"))
        text.write_lines(root / f"{split}.bpe", bpe.apply("fastbpe", str(codes), lines))
    fairseq("preprocess", "--only-source", "--trainpref", root / "train.bpe", "--validpref", root / "valid.bpe",
            "--testpref", root / "test.bpe", "--destdir", root / "bin", "--workers", 1)
    train_lm_archive(str(root / "wmt19.en"), root / "bin", root / "ckpt", [
        "--decoder-layers", 2, "--decoder-embed-dim", 32, "--decoder-ffn-embed-dim", 64, "--decoder-attention-heads",
        4, "--decoder-learned-pos", "--share-decoder-input-output-embed", "--tokens-per-sample", 64],
        updates=5, arch="transformer_lm_big", codes=str(codes))
    (root / "mirror").mkdir()
    for language in ("en", "de", "ru"):
        pack(root / "wmt19.en", root / "mirror" / f"wmt19.{language}.tar.bz2", top=f"wmt19.{language}")
    return {"mirror": root / "mirror", "bin": root / "bin"}


@pytest.mark.slow
@pytest.mark.parametrize("language", ["en", "de", "ru"])
def test_a_wmt19_lm_converts_and_reads_text_through_from_pretrained(wmt19_mirror, tmp_path, monkeypatch, language):
    from fairseq.models.transformer_lm import TransformerLanguageModel

    monkeypatch.setenv(published_archives.MIRROR, str(wmt19_mirror["mirror"]))
    monkeypatch.setattr(published_archives, "CACHE", str(tmp_path / "cache"))
    out = tmp_path / "delta"
    _, model_args = convert_pretrained(f"transformer_lm.wmt19.{language}", str(out), ["--fwp-update-rule", "delta"])
    assert sorted(os.listdir(out)) == ["bpecodes", "dict.txt", "model.args", "model.pt"]
    assert "--tokenizer moses --bpe fastbpe" in " ".join(model_args)
    lm = TransformerLanguageModel.from_pretrained(str(out))  # moses and fastBPE from the converted checkpoint
    assert isinstance(lm.models[0], FastWeightTransformerLanguageModel)
    assert type(lm.tokenizer).__name__ == "MosesTokenizer" and type(lm.bpe).__name__ == "fastBPE"
    torch.manual_seed(0)
    # the lengths count the prompt's 8 subwords
    sampled = lm.sample("the cat sees", sampling=True, sampling_topk=5, min_len=12, max_len_b=20)
    assert sampled.startswith("the cat sees") and len(sampled.split()) > 3
    # the converted checkpoint's task reads the prompt in one call, and samples what language_modeling's forcing does
    from fairseq.hub_utils import GeneratorHubInterface
    from fairseq.tasks.language_modeling import LanguageModelingTask

    assert type(lm.task).__name__ == "FastWeightLanguageModelingTask"
    forcing = GeneratorHubInterface(lm.cfg, LanguageModelingTask(lm.task.args, lm.task.dictionary), lm.models)
    torch.manual_seed(0)
    assert forcing.sample("the cat sees", sampling=True, sampling_topk=5, min_len=12, max_len_b=20) == sampled
    scores = lm.score("the cat sees a tree alone .")["positional_scores"]
    assert len(scores) > 7 and torch.all(scores < 0)  # a log-probability for each subword and </s>


@pytest.mark.slow
def test_a_learned_position_lm_finetunes_on_segments_shorter_than_its_positions(wmt19_mirror, tmp_path, monkeypatch):
    """fwp_stream_lm takes the model's --max-target-positions from model.args: a learned positional embedding
    keeps its rows (64) while the segments are shorter (16)."""
    import subprocess
    import sys

    monkeypatch.setenv(published_archives.MIRROR, str(wmt19_mirror["mirror"]))
    monkeypatch.setattr(published_archives, "CACHE", str(tmp_path / "cache"))
    out = tmp_path / "delta"
    _, model_args = convert_pretrained("transformer_lm.wmt19.en", str(out), ["--fwp-update-rule", "delta"])
    command = finetune_command(str(out), str(wmt19_mirror["bin"]), model_args)
    finetuned = subprocess.run(["bash", "-c", f"{command} --tokens-per-sample 16 --max-update 2 --num-workers 0"],
                               capture_output=True, text=True, cwd=tmp_path, env=dict(
                                   os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]))
    log = finetuned.stdout + finetuned.stderr
    assert finetuned.returncode == 0 and "done training" in log, log[-3000:]
    state = torch.load(out / "finetuned" / "checkpoint_last.pt", weights_only=False)["model"]
    assert state["decoder.embed_positions.weight"].shape[0] == 64 + 2  # its positions, padding and the pad's row


@pytest.mark.slow
def test_the_wikitext103_uptraining_recipe_runs_every_step_on_the_stand_in(trained, corpora, tmp_path, capfd):
    """prepare (with the archive's dictionary), convert (attention transfer included), finetune, evaluate: each
    step reading what the one before wrote, on the stand-in of transformer_lm.wiki103.adaptive (the steps in
    this process, their fairseq commands as the recipe runs them)."""
    import json

    from examples.recipes import wikitext103_uptraining

    raw = tmp_path / "raw"
    raw.mkdir()
    for split in ("train", "valid", "test"):
        os.symlink(os.path.join(corpora["raw_lm"], f"{split}.txt"), raw / f"wiki.{split}.tokens")
    data, model, ckpt = tmp_path / "data", tmp_path / "delta", tmp_path / "ckpt"

    def step(*argv):
        wikitext103_uptraining.main([str(a) for a in argv])
        captured = capfd.readouterr()
        return captured.out + captured.err

    step("prepare", "--raw-dir", raw, "--out", data, "--pretrained", trained["folder"], "--workers", 1)
    assert (data / "bin" / "dict.txt").read_text() == (trained["folder"] / "dict.txt").read_text()
    converted = step("convert", "--data", data, "--row", "delta", "--out", model, "--attention-transfer-steps", 2)
    assert converted.count("-m fairseq_fwp.uptrain") == 1 and "attention transfer 2/2" in converted
    step("finetune", "--data", data, "--model", model, "--save-dir", ckpt, "--updates", 2, "--", "--num-workers", 0)
    log = (ckpt / "train.log").read_text()
    assert "done training" in log and "was saved from another model" not in log and "fwp_stream_lm" in log
    assert "'update_freq': [8]" in log  # 48 streams a step, 6 at a time
    for which in (["--checkpoint", ckpt / "checkpoint_last.pt"],
                  ["--original", "--", "--tokens-per-sample", 64, "--context-window", 32]):  # the stand-in's 64
        output = step("evaluate", "--data", data, *which)
        result = json.loads(output[output.index("{"):output.rindex("}") + 1])
        assert result["tokens"] > 400 and result["perplexity"] > 1 and result["reported"]
