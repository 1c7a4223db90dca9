"""Reliability: multi-process training on CPU, resuming, bf16, determinism, unused parameters."""
import re
import shutil

import pytest
import torch

pytest.importorskip("fairseq")

from helpers import build_lm_model, build_translation_model, random_tokens  # noqa: E402
from fairseq_fwp import distributed_cpu  # noqa: E402
from examples.recipes.pipeline import PLUGIN_DIR, fairseq  # noqa: E402

LM_FLAGS = ["--user-dir", PLUGIN_DIR, "--task", "language_modeling", "--arch", "fwp_lm_tiny",
            "--tokens-per-sample", 32, "--sample-break-mode", "none", "--max-tokens", 256, "--optimizer", "adam",
            "--lr", 0.002, "--lr-scheduler", "inverse_sqrt", "--warmup-updates", 10, "--log-format", "simple",
            "--log-interval", 1, "--seed", 3, "--no-epoch-checkpoints", "--disable-validation", "--num-workers", 0]
MT_FLAGS = ["--user-dir", PLUGIN_DIR, "--arch", "fwp_transformer_tiny", "--optimizer", "adam", "--lr", 0.002,
            "--lr-scheduler", "inverse_sqrt", "--warmup-updates", 10, "--max-tokens", 600,
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", 0.1, "--log-format", "simple",
            "--log-interval", 1, "--seed", 3, "--no-epoch-checkpoints", "--disable-validation", "--num-workers", 0]


@pytest.fixture(scope="module")
def data(corpora):
    return corpora


def losses(log):
    """{update: training loss} from fairseq's per-update log lines."""
    return {int(n): float(loss) for loss, n in re.findall(r"train_inner \| .*? loss=([0-9.]+),.*?num_updates=(\d+)", log)}


def parameters(checkpoint):
    return torch.load(checkpoint, map_location="cpu", weights_only=False)["model"]


def assert_same_parameters(a, b, atol):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


def train_in_ranks(data_dir, save_dir, nprocs, *flags, capture_to):
    with open(capture_to, "w") as log:
        status = distributed_cpu.launch([data_dir, *LM_FLAGS, "--dropout", 0, "--save-dir", save_dir, *flags],
                                        nprocs, stdout=log)
    output = open(capture_to).read()
    assert status == 0, output[-3000:]
    return output


@pytest.mark.slow
def test_two_processes_equal_one_process_with_update_freq_2_and_resume(data, tmp_path):
    """2 gloo ranks for 6 updates == 1 process with --update-freq 2 (loss to 1e-3 as logged, parameters to
    1e-5: the ranks sum their gradients in another order); a 2-rank run resumed at 3 matches too. One
    model (the ranks' gradient sum does not depend on the rule): DPFP features with the delta rule.

    Not FAVOR+: it draws new features at every forward, and a rank does one forward per update where
    --update-freq 2 does two (every rank draws the same features: they share seed and draw count)."""
    fm = ["--fwp-feature-map", "dpfp", "--fwp-update-rule", "delta"]
    two = train_in_ranks(data["lm"], tmp_path / "two", 2, *fm, "--max-update", 6, "--save-interval-updates", 3,
                         capture_to=tmp_path / "two.log")
    one = fairseq("train", data["lm"], *LM_FLAGS, "--dropout", 0, "--update-freq", 2, "--max-update", 6, *fm,
                  "--save-dir", tmp_path / "one")
    assert len(losses(two)) == 6 and losses(two) == pytest.approx(losses(one), abs=1e-3)
    assert_same_parameters(parameters(tmp_path / "two" / "checkpoint_last.pt"),
                           parameters(tmp_path / "one" / "checkpoint_last.pt"), atol=1e-5)

    # resumed from the checkpoint the 2-rank run saved at update 3, mid-epoch (as a run stopped there saves it)
    (tmp_path / "resumed").mkdir()
    shutil.copy(tmp_path / "two" / "checkpoint_1_3.pt", tmp_path / "resumed" / "checkpoint_last.pt")
    resumed = train_in_ranks(data["lm"], tmp_path / "resumed", 2, *fm, "--max-update", 6,
                             capture_to=tmp_path / "r2.log")
    assert "Loaded checkpoint" in resumed and set(losses(resumed)) == {4, 5, 6}
    assert losses(resumed) == pytest.approx({n: losses(two)[n] for n in (4, 5, 6)}, abs=1e-3)
    assert_same_parameters(parameters(tmp_path / "resumed" / "checkpoint_last.pt"),
                           parameters(tmp_path / "two" / "checkpoint_last.pt"), atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind, flags", [
    ("lm", ["--fwp-update-rule", "delta"]),  # the Delta Net LM (dropout on: fairseq reseeds every update)
    ("mt", ["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "2"]),
    ("lm", ["--fwp-feature-map", "performer"]),  # random features drawn at every update
    ("lm", ["--fwp-feature-map", "softmax"]),
])
def test_the_same_seed_gives_the_same_run_and_resuming_continues_it(data, tmp_path, kind, flags):
    base = (LM_FLAGS if kind == "lm" else MT_FLAGS) + flags
    whole = fairseq("train", data[kind], *base, "--max-update", 8, "--save-dir", tmp_path / "whole")
    first = fairseq("train", data[kind], *base, "--max-update", 4, "--save-dir", tmp_path / "split")
    assert losses(first) == {n: losses(whole)[n] for n in (1, 2, 3, 4)}  # the same seed: the same run
    resumed = fairseq("train", data[kind], *base, "--max-update", 8, "--save-dir", tmp_path / "split")
    assert set(losses(resumed)) == {5, 6, 7, 8}
    assert losses(resumed) == {n: losses(whole)[n] for n in (5, 6, 7, 8)}  # exactly, as logged
    assert_same_parameters(parameters(tmp_path / "split" / "checkpoint_last.pt"),
                           parameters(tmp_path / "whole" / "checkpoint_last.pt"), atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("rule, as_module", [("sum", False), ("delta", True)])
def test_bf16_training_on_cpu_stays_finite_and_reloads(data, tmp_path, rule, as_module):
    """fairseq 0.12 ties --bf16 to TPUs; the plugin keeps it on the CPU (compat.py), whether fairseq-train
    is launched as its console script or as `python -m fairseq_cli.train`."""
    log = fairseq("train", data["lm"], *LM_FLAGS, "--bf16", "--cpu", "--fwp-feature-map", "dpfp",
                  "--fwp-update-rule", rule, "--max-update", 30, "--save-dir", tmp_path, as_module=as_module)
    trajectory = losses(log)
    assert len(trajectory) == 30 and all(loss == loss and loss < 20 for loss in trajectory.values())
    assert trajectory[30] < trajectory[1] - 1  # it learns
    out = fairseq("eval-lm", data["lm"], "--user-dir", PLUGIN_DIR, "--path", tmp_path / "checkpoint_last.pt",
                  "--tokens-per-sample", 32, "--gen-subset", "test", "--batch-size", 4)
    assert float(re.search(r"Perplexity: ([0-9.]+)", out).group(1)) < 100


@pytest.mark.parametrize("fm", ["linear", "performer", "dpfp"])
@pytest.mark.parametrize("rule", ["sum", "delta"])
@pytest.mark.parametrize("attn_norm", ["on", "off"])
def test_every_parameter_gets_a_gradient(fm, rule, attn_norm):
    """What DistributedDataParallel(find_unused_parameters=False) needs on GPUs."""
    flags = ["--fwp-feature-map", fm, "--fwp-update-rule", rule, "--fwp-attn-norm", attn_norm]
    for model, inputs in ((build_translation_model(*flags)[0], "mt"), (build_lm_model(*flags)[0], "lm")):
        model.train()
        d_tokens = random_tokens(model.decoder.dictionary, [6, 4], left_pad=False)
        if inputs == "mt":
            src = random_tokens(model.encoder.dictionary, [5, 3])
            out = model(src, src.ne(1).sum(1), d_tokens)[0]
        else:
            out = model(d_tokens)[0]
        out.float().pow(2).mean().backward()
        unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not unused, unused


STREAM_FLAGS = ["--user-dir", PLUGIN_DIR, "--task", "fwp_stream_lm", "--arch", "fwp_lm_tiny", "--batch-size", 4,
                "--tokens-per-sample", 16, "--optimizer", "adam", "--lr", 0.002, "--lr-scheduler", "inverse_sqrt",
                "--warmup-updates", 10, "--log-format", "simple", "--log-interval", 1, "--seed", 3, "--dropout", 0,
                "--no-epoch-checkpoints", "--disable-validation", "--num-workers", 0]


@pytest.mark.slow
def test_carried_streams_of_every_rank_resume_exactly(data, tmp_path):
    """Each of 2 ranks carries its own streams' fast weights: a run stopped mid-epoch at update 7 and
    resumed continues every rank's streams (the losses of updates 8-10 as the run that never stopped);
    resumed by another number of processes, mid-epoch, it stops and says what to do."""
    def run(save_dir, nprocs, updates, name, *flags):
        with open(tmp_path / f"{name}.log", "w") as log:
            status = distributed_cpu.launch([data["lm"], *STREAM_FLAGS, "--max-update", updates,
                                             "--save-dir", save_dir, *flags], nprocs, stdout=log)
        return status, open(tmp_path / f"{name}.log").read()

    status, whole = run(tmp_path / "whole", 2, 10, "whole", "--save-interval-updates", 7)
    assert status == 0, whole[-3000:]
    # stopped at update 7: the checkpoint the whole run saved there, mid-epoch (as a run stopped there saves it)
    (tmp_path / "stopped").mkdir()
    shutil.copy(tmp_path / "whole" / "checkpoint_1_7.pt", tmp_path / "stopped" / "checkpoint_last.pt")
    status, resumed = run(tmp_path / "stopped", 2, 10, "resumed")
    assert status == 0 and "Loaded checkpoint" in resumed, resumed[-3000:]
    assert set(losses(resumed)) == {8, 9, 10}
    assert losses(resumed) == {n: losses(whole)[n] for n in (8, 9, 10)}

    with pytest.raises(RuntimeError, match="the checkpoint carries the streams of 2 data-parallel ranks, this run has 1"):
        fairseq("train", data["lm"], *STREAM_FLAGS, "--max-update", 10, "--save-dir", tmp_path / "stopped")
