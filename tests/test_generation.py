"""Language-model generation with a prompt read in one decoder call (fairseq_fwp/sequence_generator.py; the
decoder's multi-token incremental call, modules/transformer_layers.py) against fairseq's own forcing of it,
one token per step: the same tokens, and positional scores that are the model's teacher-forced
log-probabilities, in float64 (fairseq's scores are differences of running sums: 1e-3 off after a thousand
tokens in float32, with fairseq's own models too)."""
import pytest
import torch

pytest.importorskip("fairseq")

from helpers import (assert_generates_what_forcing_does, assert_reads_eos_as_context, build_lm_model,  # noqa: E402
                     generated, prompts, softmax_in_the_models_dtype)
from fairseq_fwp.sequence_generator import FastWeightSequenceGenerator  # noqa: E402

FAMILIES = {
    "sum": ["--fwp-update-rule", "sum"],
    "delta": [],  # the LM architectures' default
    "gated, short convolutions, output gate": ["--fwp-update-rule", "gated-delta", "--fwp-short-conv", "4",
                                               "--fwp-output-gate", "on"],
    "per-channel": ["--fwp-update-rule", "kda"],
    "product": ["--fwp-update-rule", "delta-product", "--fwp-householder-steps", "2"],
    "hybrid with positions": ["--fwp-softmax-layers", "1", "--fwp-positions", "on"],
    "dpfp with attention normalisation": ["--fwp-feature-map", "dpfp", "--fwp-update-rule", "sum", "--fwp-attn-norm",
                                          "on", "--fwp-short-conv", "2"],
    "adaptive softmax": ["--adaptive-softmax-cutoff", "10,20"],  # the prompt's log-probabilities: only its words'
}
SEARCHES = {"greedy": dict(beam_size=1), "beam 4": dict(beam_size=4),
            "seeded sampling": dict(beam_size=2, sampling=True, sampling_topk=5)}


@pytest.fixture(autouse=True)
def float64_scores():
    with softmax_in_the_models_dtype():
        yield


def decoder_reads(model, monkeypatch):
    """The number of tokens each decoder call reads (its prefix's width: the generators give the whole prefix)."""
    widths, forward = [], type(model.decoder).forward

    def noted(decoder, tokens, *args, **kwargs):
        widths.append(tokens.size(1))
        return forward(decoder, tokens, *args, **kwargs)

    monkeypatch.setattr(type(model.decoder), "forward", noted)
    return widths


# Prompts of different lengths, left-padded in the one call: fairseq's loop starts after the shortest's (3
# tokens), or steps from the first position where one is empty; the shorter rows read their new tokens while
# the longer still force theirs.
PROMPT_LENGTHS = {"shortest 3": [7, 3, 5], "one empty": [7, 2, 5, 0]}


@pytest.mark.parametrize("lengths", PROMPT_LENGTHS)
@pytest.mark.parametrize("search_name", SEARCHES)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_read_in_one_call_generates_what_forcing_does(family, search_name, lengths):
    """The tokens of forcing, and the teacher-forced log-probabilities as positional scores."""
    model, d = build_lm_model(*FAMILIES[family], seed=1)
    model.double()
    sample, prefix = prompts(d, PROMPT_LENGTHS[lengths])
    assert_generates_what_forcing_does(model, d, sample, prefix, search_options=SEARCHES[search_name], max_len_b=16,
                                       seed=3)


@pytest.mark.parametrize("search_name", ["beam 4", "seeded sampling"])
def test_skipped_prompt_positions_keep_forcings_unknown_word_penalty_and_length_normalisation(search_name):
    """An unknown word in the positions the loop skips: forcing scores it less --unkpen, and normalises each
    hypothesis by its whole length (--lenpen)."""
    model, d = build_lm_model(seed=5)
    model.double()
    sample, prefix = prompts(d, [6, 4])
    prefix[:, 1] = d.unk()
    sample["net_input"]["src_tokens"][:, 2] = d.unk()
    assert_generates_what_forcing_does(model, d, sample, prefix, seed=1, search_options=SEARCHES[search_name],
                                       unk_penalty=0.7, len_penalty=2.0, max_len_b=14, scores_are_the_models=False)


def test_the_prompt_is_read_in_one_call_and_the_forced_steps_call_nothing(monkeypatch):
    model, d = build_lm_model(seed=1)
    sample, prefix = prompts(d, [6, 6])
    widths = decoder_reads(model, monkeypatch)
    generated(FastWeightSequenceGenerator, model, d, sample, prefix, max_len_b=10)
    assert widths == [7] + list(range(8, 8 + len(widths) - 1))  # the prompt, then one token per step


def test_an_lm_without_positions_generates_past_the_length_it_was_trained_on():
    """fairseq capped generation at max_target_positions; without positions the state is the same size at
    every length, and the length is what --max-len-b asks for."""
    model, d = build_lm_model("--max-target-positions", "8", "--tokens-per-sample", "8", seed=2)
    model.double()
    sample, prefix = prompts(d, [3])
    read = assert_generates_what_forcing_does(model, d, sample, prefix, search_options={"beam_size": 2}, max_len_b=30,
                                    min_len=30)
    assert len(read[0][0]["tokens"]) == 31  # 30 and </s>, far past 8


def test_positions_that_restart_generate_past_them():
    """--fwp-position-period (fwp_stream_lm's segments) numbers positions modulo the period, in the full
    forward and in decoding alike."""
    model, d = build_lm_model("--fwp-positions", "on", "--max-target-positions", "8", "--tokens-per-sample", "8",
                              "--fwp-position-period", "8", seed=2)
    model.double()
    sample, prefix = prompts(d, [12, 5])  # a prompt past the positions too
    read = assert_generates_what_forcing_does(model, d, sample, prefix, search_options={"beam_size": 2}, max_len_b=30,
                                    min_len=30)
    assert len(read[0][0]["tokens"]) == 31


@pytest.mark.parametrize("learned", [False, True])
def test_positions_that_do_not_restart_are_refused_a_longer_generation_before_any_work(learned, monkeypatch):
    extra = ["--decoder-learned-pos"] if learned else []
    model, d = build_lm_model("--fwp-positions", "on", "--max-target-positions", "8", "--tokens-per-sample", "8",
                              *extra, seed=2)
    sample, prefix = prompts(d, [3])
    widths = decoder_reads(model, monkeypatch)
    with pytest.raises(ValueError, match=r"--max-len-b 30 ask for up to 30 tokens.* has 8 positions.*"
                                         r"--fwp-position-period"):
        generated(FastWeightSequenceGenerator, model, d, sample, prefix, max_len_b=30)
    assert widths == []
    generated(FastWeightSequenceGenerator, model, d, sample, prefix, max_len_b=7)  # within them: generates


def test_a_decoder_call_that_gives_fewer_tokens_than_it_has_read_is_refused():
    model, d = build_lm_model(seed=0)
    state = {}
    tokens = torch.full((1, 3), d.eos())
    model.decoder(tokens, incremental_state=state)
    with pytest.raises(ValueError, match="prev_output_tokens has 3 tokens, and the incremental state has read 3"):
        model.decoder(tokens, incremental_state=state)


def test_the_hub_samples_with_the_prompt_read_in_one_call(monkeypatch):
    """GeneratorHubInterface.sample and generate build the task's generator: fwp_language_modeling's reads the
    prompt in one call and gives what fairseq's language_modeling gives."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.hub_utils import GeneratorHubInterface
    from fairseq.tasks.language_modeling import LanguageModelingTask

    from fairseq_fwp.tasks.language_modeling import FastWeightLanguageModelingTask
    from helpers import parse_args

    model, d = build_lm_model("--fwp-update-rule", "gated-delta", "--fwp-short-conv", "4", seed=4)
    model.double()
    args = parse_args("fwp_language_modeling", "fwp_lm_tiny")
    widths = decoder_reads(model, monkeypatch)
    sampled, calls = {}, {}
    for task_class in (LanguageModelingTask, FastWeightLanguageModelingTask):
        hub = GeneratorHubInterface(convert_namespace_to_omegaconf(args), task_class(args, d), [model])
        widths.clear()
        torch.manual_seed(0)
        sampled[task_class] = (hub.sample(["w3 w4 w5 w6 w7 w8 w9", "w1 w2"], beam=3, max_len_b=15),
                               hub.sample("w5 w6 w7", sampling=True, sampling_topk=4, max_len_b=12))
        calls[task_class] = list(widths)
    assert sampled[FastWeightLanguageModelingTask] == sampled[LanguageModelingTask]
    assert calls[FastWeightLanguageModelingTask][0] == 8  # </s> and the longer prompt's 7 words, in one call
    assert calls[LanguageModelingTask][0] == 1


@pytest.mark.slow
def test_generate_and_interactive_with_fwp_language_modeling_give_what_language_modeling_gives(corpora, tmp_path):
    """fairseq-generate (prompts: --prefix-size) and fairseq-interactive (prompts: the lines of --input) on a
    trained LM: the same hypotheses with --task fwp_language_modeling as with fairseq's language_modeling, and
    their positional scores as fairseq prints them (4 decimals of float32 scores)."""
    import re

    from examples.recipes.commands import PLUGIN_DIR, fairseq
    from examples.recipes.pipeline import train_lm

    train_lm(corpora["lm"], tmp_path, max_update=4)
    checkpoint = str(tmp_path / "checkpoint_last.pt")
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("".join(open(f"{corpora['raw_lm']}/test.txt").readlines()[:4]))
    runs = {"generate beam 4": ["generate", corpora["lm"], "--gen-subset", "test", "--prefix-size", 6, "--beam", 4,
                                "--batch-size", 8],
            "generate sampling": ["generate", corpora["lm"], "--gen-subset", "test", "--prefix-size", 3, "--sampling",
                                  "--sampling-topk", 5, "--beam", 2, "--nbest", 2, "--seed", 7, "--batch-size", 8],
            "interactive": ["interactive", corpora["lm"], "--input", str(prompt_file), "--beam", 3]}
    for name, (command, *args) in runs.items():
        outputs = {}
        for task in ("language_modeling", "fwp_language_modeling"):
            output = fairseq(command, *args, "--user-dir", PLUGIN_DIR, "--path", checkpoint, "--task", task,
                             "--max-len-a", 1, "--max-len-b", 8)
            outputs[task] = {"H": re.findall(r"^H-(\d+)\t\S+\t(.*)$", output, flags=re.M),
                             "P": [list(map(float, p.split())) for p in re.findall(r"^P-\d+\t(.*)$", output, flags=re.M)]}
        assert outputs["fwp_language_modeling"]["H"] == outputs["language_modeling"]["H"] != [], name
        for got, want in zip(outputs["fwp_language_modeling"]["P"], outputs["language_modeling"]["P"]):
            assert max(abs(a - b) for a, b in zip(got, want)) <= 2e-4, name


@pytest.mark.parametrize("search_name", SEARCHES)
@pytest.mark.parametrize("family", ["delta", "adaptive softmax"])
def test_prompts_longer_than_a_log_probability_chunk_in_several_rows(family, search_name, monkeypatch):
    """The prompt's log-probabilities are taken a chunk of positions at a time (LOG_PROB_CHUNK, 3 here): an
    adaptive softmax views each chunk's targets as one row, for every row of the batch and the beam."""
    from fairseq_fwp import sequence_generator

    monkeypatch.setattr(sequence_generator, "LOG_PROB_CHUNK", 3)
    model, d = build_lm_model(*FAMILIES[family], seed=2)
    model.double()
    sample, prefix = prompts(d, [8, 7, 5], seed=4)
    assert_generates_what_forcing_does(model, d, sample, prefix, search_options=SEARCHES[search_name], max_len_b=14,
                                       seed=2)


@pytest.mark.parametrize("temperature", [0.6, 2.0])
@pytest.mark.parametrize("search_name", ["beam 4", "seeded sampling"])
@pytest.mark.parametrize("family", ["delta", "adaptive softmax"])
def test_a_temperature_divides_the_scores_once(family, search_name, temperature):
    """--temperature divides the output layer's output once, at every position (an adaptive softmax's output
    layer hands back its input: divided in place, the distribution after the prompt was at T squared)."""
    model, d = build_lm_model(*FAMILIES[family], seed=2)
    model.double()
    sample, prefix = prompts(d, [6, 4], seed=1)
    assert_generates_what_forcing_does(model, d, sample, prefix, seed=1, search_options=SEARCHES[search_name],
                                       temperature=temperature, max_len_b=12, scores_are_the_models=False)


@pytest.mark.parametrize("beam", [16, 17, 25, 33])
def test_a_beam_of_half_the_vocabulary_or_more_generates_what_forcing_does(beam):
    """Beam search's first step takes min(2 beam, V - 1) candidates of one hypothesis, a later step 2 beam: from
    about V / 2 on, the loop steps through the prompt (34 words here) rather than starting after it."""
    model, d = build_lm_model("--fwp-update-rule", "sum", seed=3)
    model.double()
    sample, prefix = prompts(d, [5, 5, 3], seed=2)
    assert len(d) == 34
    assert_generates_what_forcing_does(model, d, sample, prefix, search_options={"beam_size": beam}, max_len_b=10)


def prompts_holding_eos(d, seed):
    """Prompts of 4, 7 and 6 tokens with </s> inside: in the positions every prompt has (1), past the shortest's
    end (5), and first (0)."""
    sample, prefix = prompts(d, [4, 7, 6], seed=seed)
    for row, position in ((0, 1), (1, 5), (2, 0), (2, 5)):
        prefix[row, position] = d.eos()
    sample["net_input"]["src_tokens"][:, 1:] = prefix
    return sample, prefix


@pytest.mark.parametrize("search_name", SEARCHES)
@pytest.mark.parametrize("family", ["delta", "hybrid with positions"])
def test_a_prompts_eos_is_read_as_context_whatever_the_batch(family, search_name):
    """A prompt's </s> (fairseq-generate --prefix-size on language_modeling data keeps each line's) is context, as
    the rest of the prompt, wherever it falls among the batch's prompts; fairseq's forcing ends the hypothesis
    there instead (docs/generation.md)."""
    model, d = build_lm_model(*FAMILIES[family], seed=11)
    model.double()
    sample, prefix = prompts_holding_eos(d, seed=0)
    assert_reads_eos_as_context(model, d, sample, prefix, search_options=SEARCHES[search_name], max_len_b=13, seed=4)


# searches that read the steps before; whether their scores are the model's log-probabilities
OTHER_SEARCHES = {"n-gram blocking": (dict(beam_size=3, no_repeat_ngram_size=2), True),
                  "diverse beam search": (dict(beam_size=4, diverse=(2, 0.5)), False),
                  "an LM fused in": (dict(beam_size=3, lm_weight=0.3), False)}


@pytest.mark.parametrize("eos", [False, True], ids=["plain prompts", "prompts holding eos"])
@pytest.mark.parametrize("search_name", OTHER_SEARCHES)
def test_searches_that_step_through_every_position(search_name, eos):
    """Searches that read the steps before (n-gram blocking, diverse beam search, an LM fused in): the loop steps
    through every prompt position, served from the one call, as forcing does; a prompt's </s> is read as context,
    and what they read of the prompt is the prompt (its </s> in place, not the loop's stand-in for it)."""
    model, d = build_lm_model(seed=6)
    model.double()
    sample, prefix = prompts_holding_eos(d, seed=2) if eos else prompts(d, [6, 3, 5], seed=2)
    options, scores_are_the_models = OTHER_SEARCHES[search_name]
    options = dict(options, max_len_b=13)
    if "lm_weight" in options:
        options["lm_model"], _ = build_lm_model("--fwp-update-rule", "sum", seed=7)
        options["lm_model"].double()
    check = assert_reads_eos_as_context if eos else assert_generates_what_forcing_does
    check(model, d, sample, prefix, scores_are_the_models=scores_are_the_models, **options)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["fwp_language_modeling", "language_modeling"])
def test_the_hub_reads_the_prompt_of_a_trained_checkpoint_in_one_call(task, corpora, tmp_path, monkeypatch):
    """A checkpoint trained as the README trains one (--task fwp_language_modeling) samples from
    from_pretrained with its prompt read in one call; one trained with fairseq's language_modeling does where
    from_pretrained names the task (docs/generation.md)."""
    from fairseq.models.transformer_lm import TransformerLanguageModel

    from examples.recipes.commands import PLUGIN_DIR
    from examples.recipes.pipeline import train_lm

    train_lm(corpora["lm"], tmp_path, max_update=2, task=task)
    named = {} if task == "fwp_language_modeling" else {"task": {"_name": "fwp_language_modeling"}}
    hub = TransformerLanguageModel.from_pretrained(str(tmp_path), "checkpoint_last.pt", str(corpora["lm"]),
                                                   user_dir=PLUGIN_DIR, **named)
    prompt = open(f"{corpora['raw_lm']}/test.txt").readline().split()[:6]
    widths = decoder_reads(hub.models[0], monkeypatch)
    sampled = hub.sample(" ".join(prompt), beam=2, max_len_b=12)
    assert sampled.split()[:6] == prompt
    assert widths[0] == 7  # </s> and the prompt's 6 words, in one call
