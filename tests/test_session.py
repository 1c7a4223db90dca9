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
LIMITS = dict(max_len_a=1, max_len_b=5)  # a turn's limit counts its input: the reply's budget as with the history


@pytest.fixture(autouse=True)
def float64_scores():
    with softmax_in_the_models_dtype():
        yield


def inputs(d, lengths=(5, 3, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(d.nspecial, len(d), (n,), generator=g) for n in lengths]


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
    kept = assert_turns_equal_the_whole_history(model, d, History([model], d), turns, beam_size=2, max_len_a=1,
                                                max_len_b=reply_tokens - 1)  # the input and its bos count
    assert len(kept) == sum(len(tokens) + reply_tokens + 1 for tokens in turns)  # inputs, replies, </s>


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


def test_a_session_file_is_refused_by_another_model(tmp_path):
    model, d = build_lm_model(seed=3)
    history = History([model], d)
    session_turn(model, d, history, inputs(d)[0], **LIMITS)
    history.save(tmp_path / "session.pt")
    other, _ = build_lm_model(seed=4)  # the same architecture, other parameters
    with pytest.raises(ValueError, match="session of another model"):
        History([other], d).load(tmp_path / "session.pt")


def test_a_positional_model_is_refused_a_turn_past_its_positions_before_any_work(monkeypatch):
    model, d = build_lm_model("--fwp-positions", "on", "--max-target-positions", "24", "--tokens-per-sample", "24",
                              seed=2)
    history = History([model], d)
    session_turn(model, d, history, inputs(d, (6,))[0], max_len_a=1, max_len_b=4)
    read, calls = history.tokens_read, []
    monkeypatch.setattr(type(model.decoder), "forward", lambda *args, **kwargs: calls.append(1))
    with pytest.raises(ValueError, match=rf"the session has read {read} tokens.*24 positions.*reset the session"):
        session_turn(model, d, history, inputs(d, (8,))[0], max_len_a=1, max_len_b=10)
    assert calls == [] and history.tokens_read == read


def test_redrawn_features_are_refused_before_any_work():
    model, d = build_lm_model("--fwp-feature-map", "performer", "--fwp-update-rule", "sum", seed=2)
    history = History([model], d)
    session_turn(model, d, history, inputs(d)[0], **LIMITS)
    for module in model.modules():
        if hasattr(module, "redraw"):
            module.redraw()
    with pytest.raises(ValueError, match="random features were redrawn"):
        session_turn(model, d, history, inputs(d)[1], **LIMITS)


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


def test_the_hub_session_replies_and_resets():
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.hub_utils import GeneratorHubInterface

    from fairseq_fwp.session import Session
    from fairseq_fwp.tasks.language_modeling import FastWeightLanguageModelingTask
    from helpers import parse_args

    model, d = build_lm_model(seed=4)
    model.double()
    args = parse_args("fwp_language_modeling", "fwp_lm_tiny")
    hub = GeneratorHubInterface(convert_namespace_to_omegaconf(args), FastWeightLanguageModelingTask(args, d), [model])
    session = Session(hub)
    first = session.reply("w3 w4 w5", beam=2, max_len_a=1, max_len_b=4)
    second = session.reply("w1 w2", beam=2, max_len_a=1, max_len_b=4)
    whole = hub.sample(f"w3 w4 w5 {first} </s> w1 w2", beam=2, max_len_a=1, max_len_b=4)
    assert whole.endswith("w1 w2 " + second) if second else whole.endswith("w1 w2")
    session.reset()
    assert session.reply("w3 w4 w5", beam=2, max_len_a=1, max_len_b=4) == first


@pytest.mark.slow
def test_fairseq_interactive_continues_the_session_line_by_line(corpora, tmp_path):
    """fairseq-interactive --fwp-session on a trained LM: each line continues the session (what the whole history
    as one line generates, its hypothesis, score and positional scores as printed), and an empty line starts a
    new one."""
    import re

    from examples.recipes.commands import PLUGIN_DIR, fairseq
    from examples.recipes.pipeline import train_lm

    train_lm(corpora["lm"], tmp_path, max_update=4, task="fwp_language_modeling")
    lines = [" ".join(line.split()[:4]) for line in open(f"{corpora['raw_lm']}/test.txt").readlines()[:2]]

    def interactive(inputs, *flags):
        (tmp_path / "input.txt").write_text("".join(f"{line}\n" for line in inputs))
        output = fairseq("interactive", corpora["lm"], "--user-dir", PLUGIN_DIR, "--path",
                         str(tmp_path / "checkpoint_last.pt"), "--task", "fwp_language_modeling", "--beam", 3,
                         "--max-len-a", 1, "--max-len-b", 6, "--input", str(tmp_path / "input.txt"), *flags)
        return {int(i): (float(score), text, probabilities) for i, score, text, probabilities in
                re.findall(r"^H-(\d+)\t(\S+)\t(.*)\n(?:D-.*\n)?P-\d+\t(.*)$", output, flags=re.M)}

    session = interactive([lines[0], lines[1], "", lines[1]], "--fwp-session")
    assert set(session) == {0, 1, 3}  # the empty line generates nothing
    alone = interactive([lines[1], f"{session[0][1]} </s> {lines[1]}"])
    score, text, probabilities = alone[1]
    assert abs(session[1][0] - score) < 1e-5
    assert text.endswith(session[1][1]) and probabilities.endswith(session[1][2])
    assert session[3] == alone[0]  # after the empty line: as a first line


def test_the_session_benchmark_runs_and_its_replies_are_the_whole_historys(capsys):
    """examples/speed/session.py at a tiny size: a row per turn, each model's session replying what it replies
    given the whole history."""
    sys.path.insert(0, os.path.join(ROOT, "examples", "speed"))
    import session as benchmark

    benchmark.main(["--turns", "3", "--input", "12", "--reply", "3"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[0] for row in rows] == ["| 1", "| 2", "| 3"]
    assert all(row.endswith("| yes |") for row in rows)
