"""Language-model recipe steps shared by WikiText-103 and WikiText-2: prepare, train, evaluate.

Evaluation protocols:
- "sliding": the paper's Table 2 protocol, windows of the training length L
  with stride 1, the first window scoring all its tokens and every later one
  only its last: fairseq-eval-lm --tokens-per-sample L --context-window L-1
  (tests/test_sliding_window.py checks that against a direct computation;
  the result does not depend on the batch size).
- "carry": one stream through the whole split with the fast weights carried
  (task fwp_stream_lm, batch size 1), as Table 4.
"""
import os
import re

from .commands import PLUGIN_DIR, fairseq
from .prepared import preparing

PROTOCOLS = ("sliding", "carry")


def prepare(train, valid, test, out, workers=1):
    """Binarise word-level text files (one line per line of text, </s> at each end) into OUT/bin, once per
    OUT, whoever else prepares it at the same time (prepared.py)."""
    with preparing(out) as staging:
        if staging is None:
            print(f"{out}: prepared already", flush=True)
            return
        binarise(train, valid, test, os.path.join(staging, "bin"), workers)


def binarise(train, valid, test, destdir, workers=1):
    fairseq("preprocess", "--only-source", "--trainpref", train, "--validpref", valid, "--testpref", test,
            "--destdir", destdir, "--workers", workers, echo=True)


def task_flags(task, tokens_per_sample, batch_size):
    """How batches are formed: blocks of L tokens (language_modeling) or B parallel streams (fwp_stream_lm)."""
    flags = ["--task", task, "--tokens-per-sample", tokens_per_sample, "--batch-size", batch_size]
    if task == "language_modeling":
        flags += ["--sample-break-mode", "none", "--max-tokens", tokens_per_sample * batch_size]
    return flags


def train(data_bin, save_dir, arch, task, tokens_per_sample, batch_size, row_flags, hyper_flags, extra=()):
    os.makedirs(save_dir, exist_ok=True)
    return fairseq("train", data_bin, "--user-dir", PLUGIN_DIR, "--arch", arch,
                   *task_flags(task, tokens_per_sample, batch_size), *hyper_flags, *row_flags,
                   "--save-dir", save_dir, *extra, echo=True, log=os.path.join(save_dir, "train.log"))


def evaluate(data_bin, checkpoint, protocol, tokens_per_sample, subset="test", batch_size=16, extra=()):
    """Perplexity of one split; returns {"perplexity", "loss_base2", "tokens", "tokens_per_s"}."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}; got {protocol!r}")
    if protocol == "sliding":
        flags = ["--task", "language_modeling", "--context-window", tokens_per_sample - 1,
                 "--batch-size", batch_size]
    else:
        flags = ["--task", "fwp_stream_lm", "--batch-size", 1]
    log = f"{os.path.splitext(checkpoint)[0]}.{subset}.{protocol}.log"
    output = fairseq("eval-lm", data_bin, "--user-dir", PLUGIN_DIR, "--path", checkpoint, "--gen-subset", subset,
                     "--tokens-per-sample", tokens_per_sample, "--num-workers", 0, *flags, *extra,
                     echo=True, log=log)
    return parse_eval_lm(output)


def parse_eval_lm(output):
    evaluated = re.search(r"Evaluated ([0-9,]+) tokens in [0-9.]+s \(([0-9.]+) tokens/s\)", output)
    loss = re.search(r"Loss \(base 2\): ([0-9.]+), Perplexity: ([0-9.]+)", output)
    if not (evaluated and loss):
        raise RuntimeError(f"no perplexity in fairseq-eval-lm's output:\n{output[-2000:]}")
    return {"perplexity": 2 ** float(loss.group(1)), "loss_base2": float(loss.group(1)),
            "tokens": int(evaluated.group(1).replace(",", "")), "tokens_per_s": float(evaluated.group(2))}
