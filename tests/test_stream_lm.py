"""Task fwp_stream_lm: streams, every token scored once, fast weights carried across segments (Table 4)."""
import re

import pytest
import torch

pytest.importorskip("fairseq")

from helpers import build_lm_model, random_tokens, toy_dictionary  # noqa: E402
from fairseq_fwp.modules.fast_weight_attention import FastWeightAttention  # noqa: E402
from examples.recipes.synthetic_data import write_corpora  # noqa: E402
from fairseq_fwp.tasks.stream_lm import StreamSegments  # noqa: E402
from examples.recipes.pipeline import eval_lm, preprocess_lm, train_lm  # noqa: E402


@pytest.mark.parametrize("n_tokens, streams, segment", [(23, 1, 5), (23, 3, 4), (24, 4, 6), (7, 7, 2)])
def test_every_token_is_a_target_exactly_once(n_tokens, streams, segment):
    d = toy_dictionary()
    tokens = torch.randint(d.nspecial, len(d), (n_tokens,))
    data = StreamSegments(tokens, d, streams, segment)
    batches = [data.collater([i]) for i in range(len(data))]
    targets = torch.cat([b["target"] for b in batches], dim=1)   # [streams, stream length]
    inputs = torch.cat([b["net_input"]["src_tokens"] for b in batches], dim=1)
    assert torch.equal(targets[targets.ne(d.pad())], tokens)  # stream after stream, in order, once
    assert sum(b["ntokens"] for b in batches) == n_tokens
    assert (inputs[:, 0] == d.eos()).all()  # each stream's first token is predicted from </s>
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # inputs are the targets shifted right
    assert all(b["net_input"]["src_tokens"].shape[1] <= segment for b in batches)


def fast_weight_layers(model):
    return [m for m in model.modules() if isinstance(m, FastWeightAttention)]


def carry(model):
    for layer in fast_weight_layers(model):
        layer.enable_carry_over()


def start_segment(model, position):
    for layer in fast_weight_layers(model):
        layer.start_segment(position, model.training)


@pytest.mark.parametrize("flags", [[], ["--fwp-update-rule", "sum", "--fwp-attn-norm", "on"],
                                   ["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "2"],
                                   ["--fwp-update-rule", "gla"], ["--fwp-update-rule", "kda"],
                                   ["--fwp-update-rule", "gdn2"]])
def test_carried_segments_equal_one_long_forward(flags):
    model, d = build_lm_model(*flags)
    tokens = random_tokens(d, [17, 17], left_pad=False)
    with torch.no_grad():
        whole, _ = model(tokens)
        carry(model)
        pieces = []
        for position, (a, b) in enumerate(((0, 6), (6, 7), (7, 17))):
            start_segment(model, position)
            pieces.append(model(tokens[:, a:b])[0])
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=1e-5, atol=1e-5)


def test_segment_positions_decide_where_a_segment_starts():
    model, d = build_lm_model()
    carry(model)
    tokens = random_tokens(d, [12, 12], left_pad=False)
    with torch.no_grad():
        whole, _ = model(tokens)
        fresh = model(tokens[:, 6:])[0]  # no segment started: from zero
        start_segment(model, 0)
        model(tokens[:, :6])
        start_segment(model, 1)
        second = model(tokens[:, 6:])[0]
        start_segment(model, 1)  # the same segment again (a retried update)
        again = [model(tokens[:, 6:])[0] for _ in range(2)]  # and every forward within it
        start_segment(model, 0)  # a new epoch, validation subset or evaluation
        restarted = model(tokens[:, 6:])[0]
        start_segment(model, 5)  # not the next position (resumed mid-epoch): from zero
        jumped = model(tokens[:, 6:])[0]
    torch.testing.assert_close(second, whole[:, 6:], rtol=1e-5, atol=1e-5)
    for repeat in again:
        torch.testing.assert_close(repeat, second)
    torch.testing.assert_close(restarted, fresh)
    torch.testing.assert_close(jumped, fresh)


def test_carried_state_is_detached_and_kept_apart_for_training_and_evaluation():
    model, d = build_lm_model()
    layers = fast_weight_layers(model)
    carry(model)
    tokens = random_tokens(d, [8, 8], left_pad=False)
    model.train()
    start_segment(model, 0)
    model(tokens)[0].sum().backward()
    train_state = layers[0].streams.last(True).memory.fast_weight
    assert train_state.grad_fn is None and not train_state.requires_grad
    model.eval()
    with torch.no_grad():
        start_segment(model, 0)
        model(tokens)
    assert layers[0].streams.last(True).memory.fast_weight is train_state  # evaluation left it alone
    model.train()
    start_segment(model, 1)
    with pytest.raises(RuntimeError, match="same streams"):
        model(tokens[:1])


def lm_gradients(flags, segments, checkpoint_activations):
    """Gradients of two training steps on consecutive segments, as fwp_stream_lm runs them."""
    model, d = build_lm_model(*flags, *(["--checkpoint-activations"] if checkpoint_activations else []))
    model.train()
    carry(model)
    grads = []
    for position, tokens in enumerate(segments):
        model.zero_grad()
        start_segment(model, position)
        model(tokens)[0].log_softmax(-1).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    return grads


@pytest.mark.parametrize("flags", [[], ["--fwp-feature-map", "performer"],
                                   ["--fwp-update-rule", "sum", "--fwp-attn-norm", "on"]])
def test_checkpoint_activations_give_the_same_gradients(flags):
    """fairseq's --checkpoint-activations runs every layer's forward again in the backward
    pass: the features and the carried state must be those of the first forward."""
    d = toy_dictionary()
    tokens = random_tokens(d, [16, 16], left_pad=False)
    segments = [tokens[:, :8], tokens[:, 8:]]
    plain = lm_gradients(flags, segments, checkpoint_activations=False)
    checkpointed = lm_gradients(flags, segments, checkpoint_activations=True)
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def lm_data(corpora):
    return corpora["lm"]


def evaluated_tokens(output):
    return int(re.search(r"Evaluated ([0-9,]+) tokens", output).group(1).replace(",", ""))


def stream_perplexity(checkpoint, data, num_streams):
    """The test split's perplexity computed directly: the split cut into num_streams streams as
    fwp_stream_lm cuts it, each stream scored by ONE forward over its whole length (no carry-over
    needed: fast weights carried across segments compute exactly that)."""
    from fairseq import checkpoint_utils
    from fairseq_fwp.tasks.stream_lm import TokenStream

    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)],
                                                                      arg_overrides={"data": str(data)})
    model.eval()
    tokens = TokenStream(str(data / "test"), task.dictionary).tokens
    segments = StreamSegments(tokens, task.dictionary, num_streams, segment_length=len(tokens))
    batch = segments.collater([0])  # one segment: every stream whole
    with torch.no_grad():
        logits = model(batch["net_input"]["src_tokens"])[0]
    lprobs = model.get_normalized_probs((logits, None), log_probs=True)
    target = batch["target"]
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)[target.ne(task.dictionary.pad())]
    return float(torch.exp(nll.mean()))


@pytest.mark.slow
def test_stream_task_trains_resumes_and_scores_the_whole_split(lm_data, tmp_path):
    log = train_lm(lm_data, tmp_path, max_update=8, tokens_per_sample=16, task="fwp_stream_lm")
    assert "'fwp_carry_over': on" in log
    log = train_lm(lm_data, tmp_path, "--restore-file", tmp_path / "checkpoint_last.pt",
                   max_update=10, tokens_per_sample=16, task="fwp_stream_lm")
    assert re.search(r"Loaded checkpoint .*\(epoch \d+ @ 8 updates\)", log), log[-3000:]

    checkpoint = tmp_path / "checkpoint_last.pt"
    baseline = eval_lm(lm_data, checkpoint, tokens_per_sample=16)  # language_modeling's blocks
    for batch_size in (1, 3):
        scored = {}
        for carry in ("on", "off"):
            out = eval_lm(lm_data, checkpoint, "--task", "fwp_stream_lm", "--fwp-carry-over", carry,
                          tokens_per_sample=16, batch_size=batch_size)
            assert evaluated_tokens(out) == evaluated_tokens(baseline)  # every token, once
            scored[carry] = float(re.search(r"Perplexity: ([0-9.]+)", out).group(1))
        want = stream_perplexity(checkpoint, lm_data, batch_size)
        assert scored["on"] == pytest.approx(want, abs=0.006, rel=1e-4)  # eval-lm prints 2 decimals
        assert abs(scored["off"] - want) > 0.05  # segments from zero score otherwise


def valid_losses(log):
    return dict(re.findall(r"valid on '(\w+)' subset \| loss ([0-9.]+)", log))


@pytest.mark.slow
def test_every_validation_subset_starts_its_streams_from_zero(lm_data, tmp_path):
    """fairseq starts one validation pass for all of --valid-subset; the second subset must not
    start from the first one's final state."""
    flags = ["--batch-size-valid", 2]
    both = train_lm(lm_data, tmp_path / "a", "--valid-subset", "valid,test", *flags, max_update=3,
                    tokens_per_sample=16, task="fwp_stream_lm")
    alone = train_lm(lm_data, tmp_path / "b", "--valid-subset", "test", *flags, max_update=3,
                     tokens_per_sample=16, task="fwp_stream_lm")
    assert valid_losses(both)["test"] == valid_losses(alone)["test"]


def stream_task(tmp_path, *flags):
    """fwp_stream_lm set up in this process, as fairseq-train sets it up, on a toy dictionary."""
    from fairseq import tasks
    from helpers import parse_args

    toy_dictionary().save(str(tmp_path / "dict.txt"))
    args = parse_args("fwp_stream_lm", "fwp_lm_tiny", "--batch-size", "2", *flags)
    args.data = str(tmp_path)
    return tasks.setup_task(args), args


@pytest.mark.parametrize("positions", [["--fwp-positions", "on"], ["--fwp-positions", "on", "--decoder-learned-pos"]])
def test_segments_longer_than_the_models_positions_are_refused_when_the_model_is_built(tmp_path, positions):
    """Positions restart in every segment: a 128-token segment on 64 positions would read past them (a learned
    embedding has no row there; sinusoidal positions extend silently)."""
    task, args = stream_task(tmp_path, *positions, "--tokens-per-sample", "128", "--max-target-positions", "64")
    refusal = r"--tokens-per-sample 128 .* 64 positions.*at most 64.*--max-target-positions"
    with pytest.raises(ValueError, match=refusal):
        task.build_model(args)
    task, args = stream_task(tmp_path, *positions, "--tokens-per-sample", "64", "--max-target-positions", "64")
    task.build_model(args)  # segments that fit


def test_a_model_without_positions_takes_segments_of_any_length(tmp_path):
    task, args = stream_task(tmp_path, "--tokens-per-sample", "128", "--max-target-positions", "64")
    model = task.build_model(args)
    with torch.no_grad():
        model(torch.full((2, 128), task.dictionary.index("w1")))


def test_a_model_with_positions_restarts_them_every_segment_and_generates_past_them(tmp_path):
    """fwp_stream_lm restarts positions every segment: the model it builds keeps that (--fwp-position-period, in
    its config, which its checkpoint saves), and generates through the task (the hub's and fairseq-interactive's
    path: language_modeling's inference) past its 8 positions, a 12-token prompt read in one call."""
    import argparse

    from fairseq_fwp.sequence_generator import FastWeightSequenceGenerator

    task, args = stream_task(tmp_path, "--fwp-positions", "on", "--tokens-per-sample", "8", "--max-target-positions", "8")
    model = task.build_model(args).eval()
    assert model.decoder.position_period == 8 and args.fwp_position_period == 8
    generator = task.build_generator([model], argparse.Namespace(beam=2, max_len_b=30, min_len=30))
    assert isinstance(generator, FastWeightSequenceGenerator)
    prompt = torch.tensor([task.dictionary.index(f"w{i % 9}") for i in range(12)])
    dataset = task.build_dataset_for_inference([prompt], [len(prompt)])
    hypotheses = task.inference_step(generator, [model], dataset.collater([dataset[0]]))
    assert len(hypotheses[0][0]["tokens"]) == 31 and torch.equal(hypotheses[0][0]["tokens"][:12], prompt)


def test_random_stream_offsets_move_training_streams_per_epoch(lm_data):
    from fairseq import tasks
    from helpers import parse_args

    args = parse_args("fwp_stream_lm", "fwp_lm_tiny", "--fwp-stream-offset", "random", "--batch-size", "3",
                      "--tokens-per-sample", "16")
    args.data = str(lm_data)
    task = tasks.setup_task(args)
    for split in ("train", "valid"):
        task.load_dataset(split)

    def epoch_targets(split, epoch):
        itr = task.get_batch_iterator(task.dataset(split), max_sentences=3, epoch=epoch).next_epoch_itr(shuffle=False)
        return torch.cat([batch["target"] for batch in itr], dim=1)

    first, second = epoch_targets("train", 1), epoch_targets("train", 2)
    assert not torch.equal(first, second)  # the streams moved
    pad = task.dictionary.pad()
    # every token is still a target exactly once per epoch
    assert torch.equal(first[first.ne(pad)].sort().values, second[second.ne(pad)].sort().values)
    assert torch.equal(epoch_targets("train", 2), second)  # reproducible from (seed, epoch)
    assert torch.equal(epoch_targets("valid", 1), epoch_targets("valid", 2))  # validation never moves


@pytest.mark.slow
def test_a_run_resumed_mid_epoch_equals_the_run_that_never_stopped(tmp_path):
    """12 updates in one run against 6, a stop and a resume, in the second of three epochs: the same
    FAVOR+ features (drawn per epoch), the same carried states (checkpointed with the model) and the
    same stream offsets, so the same losses and the same final model."""
    _, raw = write_corpora(tmp_path / "raw", n_train=25, n_eval=10, seed=3)  # 4 segments of 4 streams per epoch
    preprocess_lm(raw, tmp_path / "bin")
    flags = ["--fwp-feature-map", "performer", "--fwp-stream-offset", "random"]

    def run(save_dir, updates):
        log = train_lm(tmp_path / "bin", save_dir, *flags, max_update=updates, tokens_per_sample=16,
                       task="fwp_stream_lm")
        losses = {int(n): float(loss) for loss, n in
                  re.findall(r"train_inner \| .*? loss=([0-9.]+),.*?num_updates=(\d+)", log)}
        return losses, log

    whole, _ = run(tmp_path / "whole", 12)
    first, _ = run(tmp_path / "stopped", 6)
    resumed, log = run(tmp_path / "stopped", 12)  # from checkpoint_last.pt of the stopped run
    assert re.search(r"Loaded checkpoint .*\(epoch 2 @ 6 updates\)", log), log[-3000:]  # in the middle of epoch 2
    assert len(whole) == 12 and {**first, **resumed} == whole
    final = [torch.load(path / "checkpoint_last.pt", weights_only=False)["model"]
             for path in (tmp_path / "whole", tmp_path / "stopped")]
    assert final[0].keys() == final[1].keys()
    for name, value in final[0].items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(final[1][name], value, rtol=0, atol=1e-6, msg=name)


def test_checkpoints_with_and_without_carried_streams_load_either_way():
    plain, d = build_lm_model()
    carrying, _ = build_lm_model()
    carry(carrying)
    carrying.train()
    start_segment(carrying, 0)
    carrying(random_tokens(d, [6, 6], left_pad=False))
    state = carrying.state_dict()
    assert any(key.endswith("streams._extra_state") for key in state)
    plain.load_state_dict(state)  # strict: the streams have no place in a model that carries none
    fresh, _ = build_lm_model()
    carry(fresh)
    fresh.load_state_dict(plain.state_dict())  # strict: a model that carries starts its streams from zero
    fresh.load_state_dict(state)
    layer = fast_weight_layers(fresh)[0]
    torch.testing.assert_close(layer.streams.last(True).memory.fast_weight,
                               fast_weight_layers(carrying)[0].streams.last(True).memory.fast_weight)


def test_every_ranks_streams_are_saved_and_each_rank_takes_its_own():
    """Unit level of the 2-rank resume (tests/test_reliability.py): the saved streams of every rank,
    the old one-stream format, and a checkpoint of another number of ranks, which may restart its streams
    from zero but not continue them."""
    from fairseq_fwp.modules.carried_streams import CarriedStreams
    from fairseq_fwp.modules.state import FastWeightState
    from fairseq_fwp.ops import Memory

    def streams_at(rank, world_size, value):
        streams = CarriedStreams(rank, world_size)
        streams.start_segment(0, True)
        W = torch.full((2, 1, 3, 4), float(value)).transpose(-1, -2)  # as the ops return W: a transposed view
        streams.end(True, FastWeightState(Memory(fast_weight=W)))
        return streams

    ranks = [streams_at(r, 2, r + 1) for r in range(2)]
    assert ranks[0].get_extra_state()["ranks"] is None  # without the gather: not every rank's streams
    for streams in ranks:
        streams.hold_every_rank([s.training_stream() for s in ranks])
    saved = ranks[0].get_extra_state()
    assert saved["world_size"] == 2 and all(r["end"]["fast_weight"].is_contiguous() for r in saved["ranks"])
    for rank in range(2):
        resumed = CarriedStreams(rank, 2)
        resumed.set_extra_state(saved)
        resumed.start_segment(1, True)
        assert torch.equal(resumed.start(True, 2, "cpu").memory.fast_weight, torch.full((2, 1, 4, 3), rank + 1.0))

    alone = CarriedStreams(0, 1)
    alone.set_extra_state(saved)
    with pytest.raises(RuntimeError, match="carries the streams of 2 data-parallel ranks, this run has 1: .*"
                                           "--reset-dataloader"):
        alone.start_segment(1, True)
    alone.set_extra_state(saved)
    alone.start_segment(0, True)  # a new epoch (or --reset-dataloader): from zero, as always
    assert alone.start(True, 2, "cpu").memory.fast_weight is None

    # a retried segment: a new stream object, equal in position, whose states hold tensors; compared by
    # identity, what was gathered is no longer this rank's stream (and nothing compares tensors)
    ranks[0].start_segment(0, True)
    W = torch.full((2, 1, 3, 4), 1.0).transpose(-1, -2)
    ranks[0].end(True, FastWeightState(Memory(fast_weight=W)))
    assert ranks[0].get_extra_state()["ranks"] is None

    old_format = {"position": 0, "start": saved["ranks"][1]["start"], "end": saved["ranks"][1]["end"]}
    alone.set_extra_state(old_format)  # one process's stream, as saved before every rank's were
    alone.start_segment(1, True)
    assert torch.equal(alone.start(True, 2, "cpu").memory.fast_weight, torch.full((2, 1, 4, 3), 2.0))
