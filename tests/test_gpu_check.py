"""The GPU check's driver (scripts/gpu_check.py) on the CPU: its dry run must keep working; and its parts that
need no GPU: the autotune winners' recording and loading, the calls it replays, the cases it selects, the report
that several calls complete, the plan's count of compiled kernels."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_check  # noqa: E402
import gpu_check_calls  # noqa: E402
import gpu_check_cases  # noqa: E402
import gpu_check_report  # noqa: E402
from fairseq_fwp.ops import fla_configs  # noqa: E402


def test_losses_are_read_from_the_training_log():
    log = ("| train_inner | epoch 001:      1 / 9 loss=5.881, nll_loss=5.1, ppl=58.95\n"
           "| train_inner | epoch 001:      2 / 9 loss=nan, nll_loss=nan, ppl=nan\n"
           "| valid | epoch 001 | valid on 'valid' subset | loss 5.501 | ppl 45.27\n")
    values = gpu_check.losses(log)
    assert values[0] == 5.881 and len(values) == 2 and values[1] != values[1]  # nan


def test_the_times_of_the_first_and_the_later_updates_are_read_from_the_training_log():
    log = ("| train_inner | epoch 001:  1 / 9 loss=5.8, ups=0, num_updates=1, lr=1e-05, train_wall=41, wall=44\n"
           "| train_inner | epoch 001:  2 / 9 loss=5.7, ups=20, num_updates=2, lr=2e-05, train_wall=0, wall=44\n"
           "| train_inner | epoch 001:  3 / 9 loss=5.6, ups=25, num_updates=3, lr=3e-05, train_wall=0, wall=44\n"
           "| train_inner | epoch 001:  4 / 9 loss=5.5, ups=40, num_updates=4, lr=4e-05, train_wall=0, wall=44\n")
    assert gpu_check.update_times(log) == (44.0, 1 / 25)


def test_a_table_row_is_told_from_its_header():
    assert gpu_check.first_row_line("intro\n\n| a | b |\n|---|---|\n") is None
    assert gpu_check.first_row_line("intro\n\n| a | b |\n|---|---|\n| 1 | 2 |\n") == 4


CUT_SHORT = """
import time

def test_passes():
    pass

def test_fails():
    assert 1 + 1 == 3, "one and one make three"

def test_never_ends():
    time.sleep(600)
"""


def test_a_failure_is_in_the_report_as_soon_as_pytest_reports_it(tmp_path):
    """The plugin writes each outcome as it comes: a run stopped at its time limit, as the GPU check stops
    a part, still says which test failed and why."""
    (tmp_path / "test_cut_short.py").write_text(CUT_SHORT)
    section = tmp_path / "section.md"
    env = dict(os.environ, GPU_CHECK_SECTION=str(section), GPU_CHECK_HEADER="The header.",
               PYTHONPATH=os.path.join(ROOT, "scripts"))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "gpu_check_plugin", "-p", "no:cacheprovider",
                             "test_cut_short.py"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (section.exists() and "| 1 | 1 |" in section.read_text()):
        time.sleep(0.2)  # until one test has passed and one failed: the third never ends
    proc.kill()
    proc.wait()
    text = section.read_text()
    assert text.startswith("The header.\n")
    assert "| test_cut_short.py | 1 | 1 | 0 |" in text
    assert "- `test_cut_short.py::test_fails` (call): AssertionError: one and one make three" in text
    assert "pytest exit status" not in text  # it never finished


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU's part")
def test_dry_run_runs_every_part_and_reports(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--updates", "20",
                           "--train-step-rows", "fairseq-softmax,linear-delta", "--time-scale", "10",
                           "--report-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = tmp_path / "gpu_check_dry_run.md"
    text = report.read_text()
    assert report.name == "gpu_check_dry_run.md" and text.startswith("How to read this report")
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    titles = [f"## {gpu_check.PARTS[part].title}" for part in gpu_check.DEFAULT_PARTS]
    assert sections == ["## What ran on the GPU", *titles, "## Outcome"]
    assert re.search(r"\| test_fla\.py \| 0 \| 0 \| [1-9]\d* \|", text)  # its GPU tests only, skipped here
    assert re.search(r"\| 64 \| linear-delta \| [\d,]+ \| [\d.]+x \|", text)
    bf16_rows = [line for line in text.splitlines() if "| --bf16 | chunked |" in line]
    assert len(bf16_rows) == 2 and all("| yes |" in row for row in bf16_rows)
    assert any("| fairseq-train |" in row for row in bf16_rows)
    assert any("| python -m fairseq_cli.train |" in row for row in bf16_rows)
    assert text.count("skipped: needs CUDA") == 5  # compile, the fp16 and amp trainings, first-step, the benchmark
    for row in ("fairseq-softmax", "linear-delta"):  # the profile part's rows, each with its costliest ops
        assert re.search(rf"### Profile: {row}, T = 64: one step, [\d.]+ ms of CPU time.*\n\n\| op \| calls \| ms \| "
                         rf"share \|\n\|---\|---\|---\|---\|\n(\| `.+` \| \d+ \| [\d.]+ \| [\d.]+% \|\n){{25}}", text)
    for part in ("compile: skipped", "tests: skipped", "train-step: passed", "benchmark: skipped", "training: passed",
                 "profile: passed", "first-step: skipped"):
        assert f"- {part} (" in text
    assert "## What ran on the GPU\n\n- nothing yet\n" in text and "device: none (dry run on the CPU)" in text


@pytest.mark.slow
def test_a_part_past_its_time_limit_is_stopped_and_reported(tmp_path):
    scale = 0.05  # a few seconds: the corpora's preprocessing alone takes longer
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--parts", "training",
                           "--time-scale", str(scale), "--report-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    report = tmp_path / "gpu_check_dry_run.md"
    limit = gpu_check.PARTS["training"].limit * scale
    assert f"- training: stopped at its time limit ({limit:.0f} s)" in report.read_text(), report.read_text()[-2000:]
    assert proc.returncode == 0


# -- fla's autotune winners, recorded and preloaded (fairseq_fwp/ops/fla_configs) ------------------------------

FAKE_GPU = "NVIDIA Fake GPU 9000"
VERSIONS = {"fla": "0.6.0", "triton": "3.6.0"}


def autotune_result(cache, kernel, key, timings):
    """A Triton {kernel}.autotune.json as cache_results writes it: the key, and each config's timings."""
    folder = cache / f"hash-{kernel}-{len(list(cache.glob('*')))}"
    folder.mkdir(parents=True)
    (folder / f"{kernel}.autotune.json").write_text(json.dumps({"key": key, "configs_timings": [
        ({"kwargs": {"BV": bv}, "num_warps": warps, "num_stages": 2, "num_ctas": 1, "maxnreg": None,
          "pre_hook": None}, timing) for (bv, warps), timing in timings]}))


def test_the_fastest_config_of_each_key_is_recorded_in_flas_own_format(tmp_path):
    from fla.ops.utils.cache import AutotuneKey

    key = [12, 64, 64, False, "torch.bfloat16", "torch.float32"]
    autotune_result(tmp_path / "triton", "chunk_fwd_kernel_o", key,
                    [((32, 4), [0.30, 0.2, 0.4]), ((64, 8), [0.10, 0.1, 0.2]), ((64, 4), [float("inf")] * 3)])
    autotune_result(tmp_path / "triton", "chunk_fwd_kernel_o", key,  # another shard of the same key's configs
                    [((32, 8), [0.20, 0.2, 0.3]), ((16, 4), [0.15, 0.1, 0.2])])
    folder, new = fla_configs.record(tmp_path / "triton", FAKE_GPU, (9, 0), VERSIONS, root=tmp_path / "configs")
    assert folder.name == "NVIDIA_Fake_GPU_9000" and new == 1
    written = json.loads((folder / "chunk_fwd_kernel_o.json").read_text())
    entry = written["autotune_entries"][AutotuneKey.key_hash(tuple(key))]  # fla's own name for the key
    assert entry == {"autotune_key": key, "config": {"kwargs": {"BV": 64}, "num_warps": 8, "num_stages": 2,
                                                     "num_ctas": 1}}
    assert json.loads((folder / "recorded.json").read_text())["capability"] == [9, 0]
    assert fla_configs.record(tmp_path / "triton", FAKE_GPU, (9, 0), VERSIONS, root=tmp_path / "configs")[1] == 0


def test_flas_own_config_cache_reads_the_recorded_files(tmp_path, monkeypatch):
    import fla.ops.utils.cache as fla_cache

    key = [12, 64, 64, False, "torch.bfloat16"]
    autotune_result(tmp_path / "triton", "chunk_fwd_kernel_o", key, [((32, 4), 0.3), ((64, 8), 0.1)])
    folder, _ = fla_configs.record(tmp_path / "triton", FAKE_GPU, (9, 0), VERSIONS, root=tmp_path)
    monkeypatch.setenv("FLA_CONFIG_DIR", str(folder))
    monkeypatch.setattr(fla_cache, "FLA_CACHE_MODE", fla_cache.FlaCacheMode.STRICT)
    config = fla_cache.load_cached_config("chunk_fwd_kernel_o", fla_cache.AutotuneKey(tuple(key)))
    assert config["kwargs"] == {"BV": 64} and config["num_warps"] == 8


def test_a_gpu_takes_its_own_winners_else_those_of_its_architecture_and_fla_version(tmp_path):
    (tmp_path / "triton").mkdir()
    for gpu, capability, fla_version in (("NVIDIA H200", (9, 0), "0.6.0"), ("NVIDIA H100 80GB HBM3", (9, 0), "0.6.0"),
                                         ("NVIDIA A100", (8, 0), "0.6.0"), ("NVIDIA H20", (9, 0), "0.5.0")):
        fla_configs.record(tmp_path / "triton", gpu, capability, {**VERSIONS, "fla": fla_version}, root=tmp_path)
    found = lambda gpu, capability, fla_version="0.6.0": getattr(  # noqa: E731
        fla_configs.folder_for(gpu, capability, fla_version, tmp_path), "name", None)
    assert found("NVIDIA H200", (9, 0)) == "NVIDIA_H200"
    assert found("NVIDIA H100 80GB HBM3", (9, 0)) == "NVIDIA_H100_80GB_HBM3"  # its own, not the H200's
    assert found("NVIDIA GH200 480GB", (9, 0)) in ("NVIDIA_H200", "NVIDIA_H100_80GB_HBM3")  # its architecture's
    assert found("NVIDIA H20", (9, 0), "0.5.0") == "NVIDIA_H20"
    assert found("NVIDIA H200", (9, 0), "0.5.0") == "NVIDIA_H20"
    assert found("NVIDIA A100", (8, 0)) == "NVIDIA_A100"
    assert found("NVIDIA L4", (8, 9)) is None and found("NVIDIA H200", (9, 0), "0.7.0") is None


def flas_autotuner(name):
    import fla.ops  # noqa: F401  (every kernel)

    return next(tuner for tuner in fla_configs._fla_autotuners() if tuner.base_fn.__name__ == name)


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """fla_configs.preload() on a fake GPU, with its winners under tmp_path; fla's autotuners' caches restored."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: FAKE_GPU)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    monkeypatch.setattr(fla_configs, "FOLDER", tmp_path / "configs")
    for name in fla_configs.USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    import fla

    tuner = flas_autotuner("chunk_fwd_kernel_o")
    saved = dict(tuner.cache)
    candidate = tuner.configs[-1]
    key = (12, 64, 64, 64, False, "torch.bfloat16")
    autotune_result(tmp_path / "triton", "chunk_fwd_kernel_o", list(key), [])
    result = next((tmp_path / "triton").glob("*/*.json"))
    result.write_text(json.dumps({"key": list(key), "configs_timings": [
        ({"kwargs": candidate.kwargs, "num_warps": candidate.num_warps, "num_stages": candidate.num_stages,
          "num_ctas": 1}, 0.1), ({"kwargs": {"BV": 7}, "num_warps": 1, "num_stages": 1, "num_ctas": 1}, 0.2)]}))
    fla_configs.record(tmp_path / "triton", FAKE_GPU, (9, 0), {**VERSIONS, "fla": fla.__version__})
    yield tuner, key, candidate
    tuner.cache.clear()
    tuner.cache.update(saved)


def test_fla_starts_with_the_winners_recorded_for_the_gpu(fake_gpu):
    tuner, key, candidate = fake_gpu
    assert fla_configs.preload.__wrapped__().name == "NVIDIA_Fake_GPU_9000"
    assert tuner.cache[key] is candidate  # the kernel's own config: Triton runs it without autotuning


def test_a_recorded_config_that_is_not_the_kernels_own_is_not_taken(fake_gpu):
    tuner, key, candidate = fake_gpu
    recorded = {"chunk_fwd_kernel_o": [(key, {"kwargs": {"BV": 7}, "num_warps": 1, "num_stages": 1})]}
    tuner.cache.pop(key, None)
    assert fla_configs.fill([tuner], recorded) == 0 and key not in tuner.cache


@pytest.mark.parametrize("setting", ["FLA_CACHE_MODE", "FLA_CONFIG_DIR"])
def test_flas_own_settings_leave_fla_to_itself(fake_gpu, monkeypatch, setting):
    tuner, key, _ = fake_gpu
    tuner.cache.pop(key, None)
    monkeypatch.setenv(setting, "disabled" if setting == "FLA_CACHE_MODE" else "/somewhere")
    assert fla_configs.preload.__wrapped__() is None and key not in tuner.cache


@pytest.mark.parametrize("damage", ["cut short", "not an object", "another format", "entries without configs"])
def test_a_damaged_recorded_file_is_skipped_with_a_warning_and_fla_runs_on(fake_gpu, tmp_path, caplog, damage):
    """A recorded file cut short, edited by hand or of another format is skipped, with a warning naming it: fla
    autotunes what it would have started with, and --fwp-backend auto still chooses, on CUDA too."""
    tuner, key, candidate = fake_gpu
    folder = tmp_path / "configs" / "NVIDIA_Fake_GPU_9000"
    target = folder / ("recorded.json" if damage in ("cut short", "not an object") else "chunk_fwd_kernel_o.json")
    text = target.read_text()
    target.write_text({"cut short": text[:len(text) // 2], "not an object": "[1, 2]",
                       "another format": json.dumps({"kernel_name": "chunk_fwd_kernel_o", "autotune_entries": [1]}),
                       "entries without configs": json.dumps({"kernel_name": "chunk_fwd_kernel_o",
                                                              "autotune_entries": {"a": {"autotune_key": [1]}}})
                       }[damage])
    tuner.cache.pop(key, None)
    with caplog.at_level("WARNING", logger="fairseq_fwp.backend"):
        fla_configs.preload.__wrapped__()
    assert key not in tuner.cache
    assert any(f"{target} skipped" in record.getMessage() for record in caplog.records)


def test_a_recording_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A run stopped while it writes (a full disk, a killed job) leaves each file as it was, never cut short."""
    key = [12, 64, 64, False, "torch.bfloat16"]
    autotune_result(tmp_path / "triton", "chunk_fwd_kernel_o", key, [((32, 4), 0.3), ((64, 8), 0.1)])
    folder, _ = fla_configs.record(tmp_path / "triton", FAKE_GPU, (9, 0), VERSIONS, root=tmp_path)
    before = {path.name: path.read_text() for path in folder.iterdir()}
    autotune_result(tmp_path / "triton", "chunk_fwd_kernel_o", [13, *key[1:]], [((32, 4), 0.3)])
    written = Path.write_text

    def stopped(path, text, *args, **kwargs):
        written(path, text[:10], *args, **kwargs)
        raise OSError("No space left on device")

    monkeypatch.setattr(Path, "write_text", stopped)
    with pytest.raises(OSError, match="No space left"):
        fla_configs.record(tmp_path / "triton", FAKE_GPU, (9, 0), VERSIONS, root=tmp_path)
    monkeypatch.undo()
    assert {path.name: path.read_text() for path in folder.iterdir()} == before


# -- what the compile part replays (scripts/gpu_check_calls.py) ------------------------------------------------


def test_a_call_into_fla_is_written_read_and_resized():
    call = gpu_check_calls.FlaCall("delta", "sequence", (((1, 12, 2048, 64), "bfloat16", True),
                                                         ((1, 12, 2048, 64), "bfloat16", True),
                                                         ((1, 12, 2048, 64), "bfloat16", True),
                                                         ((1, 12, 2048), "bfloat16", True), None, None),
                                   "bfloat16", True)
    assert gpu_check_calls.FlaCall.from_json(json.loads(json.dumps(call.to_json()))) == call
    wide = call.with_batch(16).with_dtype("bfloat16", "float16")
    assert wide.inputs[0] == ((16, 12, 2048, 64), "float16", True) and wide.inputs[4] is None
    assert wide.dtype == "float16" and call.inputs[0][0][0] == 1


def test_the_compile_part_replays_each_distinct_call_once():
    def call(H, T):
        q = [[2, H, T, 64], "bfloat16", True]
        return {"rule": "delta", "form": "sequence", "dtype": "bfloat16", "needs_grad": True, "compiles": 10,
                "inputs": {"q": q, "k": q, "v": q, "beta": None, "state": None, "log_decay": None}}

    planned = {"tests": [call(12, 200), call(4, 64)], "training": [call(4, 64), call(4, 32), call(12, 200)]}
    assert gpu_check_calls.distinct(planned) == [call(12, 200), call(4, 64), call(4, 32)]


@pytest.mark.parametrize("configs", [1, 2, 3, 7, 48])
def test_each_config_is_timed_in_one_process_two_or_more_a_process(configs):
    """The compile part's processes share every autotuning: each config once, none alone in a process (Triton
    times a list of one not at all)."""
    shards = [gpu_check_calls.shard(list(range(configs)), "chunk_fwd_kernel_h", (12, 64), process, 16)
              for process in range(16)]
    assert sorted(c for shard in shards for c in shard) == list(range(configs))
    assert all(len(shard) >= 2 for shard in shards if shard) or configs == 1


# -- which GPU cases the tests part runs (tests/gpu_check_cases.py, scripts/gpu_check_plugin.py) ----------------


def test_the_check_narrows_the_gpu_cases_of_the_files_that_reach_fla():
    shape, other = gpu_check_cases.SHAPES[0], (1, 2, 77, 256, 32)
    assert gpu_check_cases.selected("tests/test_fla.py", {"gpu": "cuda", "shape": shape, "dtype": torch.bfloat16})
    assert not gpu_check_cases.selected("tests/test_fla.py", {"gpu": "cuda", "shape": other})
    assert not gpu_check_cases.selected("tests/test_fla.py", {"gpu": "cuda", "dtype": torch.float16})
    assert gpu_check_cases.selected("tests/test_kernels.py", {"gpu": "cuda", "shape": other, "dtype": torch.float16})


CASES = """
import pytest

@pytest.mark.parametrize("gpu, shape", [("cuda", (2, 12, 200, 64, 64)), ("cuda", (1, 2, 77, 256, 32)),
                                        ("stand-in", (1, 2, 77, 256, 32))])
def test_on_gpu(gpu, shape):
    pass
"""


@pytest.mark.parametrize("selection, collected", [("check", 2), ("all", 3)])
def test_the_plugin_deselects_the_gpu_cases_the_check_does_not_run(tmp_path, selection, collected):
    (tmp_path / "test_fla.py").write_text(CASES)
    env = dict(os.environ, GPU_CHECK_SELECTION=selection, PYTHONPATH=os.path.join(ROOT, "scripts"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "gpu_check_plugin", "-p", "no:cacheprovider",
                           "--collect-only", "-q", "test_fla.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True)
    assert f"{collected}/3 tests collected" in proc.stdout or f"{collected} tests collected" in proc.stdout, proc.stdout


# -- the report that several calls complete (scripts/gpu_check_report.py) ------------------------------------


def test_a_parts_digest_changes_with_its_sources_only(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "op.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "winners.json").write_text("{}\n")
    patterns = ("pkg/**/*.py",)
    before = gpu_check_report.digest(patterns, tmp_path)
    (tmp_path / "pkg" / "winners.json").write_text('{"more": 1}\n')
    assert gpu_check_report.digest(patterns, tmp_path) == before
    (tmp_path / "pkg" / "op.py").write_text("x = 2\n")
    assert gpu_check_report.digest(patterns, tmp_path) != before


def result(part, digest, date="2026-12-01T10:00", commit="abc1234"):
    return gpu_check_report.PartResult(title=f"Part {part}", outcome="passed", summary="passed (10 s; no row)",
                                       text=f"what {part} said", on_gpu=[f"{part} ran"], date=date, commit=commit,
                                       device="NVIDIA H200", digest=digest)


def test_later_calls_complete_one_report_and_drop_a_result_whose_sources_changed(tmp_path):
    path = str(tmp_path / "report.md")
    first = gpu_check_report.Report(path, ["- date: first"], ["a", "b", "c"], {"a": "1", "b": "2", "c": "3"})
    first.finish("a", result("a", "1"))
    first.finish("b", result("b", "2"))
    later = gpu_check_report.Report(path, ["- date: later"], ["a", "b", "c"], {"a": "1", "b": "changed", "c": "3"})
    later.finish("c", result("c", "3", date="2026-12-02T09:00", commit="def5678"))
    text = (tmp_path / "report.md").read_text()
    assert "## Part a" in text and "what a said" in text
    assert "_Run 2026-12-01T10:00 on NVIDIA H200, commit abc1234" in text
    assert "## Part c" in text and "commit def5678" in text and "- date: later" in text
    assert "## Part b" not in text and "- b: not run since the files it checks changed" in text
    assert "- a ran (2026-12-01T10:00, NVIDIA H200)" in text and "- b ran" not in text
    kept = json.loads((tmp_path / "report.json").read_text())
    assert sorted(kept) == ["a", "c"] and kept["c"]["commit"] == "def5678"


def test_every_part_names_its_sources_and_they_exist():
    for name, part in gpu_check.PARTS.items():
        assert gpu_check_report.source_files(part.sources, ROOT), name
        assert not any("fla_configs" in f and f.endswith(".json")
                       for f in gpu_check_report.source_files(part.sources, ROOT))


# -- the plan's count of compiled kernels (scripts/gpu_check_plan.py) -------------------------------------------

LEDGER = """
import sys
sys.path.insert(0, {scripts!r})
import gpu_check_plan as plan
plan.pretend_gpu("NVIDIA H200")
import torch, triton, triton.language as tl

@triton.autotune(configs=[triton.Config({{"B": b}}, num_warps=w) for b in (16, 32) for w in (2, 4)], key=["N"])
@triton.jit
def twice(x, y, N, M, B: tl.constexpr):
    pass

def run(ledger, N, M=16, dtype=torch.float32):
    x = torch.zeros(64, dtype=dtype)
    with ledger.recording():
        twice[(1,)](x, x, N, M)

cold = plan.Ledger()
for N, M in ((64, 16), (64, 16), (128, 16), (17, 16), (64, 17)):
    run(cold, N, M)
run(cold, 64, 16, torch.float16)
recorded = plan.Ledger(frozenset({{("twice", (64, "torch.float32", "torch.float32"))}}))
for N in (64, 17):
    run(recorded, N)
print(len(cold.cold), len(recorded.cold), len(recorded.warm), cold.kernels())
"""


def test_the_plan_counts_every_config_of_a_new_key_and_one_of_a_recorded_key(tmp_path):
    """An autotuned kernel (key N) compiles its 4 configs for a new key, once per specialization of its
    arguments: N = 64 and 128 (multiples of 16) share theirs, N = 17 and float16 tensors do not; a key it has
    tuned, at a new specialization (M = 17), compiles its winner alone: 13. With the key N = 64 recorded: 1
    config there, and 4 for N = 17."""
    script = tmp_path / "ledger.py"
    script.write_text(LEDGER.format(scripts=os.path.join(ROOT, "scripts")))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[:3] == ["13", "8", "5"], proc.stdout
    assert "[('twice', 4, 13, 13)]" in proc.stdout, proc.stdout
