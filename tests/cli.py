"""Run the real fairseq-* commands of this environment on tiny generated data."""
import os
import subprocess
import sys

from fairseq_models import PLUGIN_DIR

BIN_DIR = os.path.dirname(sys.executable)


def fairseq(command, *args, cwd=None):
    """Run fairseq-<command>; returns its combined output, or fails the test with its tail."""
    proc = subprocess.run(
        [os.path.join(BIN_DIR, f"fairseq-{command}"), *map(str, args)],
        cwd=cwd, capture_output=True, text=True,
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"fairseq-{command} failed ({proc.returncode}):\n{output[-4000:]}")
    return output


def preprocess_translation(raw_dir, dest):
    fairseq("preprocess", "--source-lang", "src", "--target-lang", "tgt",
            "--trainpref", f"{raw_dir}/train", "--validpref", f"{raw_dir}/valid", "--testpref", f"{raw_dir}/test",
            "--destdir", dest, "--joined-dictionary", "--workers", 1)


def preprocess_lm(raw_dir, dest):
    fairseq("preprocess", "--only-source", "--trainpref", f"{raw_dir}/train.txt",
            "--validpref", f"{raw_dir}/valid.txt", "--testpref", f"{raw_dir}/test.txt",
            "--destdir", dest, "--workers", 1)


COMMON_TRAIN = ["--user-dir", PLUGIN_DIR, "--optimizer", "adam", "--adam-betas", "(0.9,0.98)",
                "--lr-scheduler", "inverse_sqrt", "--log-format", "simple", "--log-interval", 1,
                "--no-epoch-checkpoints", "--seed", 1]


def train_translation(data, save_dir, *flags, max_update=6, lr=0.002, warmup=50):
    return fairseq("train", data, *COMMON_TRAIN, "--arch", "fwp_transformer_tiny", "--lr", lr,
                   "--warmup-updates", warmup, "--max-tokens", 2000, "--max-update", max_update,
                   "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", 0.1,
                   "--save-dir", save_dir, *flags)


def train_lm(data, save_dir, *flags, max_update=6):
    return fairseq("train", data, *COMMON_TRAIN, "--task", "language_modeling", "--arch", "fwp_lm_tiny",
                   "--tokens-per-sample", 64, "--sample-break-mode", "none", "--lr", 0.002,
                   "--warmup-updates", 20, "--max-tokens", 1024, "--max-update", max_update,
                   "--save-dir", save_dir, *flags)
