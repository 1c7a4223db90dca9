"""The fairseq pipeline on the built-in synthetic corpora, one function per step.

Used by the quickstart (quickstart.py) and by the end-to-end tests, so what
the tests prove is what the quickstart runs. Every step calls the real
fairseq-* command of the current environment.
"""
import re
import shutil

from .commands import PLUGIN_DIR, fairseq


def preprocess_translation(raw_dir, dest):
    shutil.rmtree(dest, ignore_errors=True)  # fairseq-preprocess refuses to overwrite; reruns start clean
    fairseq("preprocess", "--source-lang", "src", "--target-lang", "tgt",
            "--trainpref", f"{raw_dir}/train", "--validpref", f"{raw_dir}/valid", "--testpref", f"{raw_dir}/test",
            "--destdir", dest, "--joined-dictionary", "--workers", 1)


def preprocess_lm(raw_dir, dest):
    shutil.rmtree(dest, ignore_errors=True)
    fairseq("preprocess", "--only-source", "--trainpref", f"{raw_dir}/train.txt",
            "--validpref", f"{raw_dir}/valid.txt", "--testpref", f"{raw_dir}/test.txt",
            "--destdir", dest, "--workers", 1)


# --num-workers 0: batches load in the training process. With fairseq's default (a loader process per
# iterator), every epoch's end waited about 5 s for the finished loaders to shut down: on these small
# corpora, a 12-update run of three epochs took 17.5 s instead of 2.5 s.
COMMON_TRAIN = ["--user-dir", PLUGIN_DIR, "--optimizer", "adam", "--adam-betas", "(0.9,0.98)",
                "--lr-scheduler", "inverse_sqrt", "--log-format", "simple", "--log-interval", 1,
                "--no-epoch-checkpoints", "--seed", 1, "--num-workers", 0]


def train_translation(data, save_dir, *flags, max_update=6, lr=0.002, warmup=50, **run):
    """fairseq-train on a translation corpus; `run` goes to commands.fairseq (log, watch)."""
    return fairseq("train", data, *COMMON_TRAIN, "--arch", "fwp_transformer_tiny", "--lr", lr,
                   "--warmup-updates", warmup, "--max-tokens", 2000, "--max-update", max_update,
                   "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", 0.1,
                   "--save-dir", save_dir, *flags, **run)


# Batching flags of each LM task: blocks of tokens, or parallel streams (fwp_stream_lm).
LM_BATCHING = {"language_modeling": ["--sample-break-mode", "none", "--max-tokens", 1024],
               "fwp_language_modeling": ["--sample-break-mode", "none", "--max-tokens", 1024],
               "fwp_stream_lm": ["--batch-size", 4]}


def train_lm(data, save_dir, *flags, max_update=6, tokens_per_sample=64, task="language_modeling", **run):
    """fairseq-train on an LM corpus; `run` goes to commands.fairseq (as_module, log, watch)."""
    return fairseq("train", data, *COMMON_TRAIN, "--task", task, *LM_BATCHING[task], "--arch", "fwp_lm_tiny",
                   "--tokens-per-sample", tokens_per_sample, "--lr", 0.002, "--warmup-updates", 20,
                   "--max-update", max_update, "--save-dir", save_dir, *flags, **run)


def generate(data, checkpoint, *flags, **run):
    """Beam 4, sacreBLEU on the test split, every sentence kept."""
    return fairseq("generate", data, "--user-dir", PLUGIN_DIR, "--path", checkpoint, "--gen-subset", "test",
                   "--beam", 4, "--batch-size", 16, "--scoring", "sacrebleu", *flags, **run)


def eval_lm(data, checkpoint, *flags, tokens_per_sample=64, batch_size=4, **run):
    return fairseq("eval-lm", data, "--user-dir", PLUGIN_DIR, "--path", checkpoint, "--gen-subset", "test",
                   "--tokens-per-sample", tokens_per_sample, "--batch-size", batch_size, *flags, **run)


def bleu(output):
    match = re.search(r"BLEU = ([0-9.]+)", output)
    if not match:
        raise ValueError(f"no BLEU line in:\n{output[-2000:]}")
    return float(match.group(1))


def perplexity(output):
    return float(re.search(r"Perplexity: ([0-9.]+)", output).group(1))


def train_words_per_second(log):
    """Words per second over the whole training: fairseq's end-of-epoch wps weighted by each epoch's
    train_wall (a plain mean would count a final epoch of a few updates, and its low wps, as much as
    a full one)."""
    epochs = [(float(wps), float(wall)) for wps, wall in
              re.findall(r"\| train \| .*?\| wps ([0-9.]+) \|.*?\| train_wall ([0-9.]+)", log)]
    seconds = sum(wall for _, wall in epochs)
    return sum(wps * wall for wps, wall in epochs) / seconds if seconds else None


def validation_losses(log):
    """[(updates, validation loss)] from fairseq-train's log, in order."""
    return [(int(updates), float(loss)) for loss, updates in
            re.findall(r"\| valid \| .*?\| loss ([0-9.]+) \|.*?\| num_updates (\d+)", log)]


def improvement(log, last_updates):
    """How much the best validation loss fell (relative) in the last `last_updates` updates of the log;
    None where the log has no validation that old."""
    losses = validation_losses(log)
    if not losses:
        return None
    end = losses[-1][0]
    before = [loss for updates, loss in losses if updates <= end - last_updates]
    if not before:
        return None
    best_before = min(before)
    return (best_before - min(loss for _, loss in losses)) / best_before
