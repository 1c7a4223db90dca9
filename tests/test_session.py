"""Sessions (fairseq_fwp/session.py): each turn reads only its input, from the state the turns before left, and
generates what generating with the whole history as one prompt generates (every earlier input and kept reply,
each reply with the </s> that ended it, then the input): the same tokens, positional scores and scores, in
float64, for every family of rules and hybrids with softmax layers."""
import os
import sys

import pytest
import torch

pytest.importorskip("fairseq")

from helpers import (ROOT, assert_same_hypotheses, assert_turns_equal_the_whole_history, build_lm_model,  # noqa: E402
                     session_turn, softmax_in_the_models_dtype)
from test_generation import FAMILIES  # noqa: E402
from fairseq_fwp.session import History  # noqa: E402

SEARCHES = {"greedy": dict(beam_size=1), "beam 3": dict(beam_size=3), "beam 3, lenpen 2": dict(beam_size=3,
                                                                                                len_penalty=2.0)}
LIMITS = dict(max_len_b=5)  # the reply's limit: the input is read whole


@pytest.fixture(autouse=True)
def float64_scores():
    with softmax_in_the_models_dtype():
        yield


def inputs(d, lengths=(5, 3, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(d.nspecial, len(d), (n,), generator=g) for n in lengths]


def hub_of(model, d):
    """fairseq's hub interface to `model` (fwp_language_modeling's, with the hub's default generation config)."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.hub_utils import GeneratorHubInterface

    from fairseq_fwp.tasks.language_modeling import FastWeightLanguageModelingTask
    from helpers import parse_args

    args = parse_args("fwp_language_modeling", "fwp_lm_tiny")
    return GeneratorHubInterface(convert_namespace_to_omegaconf(args), FastWeightLanguageModelingTask(args, d),
                                 [model])


@pytest.mark.parametrize("search_name", SEARCHES)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_turn_generates_what_the_whole_history_as_one_prompt_generates(family, search_name):
    model, d = build_lm_model(*FAMILIES[family], seed=1)
    model.double()
    history = History([model], d)
    assert_turns_equal_the_whole_history(model, d, history, inputs(d), **SEARCHES[search_name], **LIMITS)


@pytest.mark.parametrize("reply_tokens", [1, 2])
def test_replies_of_one_token_and_more_are_read_into_the_state(reply_tokens):
    """Replies as short as the limit allows (it forces </s> after them): each is read into the state before the
    next turn, its one token included."""
    model, d = build_lm_model("--fwp-update-rule", "delta", seed=1)
    model.double()
    turns = inputs(d)
    kept = assert_turns_equal_the_whole_history(model, d, History([model], d), turns, beam_size=2,
                                                max_len_b=reply_tokens, min_len=reply_tokens)
    assert len(kept) == sum(len(tokens) + reply_tokens + 1 for tokens in turns)  # inputs, replies, </s>


@pytest.mark.parametrize("limits", [dict(max_len_b=3), dict(max_len_a=0.5, max_len_b=1)], ids=["b", "a and b"])
def test_an_input_longer_than_the_limit_is_read_whole_and_the_limit_bounds_the_reply(limits):
    """--max-len-a/b bound a turn's reply (at most a n + b tokens after an input of n), never its input: an input
    past the limit is read whole, as the whole history as one prompt reads it."""
    model, d = build_lm_model("--fwp-update-rule", "gated-delta", seed=2)
    model.double()
    turns = inputs(d, (40, 3, 25))
    history = History([model], d)
    kept = assert_turns_equal_the_whole_history(model, d, history, turns, beam_size=2, **limits)
    replies = len(kept) - sum(len(tokens) for tokens in turns) - len(turns)
    assert 0 < replies <= sum(int(limits.get("max_len_a", 0) * len(t) + limits["max_len_b"]) for t in turns)


def test_min_len_is_the_replys_own_minimum():
    """--min-len in a session: each reply's own, whatever came before it in the history."""
    model, d = build_lm_model(seed=3)
    model.double()
    history, lengths = History([model], d), []
    for tokens in inputs(d, (4, 6, 2, 5), seed=2):
        hypothesis = session_turn(model, d, history, tokens, beam_size=2, min_len=4, max_len_b=6)[0][0]
        lengths.append(len(hypothesis["tokens"]) - len(tokens) - 1)
    assert min(lengths) >= 4, lengths
    assert_turns_equal_the_whole_history(model, d, History([model], d), inputs(d, (4, 6, 2, 5), seed=2), beam_size=2,
                                         min_len=4, max_len_b=6)


def test_the_hubs_defaults_read_a_long_input_whole():
    """The hub's defaults (--max-len-a 0 --max-len-b 200) and a 250-token piece of a document: read whole, then
    the reply."""
    from fairseq_fwp.session import Session

    model, d = build_lm_model(seed=4)
    session = Session(hub_of(model, d))
    session.reply(" ".join(f"w{i % 30}" for i in range(250)), max_len_b=3)
    assert session.history.tokens_read >= 1 + 250 + 1


def test_a_model_that_starts_from_bos_reads_the_replies_end_between_turns():
    """With --add-bos-token the generation starts from <s>: a later turn starts from the </s> that ended the
    reply before, as the whole history as one prompt reads it."""
    model, d = build_lm_model("--add-bos-token", seed=1)
    model.double()
    history = History([model], d)
    assert_turns_equal_the_whole_history(model, d, history, inputs(d), beam_size=2, bos_token=d.bos(), **LIMITS)


def test_sampling_in_a_session_scores_with_the_whole_history():
    """Sampling draws this turn's random numbers only (the whole history as one prompt would draw one set per
    position of it first): its tokens are another sample, scored as with the whole history."""
    from helpers import teacher_forced

    model, d = build_lm_model("--fwp-update-rule", "gated-delta", "--fwp-short-conv", "3", seed=2)
    model.double()
    history, kept = History([model], d), torch.zeros(0, dtype=torch.long)
    for tokens in inputs(d):
        hypotheses = session_turn(model, d, history, tokens, seed=5, sampling=True, sampling_topk=4, beam_size=2, **LIMITS)[0]
        for hypothesis in hypotheses:
            want = teacher_forced(model, d, torch.cat([kept, hypothesis["tokens"]]))[len(kept):]
            torch.testing.assert_close(hypothesis["positional_scores"], want, rtol=0, atol=1e-9)
        kept = torch.cat([kept, hypotheses[0]["tokens"]])


# -- refused before any work, the session as it was ---------------------------------------------------------


def assert_refused_before_any_work(model, d, history, tokens, match, **options):
    """The turn raises SessionRefusal matching `match` without a decoder call, and the history is as it was."""
    from fairseq_fwp.session import SessionRefusal

    import re

    read, states, calls = history.tokens_read, history.states, []
    decoder_forward = type(model.decoder).forward
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(model.decoder), "forward", lambda *args, **kwargs: (calls.append(1),
                                                                                decoder_forward(*args, **kwargs))[1])
        try:
            session_turn(model, d, history, tokens, **options)
        except SessionRefusal as refusal:
            assert re.search(match, str(refusal)), f"refused, but not saying {match!r}: {refusal}"
        except Exception as error:
            raise AssertionError(f"the turn raised {error!r}, where it should have been refused") from error
        else:
            raise AssertionError(f"the turn was not refused ({match!r})")
    assert calls == [], "the refused turn ran the decoder"
    assert history.tokens_read == read and history.states is states, "the refused turn changed the session"


def test_a_positional_model_is_refused_a_turn_past_its_positions_before_any_work():
    model, d = build_lm_model("--fwp-positions", "on", "--max-target-positions", "24", "--tokens-per-sample", "24",
                              seed=2)
    history = History([model], d)
    session_turn(model, d, history, inputs(d, (6,))[0], max_len_b=4)
    read = history.tokens_read
    assert_refused_before_any_work(model, d, history, inputs(d, (8,))[0],
                                   rf"the session has read {read} tokens.*input's 8.*up to 10.*24 positions.*"
                                   r"reset the session", max_len_b=10)
    assert_refused_before_any_work(model, d, history, inputs(d, (30,))[0], r"input's 30", max_len_b=0)
    session_turn(model, d, history, inputs(d, (3,))[0], max_len_b=2)  # one that fits: the session goes on
    assert history.tokens_read > read


def test_pad_in_an_input_is_refused_naming_it():
    model, d = build_lm_model(seed=4)
    history = History([model], d)
    session_turn(model, d, history, inputs(d)[0], **LIMITS)
    tokens = inputs(d)[1].clone()
    tokens[1] = d.pad()
    assert_refused_before_any_work(model, d, history, tokens, r"<pad> \(index 1\) at token 2", **LIMITS)


def test_options_that_would_see_only_the_turn_are_refused_naming_them():
    """An LM fused in, n-gram blocking, diverse searches and constraints read or penalise only the turn's tokens,
    where the whole history as one prompt gives them every token before: refused, naming the option."""
    from fairseq import search

    model, d = build_lm_model(seed=1)
    fused, _ = build_lm_model("--fwp-update-rule", "sum", seed=5)
    history = History([model], d)
    session_turn(model, d, history, inputs(d)[0], **LIMITS)
    for match, options in ((r"--lm-path", dict(lm_model=fused, lm_weight=0.5)),
                           (r"--no-repeat-ngram-size", dict(no_repeat_ngram_size=2)),
                           (r"--diverse-beam-groups", dict(beam_size=4, diverse=(2, 0.5))),
                           (r"--diversity-rate", dict(beam_size=2, search_strategy=search.DiverseSiblingsSearch(d, 0.5))),
                           (r"--constraints", dict(beam_size=2, search_strategy=search.LexicallyConstrainedBeamSearch(
                               d, "ordered")))):
        assert_refused_before_any_work(model, d, history, inputs(d)[1], match, **options, **LIMITS)


# -- files ----------------------------------------------------------------------------------------------


def test_a_saved_session_continues_as_the_one_that_was_not_saved(tmp_path):
    model, d = build_lm_model("--fwp-softmax-layers", "1", "--fwp-short-conv", "2", seed=3)
    model.double()
    first, second, third = inputs(d, seed=4)
    going_on = History([model], d)
    for tokens in (first, second):
        session_turn(model, d, going_on, tokens, beam_size=3, **LIMITS)
    going_on.save(tmp_path / "session.pt")
    loaded = History([model], d)
    loaded.load(tmp_path / "session.pt")
    assert loaded.tokens_read == going_on.tokens_read
    assert_same_hypotheses(session_turn(model, d, loaded, third, beam_size=3, **LIMITS),
                           session_turn(model, d, going_on, third, beam_size=3, **LIMITS), what="the session never saved")


def damaged_copies(path):
    """{what was done to it: the bytes of a damaged copy of the session file at `path`}"""
    import io
    import zipfile

    from fairseq_fwp import session_file

    raw = path.read_bytes()
    largest = max(zipfile.ZipFile(path).infolist(), key=lambda member: member.file_size)
    start = largest.header_offset + 30 + len(largest.filename) + len(largest.extra) + 16
    saved = torch.load(path, weights_only=True)
    del saved["states"][0][max(saved["states"][0], key=lambda key: "fwp_state" in key)]
    saved["digest"] = session_file.digest({key: value for key, value in saved.items() if key != "digest"})
    without_a_layer = io.BytesIO()
    torch.save(saved, without_a_layer)
    return {"empty": b"", "not a torch file": b"hello world" * 10, "cut short": raw[:len(raw) // 2],
            "bytes of a state flipped": raw[:start] + bytes(b ^ 0xFF for b in raw[start:start + 64]) + raw[start + 64:],
            "a layer's state deleted": without_a_layer.getvalue()}


@pytest.mark.parametrize("damage, message", [
    ("empty", r"is empty: not a session file"), ("not a torch file", r"is not a session file: .*torch.save"),
    ("cut short", r"is damaged: it is cut short or corrupted"),
    ("bytes of a state flipped", r"is damaged: its contents differ from what was saved"),
    ("a layer's state deleted", r"is incomplete: it holds no state for decoder.layers.\d.self_attn \(fwp_state\)")])
def test_a_damaged_session_file_is_refused_saying_what_is_wrong(tmp_path, damage, message):
    from fairseq_fwp.session_file import SessionFileError

    model, d = build_lm_model("--fwp-short-conv", "2", seed=3)
    history = History([model], d)
    session_turn(model, d, history, inputs(d)[0], **LIMITS)
    history.save(tmp_path / "session.pt")
    (tmp_path / "damaged.pt").write_bytes(damaged_copies(tmp_path / "session.pt")[damage])
    loaded = History([model], d)
    with pytest.raises(SessionFileError, match=message):
        loaded.load(tmp_path / "damaged.pt")
    assert loaded.tokens_read == 0 and loaded.states == [{}]


def test_a_session_file_is_refused_by_another_model_saying_how_it_differs(tmp_path):
    from fairseq_fwp.session_file import SessionFileError

    model, d = build_lm_model(seed=3)
    history = History([model], d)
    session_turn(model, d, history, inputs(d)[0], **LIMITS)
    history.save(tmp_path / "session.pt")
    for other, message in ((build_lm_model(seed=4)[0], r"another model \(the same architecture, other parameters\)"),
                           (build_lm_model("--decoder-layers", "1", seed=3)[0], r"another model \(another architecture"),
                           (build_lm_model(seed=3)[0].double(), r"saved by this model in float32, and the model is "
                                                                r"now in float64")):
        with pytest.raises(SessionFileError, match=message):
            History([other], d).load(tmp_path / "session.pt")


def test_a_save_that_fails_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    """The file is replaced in one step: a save cut short (a full disk, a crash) leaves the session saved before."""
    model, d = build_lm_model(seed=3)
    history = History([model], d)
    session_turn(model, d, history, inputs(d)[0], **LIMITS)
    history.save(tmp_path / "session.pt")
    before = (tmp_path / "session.pt").read_bytes()
    session_turn(model, d, history, inputs(d)[1], **LIMITS)

    def cut_short(obj, file, *args, **kwargs):
        file.write(b"PK\x03\x04 half a file")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", cut_short)
    with pytest.raises(OSError, match="No space left"):
        history.save(tmp_path / "session.pt")
    assert (tmp_path / "session.pt").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["session.pt"]


def test_redrawn_features_are_refused_before_any_work():
    model, d = build_lm_model("--fwp-feature-map", "performer", "--fwp-update-rule", "sum", seed=2)
    history = History([model], d)
    session_turn(model, d, history, inputs(d)[0], **LIMITS)
    for module in model.modules():
        if hasattr(module, "redraw"):
            module.redraw()
    assert_refused_before_any_work(model, d, history, inputs(d)[1], "random features were redrawn", **LIMITS)


def test_the_state_stays_the_same_size_and_a_hybrids_grows():
    sizes = {}
    for name, flags in (("fast weights", ()), ("hybrid", ("--fwp-softmax-layers", "1"))):
        model, d = build_lm_model(*flags, seed=1)
        history = History([model], d)
        sizes[name] = []
        for tokens in inputs(d, (6, 6, 6)):
            session_turn(model, d, history, tokens, **LIMITS)
            sizes[name].append(history.state_bytes())
    assert sizes["fast weights"][0] == sizes["fast weights"][-1]
    assert sizes["hybrid"][0] < sizes["hybrid"][1] < sizes["hybrid"][2]


# -- the hub's Session ----------------------------------------------------------------------------------


def test_the_hub_session_replies_and_resets():
    from fairseq_fwp.session import Session

    model, d = build_lm_model(seed=4)
    model.double()
    hub = hub_of(model, d)
    session = Session(hub, beam=2, max_len_b=4)
    first = session.reply("w3 w4 w5")
    second = session.reply("w1 w2")
    history = f"w3 w4 w5 {first} </s> w1 w2"
    n = len(history.split())  # the limits counted from the start, as the session's are from the turn's reply
    assert hub.sample(history, beam=2, max_len_b=n + 4, min_len=n + 1) == f"w3 w4 w5 {first} w1 w2 {second}"
    session.reset()
    assert session.reply("w3 w4 w5") == first


def test_a_sessions_options_hold_for_every_turn_and_a_turns_for_that_turn():
    """Session(hub, **options) keeps its options for every turn; reply(text, **options) overrides them for one
    turn; unset, they are the hub's (beam 1, as hub.sample)."""
    from fairseq_fwp import sequence_generator
    from fairseq_fwp.session import Session

    model, d = build_lm_model(seed=4)
    hub, built = hub_of(model, d), []
    init = sequence_generator.FastWeightSequenceGenerator.__init__

    def noting(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append((self.beam_size, self.max_len_b, type(self.search).__name__))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sequence_generator.FastWeightSequenceGenerator, "__init__", noting)
        session = Session(hub, beam=3, max_len_b=7)
        session.reply("w3 w4 w5")
        session.reply("w1 w2", beam=2)
        session.reply("w1 w2")
        session.options["max_len_b"] = 2
        session.reply("w1")
        Session(hub).reply("w1 w2", sampling=True)
    assert built == [(3, 7, "BeamSearch"), (2, 7, "BeamSearch"), (3, 7, "BeamSearch"), (3, 2, "BeamSearch"),
                     (1, hub.cfg.generation.max_len_b, "Sampling")]
    with pytest.raises(ValueError, match=r"'max_len' is not a generation option.*did you mean"):
        Session(hub, max_len=3)


def interactive_hypotheses(output):
    """{line id: (score, hypothesis, positional scores)} of fairseq-interactive's output."""
    import re

    return {int(i): (float(score), text, probabilities) for i, score, text, probabilities in
            re.findall(r"^H-(\d+)\t(\S+)\t(.*)\n(?:D-.*\n)?P-\d+\t(.*)$", output, flags=re.M)}


def interactive(data, checkpoint, folder, lines, *flags, task="fwp_language_modeling"):
    """fairseq-interactive's output for these input `lines`."""
    from examples.recipes.commands import PLUGIN_DIR, fairseq

    (folder / "input.txt").write_text("".join(f"{line}\n" for line in lines))
    return fairseq("interactive", data, "--user-dir", PLUGIN_DIR, "--path", checkpoint, "--task", task,
                   "--beam", 2, "--max-len-b", 4, "--input", folder / "input.txt", *flags)


@pytest.mark.slow
def test_fairseq_interactive_continues_the_session_line_by_line(corpora, tmp_path):
    """fairseq-interactive --fwp-session on a trained LM: each line continues the session (what the whole history
    as one line generates, its hypothesis, score and positional scores as printed), and an empty line starts a
    new one."""
    from examples.recipes.pipeline import train_lm

    train_lm(corpora["lm"], tmp_path, max_update=4, task="fwp_language_modeling")
    checkpoint = tmp_path / "checkpoint_last.pt"
    lines = [" ".join(line.split()[:4]) for line in open(f"{corpora['raw_lm']}/test.txt").readlines()[:2]]
    session = interactive_hypotheses(interactive(corpora["lm"], checkpoint, tmp_path, [lines[0], lines[1], "", lines[1]],
                                                 "--fwp-session"))
    assert set(session) == {0, 1, 3}  # the empty line generates nothing
    history = f"{session[0][1]} </s> {lines[1]}"
    n = len(history.split())  # the reply's limits, counted from the start
    alone = interactive_hypotheses(interactive(corpora["lm"], checkpoint, tmp_path, [history], "--max-len-b", n + 4,
                                               "--min-len", n + 1))
    score, text, probabilities = alone[0]
    assert abs(session[1][0] - score) < 1e-5
    assert text.endswith(session[1][1]) and probabilities.endswith(session[1][2])
    n = len(lines[1].split())
    alone_first = interactive_hypotheses(interactive(corpora["lm"], checkpoint, tmp_path, [lines[1]], "--max-len-b",
                                                     n + 4, "--min-len", n + 1))
    assert session[3] == alone_first[0]  # after the empty line: as a first line


@pytest.mark.slow
def test_fairseq_interactive_survives_a_refused_line_and_resumes_a_saved_session(corpora, tmp_path):
    """A model with 40 positions: a line past them is refused, said so, and the session goes on as it was; a
    line of </s> is a turn; an empty line starts a new session, said so; lines grouped by --buffer-size and
    --batch-size are read in order; --fwp-session-file saves after every line, and a later run resumes there."""
    from examples.recipes.pipeline import train_lm

    train_lm(corpora["lm"], tmp_path, "--fwp-positions", "on", "--max-target-positions", 40, max_update=2,
             tokens_per_sample=40, task="fwp_language_modeling")
    checkpoint, saved = tmp_path / "checkpoint_last.pt", tmp_path / "session.pt"
    words = open(f"{corpora['raw_lm']}/test.txt").read().split()
    first, second, long = " ".join(words[:4]), " ".join(words[4:7]), " ".join(words[7:7 + 45])
    lines = [first, second, "</s>", long, second, "", first]
    output = interactive(corpora["lm"], checkpoint, tmp_path, lines, "--fwp-session-file", saved, "--buffer-size", 3,
                         "--batch-size", 2)
    grouped = interactive_hypotheses(output)
    assert set(grouped) == {0, 1, 2, 4, 6}, output[-3000:]
    assert "line refused, the session is as it was: the session has read" in output and "40 positions" in output
    assert "an empty line: a new session starts" in output
    assert "H- is the score of the whole history" in output
    one_by_one = interactive_hypotheses(interactive(corpora["lm"], checkpoint, tmp_path, lines, "--fwp-session"))
    assert one_by_one == grouped  # --buffer-size 1, --batch-size 1
    resumed = interactive(corpora["lm"], checkpoint, tmp_path, [second], "--fwp-session-file", saved)
    assert f"resumed from {saved}" in resumed
    assert interactive_hypotheses(resumed)[0] == interactive_hypotheses(
        interactive(corpora["lm"], checkpoint, tmp_path, [first, second], "--fwp-session"))[1]


@pytest.mark.slow
def test_sessions_are_refused_where_they_cannot_be_kept_naming_why(corpora, tmp_path):
    """fwp_stream_lm takes fairseq-interactive's lines, session or not; a session is refused by the tools that
    read a data set, by a task that keeps none, and by a model that keeps no state (fairseq's transformer_lm), each
    naming why, before any line is read."""
    from examples.recipes.commands import PLUGIN_DIR, fairseq
    from examples.recipes.pipeline import COMMON_TRAIN, train_lm

    train_lm(corpora["lm"], tmp_path / "fwp", max_update=1, task="fwp_language_modeling")
    checkpoint = tmp_path / "fwp" / "checkpoint_last.pt"
    for flags in ((), ("--fwp-session",)):
        streamed = interactive(corpora["lm"], checkpoint, tmp_path, ["the cats see", "the house"], "--batch-size", 1,
                               *flags, task="fwp_stream_lm")
        assert set(interactive_hypotheses(streamed)) == {0, 1}
    with pytest.raises(RuntimeError, match=r"--fwp-session continues one conversation.*fairseq-interactive"):
        fairseq("generate", corpora["lm"], "--user-dir", PLUGIN_DIR, "--path", checkpoint, "--task",
                "fwp_language_modeling", "--fwp-session", "--prefix-size", 2, "--batch-size", 2)
    with pytest.raises(RuntimeError, match=r"--fwp-session: --task translation keeps no session.*fwp_language_modeling"):
        interactive(corpora["lm"], checkpoint, tmp_path, ["the cats"], "--fwp-session", task="translation")
    fairseq("train", corpora["lm"], *COMMON_TRAIN, "--task", "language_modeling", "--sample-break-mode", "none",
            "--max-tokens", 256, "--arch", "transformer_lm", "--decoder-layers", 1, "--decoder-embed-dim", 16,
            "--decoder-ffn-embed-dim", 16, "--decoder-attention-heads", 2, "--tokens-per-sample", 32, "--lr", 0.002,
            "--max-update", 1, "--save-dir", tmp_path / "softmax")
    with pytest.raises(RuntimeError, match=r"--fwp-session needs fast-weight language models.*TransformerLanguageModel "
                                           r"keeps no state"):
        interactive(corpora["lm"], tmp_path / "softmax" / "checkpoint_last.pt", tmp_path, ["the cats"], "--fwp-session")


def test_the_session_benchmark_runs_and_its_replies_are_the_whole_historys(capsys):
    """examples/speed/session.py at a tiny size: a row per turn, each model's session replying what it replies
    given the whole history."""
    sys.path.insert(0, os.path.join(ROOT, "examples", "speed"))
    import session as benchmark

    benchmark.main(["--turns", "3", "--input", "12", "--reply", "3"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[0] for row in rows] == ["| 1", "| 2", "| 3"]
    assert all(row.endswith("| yes |") for row in rows)
