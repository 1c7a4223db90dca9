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


COMMON_TRAIN = ["--user-dir", PLUGIN_DIR, "--optimizer", "adam", "--adam-betas", "(0.9,0.98)",
                "--lr-scheduler", "inverse_sqrt", "--log-format", "simple", "--log-interval", 1,
                "--no-epoch-checkpoints", "--seed", 1]


def train_translation(data, save_dir, *flags, max_update=6, lr=0.002, warmup=50):
    return fairseq("train", data, *COMMON_TRAIN, "--arch", "fwp_transformer_tiny", "--lr", lr,
                   "--warmup-updates", warmup, "--max-tokens", 2000, "--max-update", max_update,
                   "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", 0.1,
                   "--save-dir", save_dir, *flags)


# Batching flags of each LM task: blocks of tokens, or parallel streams (fwp_stream_lm).
LM_BATCHING = {"language_modeling": ["--sample-break-mode", "none", "--max-tokens", 1024],
               "fwp_stream_lm": ["--batch-size", 4]}


def train_lm(data, save_dir, *flags, max_update=6, tokens_per_sample=64, task="language_modeling", as_module=False):
    return fairseq("train", data, *COMMON_TRAIN, "--task", task, *LM_BATCHING[task], "--arch", "fwp_lm_tiny",
                   "--tokens-per-sample", tokens_per_sample, "--lr", 0.002, "--warmup-updates", 20,
                   "--max-update", max_update, "--save-dir", save_dir, *flags, as_module=as_module)


def generate(data, checkpoint, *flags):
    """Beam 4, sacreBLEU on the test split, every sentence kept."""
    return fairseq("generate", data, "--user-dir", PLUGIN_DIR, "--path", checkpoint, "--gen-subset", "test",
                   "--beam", 4, "--batch-size", 16, "--scoring", "sacrebleu", *flags)


def eval_lm(data, checkpoint, *flags, tokens_per_sample=64, batch_size=4):
    return fairseq("eval-lm", data, "--user-dir", PLUGIN_DIR, "--path", checkpoint, "--gen-subset", "test",
                   "--tokens-per-sample", tokens_per_sample, "--batch-size", batch_size, *flags)


def bleu(output):
    match = re.search(r"BLEU = ([0-9.]+)", output)
    if not match:
        raise ValueError(f"no BLEU line in:\n{output[-2000:]}")
    return float(match.group(1))


def perplexity(output):
    return float(re.search(r"Perplexity: ([0-9.]+)", output).group(1))


def train_words_per_second(log):
    """wps of the last end-of-epoch summary line of fairseq-train."""
    return float(re.findall(r"\| train \| .*?\| wps ([0-9.]+)", log)[-1])
