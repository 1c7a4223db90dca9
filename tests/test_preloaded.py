"""examples/recipes/preloaded.py: a fairseq command run by the preloaded server is the command its console
script runs: the same output, exit status, working folder and environment."""
import os
import re
import subprocess

import pytest

from examples.recipes import commands, preloaded
from examples.recipes.pipeline import generate, train_translation

pytestmark = pytest.mark.slow  # fairseq's command-line tools, end to end


@pytest.fixture
def launches(monkeypatch):
    """Runs `fairseq(...)` once as a new process and once through the server: (new, preloaded) outputs."""
    def both(*args, **kwargs):
        outputs = []
        for mode in ("0", "1"):
            monkeypatch.setenv("FAIRSEQ_FWP_PRELOAD", mode)
            outputs.append(commands.fairseq(*args, **kwargs))
        return outputs
    return both


def test_generate_prints_the_same_hypotheses_either_way(corpora, tmp_path, launches, monkeypatch):
    monkeypatch.setenv("FAIRSEQ_FWP_PRELOAD", "1")
    train_translation(corpora["mt"], tmp_path, max_update=2)
    new, served = launches("generate", corpora["mt"], "--user-dir", commands.PLUGIN_DIR,
                           "--path", tmp_path / "checkpoint_last.pt", "--beam", 2, "--max-len-b", 5)
    hypotheses = [[line for line in out.splitlines() if line.startswith("H-")] for out in (new, served)]
    assert hypotheses[0] and hypotheses[0] == hypotheses[1]


def test_a_failing_command_fails_the_same_way(tmp_path, launches, monkeypatch):
    for mode in ("0", "1"):
        monkeypatch.setenv("FAIRSEQ_FWP_PRELOAD", mode)
        with pytest.raises(RuntimeError, match=r"fairseq-train failed \(2\):[\s\S]*--fwp-update-rule"):
            commands.fairseq("train", tmp_path, "--user-dir", commands.PLUGIN_DIR, "--arch", "fwp_lm_tiny",
                             "--task", "language_modeling", "--fwp-update-rule", "no-such-rule")


def test_the_child_has_the_callers_folder_and_environment(tmp_path, monkeypatch, corpora):
    """fairseq-preprocess writes where the caller stands, and the caller's variables reach the command's
    --user-dir, imported in the child as fairseq-train imports it."""
    monkeypatch.setenv("FAIRSEQ_FWP_PRELOAD", "1")
    monkeypatch.setenv("PROBE_VARIABLE", "seen")
    monkeypatch.chdir(tmp_path)
    out = commands.fairseq("preprocess", "--only-source", "--trainpref", os.path.join(corpora["raw_lm"], "train.txt"),
                           "--destdir", "here", "--workers", 1)
    assert (tmp_path / "here" / "dict.txt").is_file() and "Wrote preprocessed data" in out
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "__init__.py").write_text("import os\nprint('probe:', os.environ['PROBE_VARIABLE'], os.getcwd())\n")
    lines, wait = preloaded.launch("train", ["--user-dir", str(probe), "--help"])
    assert f"probe: seen {tmp_path}" in "".join(lines) and wait() == 0
    lines, wait = preloaded.launch("train", ["--user-dir", str(tmp_path / "nowhere")])
    assert wait() != 0  # fails the command, not the server
    lines, wait = preloaded.launch("preprocess", ["--help"])
    assert "usage: fairseq-preprocess" in "".join(lines) and wait() == 0


def test_training_logs_the_same_lines_either_way(corpora, tmp_path, monkeypatch):
    """Each line's level, logger and words, in order (fairseq-train configures logging when imported)."""
    logs = []
    for mode in ("0", "1"):
        monkeypatch.setenv("FAIRSEQ_FWP_PRELOAD", mode)
        logs.append(commands.fairseq(
            "train", corpora["lm"], "--user-dir", commands.PLUGIN_DIR, "--task", "language_modeling",
            "--arch", "fwp_lm_tiny", "--tokens-per-sample", 32, "--max-tokens", 256, "--optimizer", "adam",
            "--lr", 1e-3, "--max-update", 3, "--log-interval", 1, "--log-format", "simple", "--seed", 1,
            "--save-dir", tmp_path / mode))
    lines = [re.findall(r"\| (\w+) \| ([\w.]+) \| ([^\d/]*)", log) for log in logs]
    assert len(lines[0]) > 10 and lines[0] == lines[1]


def test_a_stand_in_on_path_runs_its_command_on_the_server(tmp_path, monkeypatch):
    """What bash runs as fairseq-preprocess is the command, its output and exit status included."""
    monkeypatch.delenv("FAIRSEQ_FWP_PRELOAD_SOCKET", raising=False)
    env = dict(os.environ, **preloaded.stand_ins(str(tmp_path / "bin")))
    env["PATH"] = os.pathsep.join([str(tmp_path / "bin"), env["PATH"]])
    ok = subprocess.run(["bash", "-c", "fairseq-preprocess --help | head -1"], env=env, capture_output=True, text=True)
    assert ok.stdout.startswith("usage: fairseq-preprocess") and ok.returncode == 0
    failed = subprocess.run(["bash", "-c", "fairseq-train --user-dir nowhere"], env=env, cwd=tmp_path,
                            capture_output=True, text=True)
    assert failed.returncode != 0 and "nowhere" in failed.stdout
