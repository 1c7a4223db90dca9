"""Synthetic associative retrieval (paper Sec. 6.1): data, memories, training, sweep and plots."""
import csv
import math
import os

import matplotlib.image
import pytest
import torch
import torch.nn.functional as F

from examples.synthetic_retrieval import data, plot, sweep, train
from examples.synthetic_retrieval.logs import read_run, run_path
from examples.synthetic_retrieval.models import (
    DeltaMemory, FastWeightMemory2021, GatedDeltaMemory, GatedMemory, SumMemory, build_model,
)
from fairseq_fwp.modules.feature_maps import build_feature_map


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: more threads only wait for each other (20x slower on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def brute_force_target(keys, values, query):
    """Scan the sequence backwards for the query key: the value of its last occurrence."""
    for key, value in zip(reversed(keys), reversed(values)):
        if key == query:
            return value
    raise AssertionError("query not in the sequence")


# ---------------------------------------------------------------- data

def test_setting1_draws_keys_and_values_without_replacement():
    g = torch.Generator().manual_seed(0)
    keys, values = data.sample_sequences(16, 12, setting=1, generator=g)
    assert keys.shape == values.shape == (16, 12)  # L = S
    for row in torch.cat([keys, values]):
        assert sorted(row.tolist()) == list(range(12))


def test_setting2_draws_with_replacement_and_reassigns_keys():
    g = torch.Generator().manual_seed(0)
    keys, values = data.sample_sequences(16, 12, setting=2, generator=g)
    assert keys.shape == values.shape == (16, 24)  # L = 2S
    assert 0 <= int(keys.min()) and int(keys.max()) < 12 and 0 <= int(values.min()) and int(values.max()) < 12
    assert all(len(set(row.tolist())) < 24 for row in keys)  # 24 draws from 12 keys must repeat


@pytest.mark.parametrize("setting", [1, 2])
def test_training_targets_are_the_last_occurrence(setting):
    g = torch.Generator().manual_seed(1)
    keys, values, queries, targets = data.training_batch(64, 9, setting, generator=g)
    assert queries.shape == targets.shape == (64, 1)
    for k, v, q, t in zip(keys.tolist(), values.tolist(), queries.tolist(), targets.tolist()):
        assert t[0] == brute_force_target(k, v, q[0])
    # in setting 2 the first and the last occurrence differ somewhere, so this test can fail
    if setting == 2:
        first = [v[k.index(q[0])] for k, v, q in zip(keys.tolist(), values.tolist(), queries.tolist())]
        assert first != targets.flatten().tolist()


def test_evaluation_asks_every_distinct_key_once():
    g = torch.Generator().manual_seed(2)
    keys, values, queries, targets = data.evaluation_sequence(30, setting=2, generator=g)
    assert sorted(queries.flatten().tolist()) == sorted(set(keys.flatten().tolist()))
    for q, t in zip(queries.flatten().tolist(), targets.flatten().tolist()):
        assert t == brute_force_target(keys.flatten().tolist(), values.flatten().tolist(), q)
    # more than max_queries distinct keys: a subset of distinct keys
    keys, _, queries, _ = data.evaluation_sequence(250, setting=1, max_queries=200, generator=g)
    assert queries.shape == (1, 200) and len(set(queries.flatten().tolist())) == 200


# ---------------------------------------------------------------- models

@pytest.mark.parametrize("name", ["softmax", "delta-dpfp1", "gdelta-dpfp1"])
def test_write_input_equals_projecting_the_concatenated_x(name):
    torch.manual_seed(0)
    model = build_model(name, 10).double()
    keys, values, _, _ = data.training_batch(3, 10, setting=2)
    x = torch.cat([F.one_hot(values, 10).double(), model.embedding(keys)], -1)  # x_i = [one_hot(v_i); E(k_i)]
    torch.testing.assert_close(model.write_input(model.W_k, keys, values), model.W_k(x))
    assert model.embedding.embedding_dim == 22 and model.W_k.out_features == 64  # int(2.2 S), d_key


def random_memory_inputs(B=2, L=7, d=64, S=5, Q=3):
    g = torch.Generator().manual_seed(3)
    k = torch.randn(B, L, d, generator=g, dtype=torch.float64)
    v = F.one_hot(torch.randint(S, (B, L), generator=g), S).double()
    beta = torch.rand(B, L, generator=g, dtype=torch.float64)
    q = torch.randn(B, Q, d, generator=g, dtype=torch.float64)
    return k, v, beta, q


def test_sum_memory_is_normalised_linear_attention():
    k, v, beta, q = random_memory_inputs()
    memory = SumMemory(build_feature_map("dpfp", 64, nu=1)).eval()
    phi_k, phi_q = memory.phi(k), memory.phi(q)
    scores = phi_q @ phi_k.transpose(-1, -2)  # [B, Q, L]: phi(q) . phi(k_i)  (Eq. 13)
    expected = (scores @ v) / (scores.sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(memory(k, v, beta, q), expected)


def test_gated_memory_unrolls_eq52():
    k, v, beta, _ = random_memory_inputs()
    W = torch.zeros(2, 5, 64, dtype=torch.float64)
    for i in range(k.shape[1]):  # W_i = (1 - beta_i) W_{i-1} + beta_i v_i k_i^T
        b = beta[:, i, None, None]
        W = (1 - b) * W + b * v[:, i, :, None] * k[:, i, None, :]
    torch.testing.assert_close(GatedMemory(torch.nn.Identity()).write(k, v, beta), W)


def test_delta_rule_overwrites_one_association_and_keeps_the_others():
    """Appendix B: re-writing key 1 replaces its value; key 2 is untouched (the gated rule erases it)."""
    one_hot_keys = torch.eye(4, dtype=torch.float64)[[0, 1, 0]].unsqueeze(0)  # keys 1, 2, 1
    values = torch.eye(3, dtype=torch.float64)[[0, 1, 2]].unsqueeze(0)  # values v1, v2, v3
    beta = torch.ones(1, 3, dtype=torch.float64)
    read = torch.eye(4, dtype=torch.float64)[[0, 1]].unsqueeze(0)  # query keys 1 and 2
    delta = DeltaMemory(torch.nn.Identity())
    y = delta.read(delta.write(one_hot_keys, values, beta), read)
    torch.testing.assert_close(y[0], torch.eye(3, dtype=torch.float64)[[2, 1]])  # v3, v2
    gated = GatedMemory(torch.nn.Identity())
    y = gated.read(gated.write(one_hot_keys, values, beta), read)
    torch.testing.assert_close(y[0, 1], torch.zeros(3, dtype=torch.float64))  # v2 is gone


def test_gated_delta_memory_unrolls_the_gated_delta_rule():
    k, v, beta, _ = random_memory_inputs()
    decay = 0.5 + 0.5 * torch.rand(2, 7, dtype=torch.float64)
    W = torch.zeros(2, 5, 64, dtype=torch.float64)
    for i in range(k.shape[1]):  # W_i = a_i W_{i-1} + beta_i (v_i - a_i W_{i-1} k_i) k_i^T
        W = decay[:, i, None, None] * W
        u = beta[:, i, None] * (v[:, i] - (W @ k[:, i, :, None]).squeeze(-1))
        W = W + u[:, :, None] * k[:, i, None, :]
    torch.testing.assert_close(GatedDeltaMemory(torch.nn.Identity()).write(k, v, beta, decay.log()), W)
    model = build_model("gdelta-linear", 5)
    keys, values, queries, _ = data.training_batch(2, 5, setting=2)
    model(keys, values, queries).sum().backward()
    assert model.decay_gate.A_log.grad is not None and model.decay_gate.dt_bias.grad is not None


def test_fwm_bounds_the_fast_weight_and_normalises_the_output():
    k, v, beta, q = random_memory_inputs()
    memory = FastWeightMemory2021(torch.nn.Tanh())
    W = memory.write(10 * torch.tanh(k), 10 * v, beta)  # large writes must be scaled back
    assert (W.flatten(1).norm(dim=-1) <= 1 + 1e-9).all()
    y = memory(k, v, beta, q)
    torch.testing.assert_close(y.mean(-1), torch.zeros(2, 3, dtype=torch.float64))


# ---------------------------------------------------------------- training

def test_stopping_rule():
    rule = train.StoppingRule(target_loss=1e-3, patience=3)
    assert [rule.update(x) for x in (0.4, 0.3, 0.35, 0.31, 0.3)] == [None, None, None, None, "no_progress"]
    assert train.StoppingRule(1e-3, 3).update(1e-3) == "solved"
    assert train.StoppingRule(1e-3, 3).update(math.nan) == "not_finite"


def test_training_learns_a_small_task():
    """Far below the 0.5 of predicting zeros within a small step budget (the real criterion is 1e-3)."""
    evaluations = []
    stop = train.train("sum-dpfp1", 20, setting=1, config=train.TrainConfig(max_steps=500),
                       on_evaluation=lambda evaluation, stop: evaluations.append(evaluation))
    assert evaluations[0].train_loss > 0.01  # it did have something to learn
    assert min(e.eval_loss for e in evaluations) < 0.01
    assert stop in ("solved", "max_steps")


def test_a_non_finite_loss_stops_training_without_an_update(monkeypatch):
    model = build_model("sum-linear", 6)
    monkeypatch.setattr(model, "forward", lambda keys, values, queries: torch.full((len(keys), 1, 6), math.nan))
    monkeypatch.setattr(train, "build_model", lambda name, num_keys, d_key: model)
    before = [p.clone() for p in model.parameters()]
    evaluations = []
    assert train.train("sum-linear", 6, setting=1, config=train.TrainConfig(max_steps=200),
                       on_evaluation=lambda e, stop: evaluations.append((e, stop))) == "not_finite"
    assert len(evaluations) == 1 and evaluations[0][1] == "not_finite"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ---------------------------------------------------------------- sweep and plots

@pytest.fixture(scope="module")
def sweep_logs(tmp_path_factory):
    """Tiny sweeps of both settings, run as two shards each."""
    out = str(tmp_path_factory.mktemp("synthetic_retrieval"))
    small = ["--max-steps", "100", "--out", out]
    for shard in ("0/2", "1/2"):
        sweep.main(["--setting", "1", "--models", "softmax,sum-dpfp1,delta-linear", "--sizes", "4,8",
                    "--shard", shard] + small)
        sweep.main(["--setting", "2", "--models", "sum-dpfp1,delta-dpfp1,fwm-tanh,gated-linear", "--sizes", "4,6",
                    "--shard", shard] + small)
    return out


def test_sweep_writes_one_finished_csv_per_run(sweep_logs):
    runs = {(s, m, S) for s, models, sizes in [(1, ["softmax", "sum-dpfp1", "delta-linear"], [4, 8]),
                                               (2, ["sum-dpfp1", "delta-dpfp1", "fwm-tanh", "gated-linear"], [4, 6])]
            for m in models for S in sizes}
    for setting, model, S in runs:
        with open(os.path.join(sweep_logs, f"setting{setting}", model, f"S{S:04d}.csv")) as f:
            rows = list(csv.DictReader(f))
        assert [int(r["step"]) for r in rows] == [100]
        assert rows[-1]["stop"] in train.STOP_REASONS and int(rows[-1]["seq_len"]) == S * setting
    assert not [name for _, _, names in os.walk(sweep_logs) for name in names if name.endswith(".part")]


@pytest.mark.parametrize("count", [2, 3])
def test_shards_split_the_jobs_without_overlap_and_mix_the_models(count):
    argv = ["--setting", "2", "--out", "unused", "--models", "sum-linear,delta-dpfp1", "--sizes", "20:100:20"]
    shards = [sweep.jobs(sweep.parse_args(argv + ["--shard", f"{k}/{count}"])) for k in range(count)]
    everything = sweep.jobs(sweep.parse_args(argv))
    assert len(everything) == 10 and sorted(sum(shards, [])) == sorted(everything)
    assert all(len(shard) in (10 // count, 10 // count + 1) for shard in shards)
    assert all({model for model, _ in shard} == {"sum-linear", "delta-dpfp1"} for shard in shards)


def test_sweep_skips_finished_runs(sweep_logs, capsys):
    sweep.main(["--setting", "1", "--models", "softmax,sum-dpfp1,delta-linear", "--sizes", "4,8",
                "--max-steps", "100", "--out", sweep_logs])
    assert "0 runs trained" in capsys.readouterr().out


def test_plot_draws_the_figures(sweep_logs, tmp_path):
    plot.main(["--logs", sweep_logs, "--out", str(tmp_path), "--curve-size", "4"])
    for name in ("figure2_capacity", "figure2_delta", "figure3_learning_curves", "figure5_update_rules"):
        image = matplotlib.image.imread(str(tmp_path / f"{name}.png"))[..., :3]
        assert image.shape[0] > 300 and image.shape[1] > 500
        drawn = (image < 0.9).any(-1).mean()  # non-white pixels: axes, text, lines
        coloured = (image.max(-1) - image.min(-1) > 0.3).mean()  # the data lines (axes and text are grey)
        assert drawn > 0.02 and coloured > 3e-4, (name, drawn, coloured)
    summary = (tmp_path / "summary.md").read_text()
    assert "largest S solved" in summary and "DPFP-1 delta (ours)" in summary and "| S | dpfp1 |" in summary


def test_delta_vs_sum_table_divides_the_best_losses_of_matching_runs():
    def run(*losses):
        return [{"eval_loss": loss} for loss in losses]
    runs = {(2, "sum-dpfp1", 20): run(0.3, 0.2), (2, "delta-dpfp1", 20): run(0.1, 0.001, 0.002),
            (2, "sum-linear", 20): run(0.5), (2, "delta-linear", 40): run(0.12), (2, "sum-linear", 40): run(0.4),
            (2, "gated-dpfp1", 20): run(0.4), (1, "sum-dpfp1", 20): run(0.3)}
    assert plot.delta_vs_sum_table(runs)[2:] == ["| S | linear | dpfp1 |", "|---|---|---|",
                                                  "| 20 |  | 200x |", "| 40 | 3.3x |  |"]
    assert plot.delta_vs_sum_table({(2, "sum-dpfp1", 20): run(0.3)}) == []


@pytest.mark.parametrize("flag, value", [("--models", "sum-tanh"), ("--models", "attention"), ("--sizes", "1:9:2"),
                                         ("--sizes", "ten"), ("--shard", "2/2"), ("--setting", "3"),
                                         ("--max-steps", "150"), ("--threads", "0")])
def test_sweep_rejects_bad_values_at_parse_time(flag, value, capsys):
    argv = ["--out", "unused"] + (["--setting", "1"] if flag != "--setting" else [])
    with pytest.raises(SystemExit):
        sweep.parse_args(argv + [flag, value])
    assert flag in capsys.readouterr().err


def test_the_sweep_trains_and_logs_at_the_key_size_it_is_given(tmp_path, monkeypatch):
    built, build = [], train.build_model
    monkeypatch.setattr(train, "build_model", lambda *args: built.append(build(*args)) or built[-1])
    sweep.main(["--setting", "1", "--models", "sum-linear", "--sizes", "4", "--d-key", "8", "--max-steps", "100",
                "--patience", "1", "--out", str(tmp_path)])
    assert [model.W_k.out_features for model in built] == [8]
    rows = read_run(run_path(str(tmp_path), 1, "sum-linear", 4))
    assert rows[-1]["d_key"] == 8 and rows[-1]["step"] == 100
