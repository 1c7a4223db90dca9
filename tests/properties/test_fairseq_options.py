"""The option contract: every fairseq option meets the plugin's models, honoured or refused by name, never a
traceback. Each scenario (a fairseq tool on a trained model: fairseq_options.SCENARIOS) runs with a few of the
tool's own options drawn from its parser (fairseq_options.py), through the preloaded server, and must run, or be
refused before anything is generated with a message naming one of the options drawn."""
import re

import pytest
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from conftest import assert_reached, examples, own_examples
from fairseq_options import TIME_LIMIT, drawable, tool_options, values, verdict

pytest.importorskip("fairseq")

# (tool, its arguments on the plugin's model, and on stock fairseq's of the same shape: the arguments' {data},
# {model}, {input} and {run} are the scenario's files)
SCENARIOS = {
    "generate translation": ("generate", "{mt} --path {mt_model} --task translation --gen-subset test --batch-size 4 "
                                         "--beam 2 --max-len-b 5", {"mt_model": "mt_stock"}),
    "generate lm": ("generate", "{lm} --path {lm_model} --task fwp_language_modeling --gen-subset test "
                                "--sample-break-mode eos --prefix-size 2 --batch-size 4 --beam 2 --max-len-b 4",
                    {"lm_model": "lm_stock", "fwp_language_modeling": "language_modeling"}),
    "interactive translation": ("interactive", "{mt} --path {mt_model} --input {mt_input} --beam 2 --max-len-b 5",
                                {"mt_model": "mt_stock"}),
    "interactive lm": ("interactive", "{lm} --path {lm_model} --task fwp_language_modeling --input {lm_input} "
                                      "--beam 2 --max-len-b 4",
                       {"lm_model": "lm_stock", "fwp_language_modeling": "language_modeling"}),
    "eval-lm": ("eval-lm", "{lm} --path {lm_model} --gen-subset test --tokens-per-sample 32 --batch-size 4",
                {"lm_model": "lm_stock"}),
    "validate translation": ("validate", "{mt} --path {mt_model} --task translation --batch-size 8",
                             {"mt_model": "mt_stock"}),
    "train translation": ("train", "{mt} --arch fwp_transformer_tiny --optimizer adam --lr 0.001 --max-tokens 500 "
                                   "--max-update 2 --no-save --save-dir {run}",
                          {"fwp_transformer_tiny": "transformer " + "{stock_mt_shape}"}),
    "train lm": ("train", "{lm} --task language_modeling --arch fwp_lm_tiny --optimizer adam --lr 0.001 "
                          "--max-tokens 256 --tokens-per-sample 32 --max-update 2 --no-save --save-dir {run}",
                 {"fwp_lm_tiny": "transformer_lm " + "{stock_lm_shape}"}),
}
# stock fairseq's models of the tiny architectures' shapes
STOCK_MT_SHAPE = ("--encoder-layers 2 --decoder-layers 2 --encoder-embed-dim 64 --decoder-embed-dim 64 "
                  "--encoder-ffn-embed-dim 128 --decoder-ffn-embed-dim 128 --encoder-attention-heads 4 "
                  "--decoder-attention-heads 4")
STOCK_LM_SHAPE = "--decoder-layers 2 --decoder-embed-dim 64 --decoder-ffn-embed-dim 128 --decoder-attention-heads 4"


class Files(dict):
    """The scenarios' files; stock fairseq's models trained when a failure first asks for them (files.stock)."""

    def __init__(self, root, corpora, **files):
        super().__init__(files)
        self.root, self.corpora = root, corpora

    def __missing__(self, key):
        from examples.recipes.pipeline import train_lm, train_translation

        if key == "mt_stock":
            train_translation(self.corpora["mt"], self.root / key, "--arch", "transformer", *STOCK_MT_SHAPE.split(),
                              max_update=1)
        elif key == "lm_stock":
            train_lm(self.corpora["lm"], self.root / key, "--arch", "transformer_lm", *STOCK_LM_SHAPE.split(),
                     max_update=1)
        else:
            raise KeyError(key)
        self[key] = self.root / key / "checkpoint_last.pt"
        return self[key]


@pytest.fixture(scope="module")
def files(corpora, tmp_path_factory):
    """The scenarios' files: the corpora, a translation model and an LM trained for an update (and stock fairseq's
    of the same shapes, where asked for), a few input lines."""
    from examples.recipes.pipeline import train_lm, train_translation

    root = tmp_path_factory.mktemp("option-contract")
    train_translation(corpora["mt"], root / "mt", max_update=1)
    train_lm(corpora["lm"], root / "lm", max_update=1, task="fwp_language_modeling")
    for name, raw in (("mt", f"{corpora['raw_mt']}/test.src"), ("lm", f"{corpora['raw_lm']}/test.txt")):
        with open(raw) as text:
            (root / f"{name}.input").write_text("".join(" ".join(line.split()[:5]) + "\n" for line in text.readlines()[:3]))
    return Files(root, corpora, mt=corpora["mt"], lm=corpora["lm"], mt_model=root / "mt" / "checkpoint_last.pt",
                 lm_model=root / "lm" / "checkpoint_last.pt", mt_input=root / "mt.input", lm_input=root / "lm.input",
                 run=root / "run", stock_mt_shape=STOCK_MT_SHAPE, stock_lm_shape=STOCK_LM_SHAPE)


def scenario_args(scenario, files, stock=False):
    """(the tool, its arguments) of a scenario, on the plugin's model or on stock fairseq's."""
    from examples.recipes.commands import PLUGIN_DIR

    tool, args, on_stock = SCENARIOS[scenario]
    if stock:
        for plugin, replacement in on_stock.items():
            args = args.replace("{" + plugin + "}", "{" + replacement + "}") if "{" + plugin + "}" in args else \
                args.replace(plugin, replacement)
    return tool, (*args.format_map(files).split(), "--user-dir", PLUGIN_DIR)


def fairseqs_own(output, stock_output):
    """Whether a failure is stock fairseq's too: the same last line, paths and numbers aside."""
    def last(text):
        lines = [line for line in text.strip().splitlines() if line.strip()]
        return re.sub(r"/\S+|\d+(\.\d+)?", "#", lines[-1]) if lines else ""
    return last(output) == last(stock_output)


@pytest.mark.slow
@pytest.mark.options
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_fairseq_option_is_honoured_or_refused_by_name(scenario, files):
    from examples.recipes.commands import completed

    tool, args = scenario_args(scenario, files)
    options = drawable(tool_options(tool, args))
    checked = []

    @own_examples(f"fairseq-options-{scenario}")
    @settings(max_examples=examples(3))
    @given(data=st.data())
    def holds(data):
        chosen = data.draw(st.lists(st.sampled_from(options), min_size=1, max_size=3, unique_by=lambda o: o.flag),
                           label="options")
        given = {option.flag: data.draw(values(option, files), label=option.flag) for option in chosen}
        words = [word for option_words in given.values() for word in option_words]
        note(f"reproduce: fairseq-{tool} {' '.join(map(str, args))} {' '.join(words)}")
        status, output = completed(tool, *args, *words, timeout=TIME_LIMIT)
        outcome = verdict(status, output, [option.flag for option in chosen])
        if outcome.startswith("failed"):  # stock fairseq's own failure, on its own model, is not the plugin's
            stock_words = [word for flag, option_words in given.items() if not flag.startswith("--fwp-")
                           for word in option_words]  # stock fairseq takes no --fwp-* option
            stock_status, stock_output = completed(tool, *scenario_args(scenario, files, stock=True)[1],
                                                   *stock_words, timeout=TIME_LIMIT)
            if stock_status > 0 and fairseqs_own(output, stock_output):
                outcome = f"fairseq's own: {' '.join(words)}"
                note(outcome)
        event(outcome if not outcome.startswith("fairseq's own") else "fairseq's own")
        assert not outcome.startswith("failed"), f"{' '.join(words)}: {outcome}\n{output[-3000:]}"
        checked.append(outcome)

    holds()
    assert_reached(checked, f"fairseq-{tool}'s options in {scenario}", minimum=1)


def test_a_verdict_counts_a_refusal_only_where_it_names_a_drawn_option_before_any_output():
    flags = ["--beam", "--nbest"]
    assert verdict(0, "", flags) == "ran"
    assert verdict(1, "...\nOptionRefusal: --beam 0: a search keeps at least one hypothesis", flags) == "refused"
    assert verdict(1, "Traceback (most recent call last):\nValueError: beam must be positive", flags) == "refused"
    assert verdict(1, "error: unrecognized arguments: --lenpen", flags).startswith("failed")
    assert verdict(1, "Traceback (most recent call last):\nKeyError: 'beam'", flags).startswith("failed: a crash")
    assert verdict(1, "H-0\t-1.2\ta b\nValueError: --nbest 3 is more than --beam 2", flags).startswith("failed")
    assert verdict(-9, "", flags).startswith("failed: ended by signal 9")
    assert fairseqs_own("x\nValueError: /tmp/a/b.pt has 3 rows", "y\nValueError: /tmp/c.pt has 5 rows")
    assert not fairseqs_own("ValueError: one", "ValueError: another")


def generated(output):
    """What fairseq-generate printed per sentence: {(kind, id): (words, numbers)}, each line's numbers apart (a
    softmax read in another order may differ in the printed numbers' last digit)."""
    lines = {}
    for kind, i, rest in re.findall(r"^([SHPDTA])-(\d+)\t(.*)$", output, re.M):
        fields = rest.replace(",", " ").split()
        numbers = [float(f) for f in fields if re.fullmatch(r"-?(\d+\.\d*|inf)", f)]
        lines[kind, int(i)] = ([f for f in fields if not re.fullmatch(r"-?(\d+\.\d*|inf)", f)], numbers)
    return lines


@pytest.fixture(scope="module")
def softmax_baseline(files, tmp_path_factory):
    """Stock fairseq's translation model converted into the plugin's architecture with softmax attention: the same
    weights, the plugin's model."""
    from fairseq_fwp.uptraining.conversion import convert

    out = tmp_path_factory.mktemp("softmax-baseline") / "checkpoint.pt"
    convert(str(files["mt_stock"]), str(out), [str(files["mt"]), "--task", "translation", "--arch",
                                               "fwp_transformer_tiny", "--fwp-feature-map", "softmax"])
    return out


@pytest.mark.slow
@pytest.mark.options
def test_the_softmax_baseline_generates_what_stock_fairseq_generates_under_every_option(files, softmax_baseline):
    """Where fairseq defines the result: with the same weights, the plugin's softmax baseline and stock fairseq's
    Transformer give fairseq-generate the same verdict and, where it runs, the same sentences, hypotheses,
    alignments and scores (to the printed digits), whatever generation options are drawn."""
    from examples.recipes.commands import completed

    tool, args = scenario_args("generate translation", files, stock=True)
    options = drawable(tool_options(tool, args))
    checked = []

    @own_examples("fairseq-options-softmax-baseline")
    @settings(max_examples=examples(3))
    @given(data=st.data())
    def holds(data):
        chosen = data.draw(st.lists(st.sampled_from(options), min_size=1, max_size=3, unique_by=lambda o: o.flag),
                           label="options")
        words = [word for option in chosen for word in data.draw(values(option, files), label=option.flag)]
        plugin_args = [str(softmax_baseline) if str(a) == str(files["mt_stock"]) else a for a in args]
        note(f"reproduce: fairseq-generate {' '.join(map(str, plugin_args))} {' '.join(words)}")
        status, output = completed(tool, *plugin_args, *words, timeout=TIME_LIMIT)
        stock_status, stock_output = completed(tool, *args, *words, timeout=TIME_LIMIT)
        outcome = verdict(status, output, [option.flag for option in chosen])
        event(outcome.split(":")[0])
        assert (status == 0) == (stock_status == 0), f"plugin {outcome}; stock:\n{stock_output[-2000:]}"
        if status == 0:
            ours, theirs = generated(output), generated(stock_output)
            assert ours.keys() == theirs.keys()
            for key in ours:
                assert ours[key][0] == theirs[key][0], key
                assert ours[key][1] == pytest.approx(theirs[key][1], abs=2.5e-4), key
        checked.append(outcome)

    holds()
    assert_reached(checked, "the softmax baseline against stock fairseq", minimum=1)
