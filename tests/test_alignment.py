"""Alignments from fast weights, end to end: fairseq-generate --print-alignment (hard and soft) prints what the
model's exact encoder-decoder attention weights give (modules/source_attention.py), fairseq-interactive's
--replace-unk replaces each <unk> by the source word aligned to it, through an alignment dictionary, and a model
that has no source to align to, or a generator that cannot, is refused naming --print-alignment."""
import re

import pytest
import torch

pytest.importorskip("fairseq")

pytestmark = pytest.mark.slow  # fairseq's command-line tools


@pytest.fixture(scope="module")
def translation_model(corpora, tmp_path_factory):
    from examples.recipes.pipeline import train_translation

    folder = tmp_path_factory.mktemp("aligned")
    train_translation(corpora["mt"], folder, max_update=3)
    return folder / "checkpoint_last.pt"


def printed(output, prefix):
    return {int(i): text for i, text in re.findall(rf"^{prefix}-(\d+)\t(.*)$", output, re.M)}


def exact_attention(checkpoint, data, source, hypothesis):
    """The last decoder layer's encoder-decoder attention, averaged over heads, of the model's teacher-forced forward
    of `hypothesis` (its tokens, </s> last) after `source`: [target length, source length]."""
    from fairseq import checkpoint_utils

    import fairseq_fwp  # noqa: F401  (the plugin's fixes: fairseq's checkpoints load under torch >= 2.6)
    from examples.recipes.commands import PLUGIN_DIR

    [model], _ = checkpoint_utils.load_model_ensemble([str(checkpoint)], arg_overrides={"data": str(data),
                                                                                        "user_dir": PLUGIN_DIR})
    model.eval()
    eos = model.decoder.dictionary.eos()
    prev = torch.cat([hypothesis.new_tensor([eos]), hypothesis[:-1]]).unsqueeze(0)
    with torch.no_grad():
        attn = model(source.unsqueeze(0), torch.tensor([source.numel()]), prev)[1]["attn"][0]
    return attn[0]


@pytest.mark.parametrize("kind", ["hard", "soft"])
def test_print_alignment_prints_the_exact_weights_alignment(corpora, translation_model, kind):
    from fairseq import utils
    from fairseq.data import Dictionary

    from examples.recipes.commands import PLUGIN_DIR, fairseq

    output = fairseq("generate", corpora["mt"], "--user-dir", PLUGIN_DIR, "--path", translation_model,
                     "--gen-subset", "test", "--beam", 2, "--max-len-b", 6, "--batch-size", 8,
                     "--print-alignment", kind)
    sources, hypotheses, alignments = printed(output, "S"), printed(output, "H"), printed(output, "A")
    assert len(alignments) == len(hypotheses) == 43
    src_dict = Dictionary.load(str(corpora["mt"] / "dict.src.txt"))
    tgt_dict = Dictionary.load(str(corpora["mt"] / "dict.tgt.txt"))
    for i in list(alignments)[:5]:
        source = src_dict.encode_line(sources[i], add_if_not_exist=False).long()
        hypothesis = tgt_dict.encode_line(hypotheses[i].split("\t", 1)[1], add_if_not_exist=False).long()
        attn = exact_attention(translation_model, corpora["mt"], source, hypothesis)
        if kind == "hard":
            want = " ".join(f"{s}-{t}" for s, t in utils.extract_hard_alignment(attn, source, hypothesis,
                                                                                 tgt_dict.pad(), tgt_dict.eos()))
            assert alignments[i] == want
        else:
            rows = [[float(p) for p in row.split(",")] for row in alignments[i].split()]
            torch.testing.assert_close(torch.tensor(rows), attn.float(), rtol=0, atol=2e-6)
            torch.testing.assert_close(torch.tensor(rows).sum(1), torch.ones(len(rows)), rtol=0, atol=1e-3)


def test_replace_unk_replaces_each_unk_by_its_aligned_source_word(corpora, translation_model, tmp_path):
    """fairseq-interactive --replace-unk DICT --print-alignment, with every output an <unk> (--unkpen -100): each
    output word is the dictionary's entry of the source word its alignment pair names."""
    from examples.recipes.commands import PLUGIN_DIR, fairseq

    lines = [" ".join(line.split()[:4]) for line in open(f"{corpora['raw_mt']}/test.src").readlines()[:3]]
    (tmp_path / "input.txt").write_text("".join(f"{line}\n" for line in lines))
    words = {word for line in lines for word in line.split()}
    (tmp_path / "align.dict").write_text("".join(f"{word} X_{word}\n" for word in sorted(words)))
    output = fairseq("interactive", corpora["mt"], "--user-dir", PLUGIN_DIR, "--path", translation_model,
                     "--input", tmp_path / "input.txt", "--beam", 2, "--max-len-b", 4, "--print-alignment",
                     "--replace-unk", tmp_path / "align.dict", "--unkpen", -100)
    hypotheses, alignments = printed(output, "H"), printed(output, "A")
    assert len(hypotheses) == 3
    for i, line in enumerate(lines):
        out = hypotheses[i].split("\t", 1)[1].split()
        source_of = {int(t): int(s) for s, t in (pair.split("-") for pair in alignments[i].split())}
        assert out and out == [f"X_{line.split()[source_of[t]]}" for t in range(len(out))]


def test_alignment_options_that_cannot_run_are_refused_naming_them(corpora, translation_model, tmp_path):
    from examples.recipes.commands import PLUGIN_DIR, completed
    from examples.recipes.pipeline import train_lm

    (tmp_path / "input.txt").write_text("s3 s5\n")
    status, output = completed("interactive", corpora["mt"], "--user-dir", PLUGIN_DIR, "--path", translation_model,
                               "--input", tmp_path / "input.txt", "--replace-unk")
    assert status == 1 and "--replace-unk replaces each <unk> by the source word aligned to it" in output
    train_lm(corpora["lm"], tmp_path / "lm", max_update=1, task="fwp_language_modeling")
    status, output = completed("generate", corpora["lm"], "--user-dir", PLUGIN_DIR, "--path",
                               tmp_path / "lm" / "checkpoint_last.pt", "--task", "fwp_language_modeling",
                               "--gen-subset", "test", "--prefix-size", 2, "--print-alignment")
    assert status == 1 and "--print-alignment" in output.strip().splitlines()[-1]
    assert not re.search(r"^H-", output, re.M)


@pytest.mark.parametrize("flags", [("--fwp-sites", "self"), ("--fwp-feature-map", "softmax")])
@pytest.mark.parametrize("layer,heads", [(None, None), (0, 1), (1, 3)])
def test_a_softmax_cross_attention_aligns_with_fairseqs_own_weights(flags, layer, heads):
    """Where the encoder-decoder attention is fairseq's MultiheadAttention, the alignment (a teacher-forced forward
    with --alignment-layer and --alignment-heads) is the weights that module computes, averaged over the heads
    chosen (the last layer's and all heads by default), as for fairseq's Transformer."""
    from fairseq.modules import MultiheadAttention

    from helpers import build_translation_model

    model, d = build_translation_model(*flags)
    chosen = len(model.decoder.layers) - 1 if layer is None else layer
    attention = model.decoder.layers[chosen].encoder_attn
    assert type(attention) is MultiheadAttention
    seen = []
    attention.register_forward_hook(lambda module, args, kwargs, out: seen.append(out[1]), with_kwargs=True)
    torch.manual_seed(1)
    source, target = torch.randint(4, len(d), (2, 7)), torch.randint(4, len(d), (2, 5))
    with torch.no_grad():
        _, extra = model(source, torch.tensor([7, 7]), target, alignment_layer=layer, alignment_heads=heads)
    [per_head] = seen  # [heads, rows, target, source]: need_head_weights, the layer fairseq aligns with
    want = per_head[:heads].mean(0) if heads is not None else per_head.mean(0)
    assert extra["attn"][0].shape == (2, 5, 7)
    torch.testing.assert_close(extra["attn"][0], want, rtol=0, atol=0)
