"""Dual form of a fairseq LM trained on WikiText-2: record, verify, explain (paper Sec. 5.5, Table 2).

    nice -n 10 env OMP_NUM_THREADS=1 .venv/bin/python examples/dual_form/wikitext2_demo.py \\
        [--data data/wikitext-2] [--out work_dirs/dual_form] [--max-update 3000]

WikiText-2 as the small-real-data recipe fetches it (python -m
examples.recipes.small_real_data wikitext2 --download ...). Split: the model trains on WikiText-2
valid.txt; test.txt is cut at an article boundary into a held-out valid
part (its first HELD_OUT_ARTICLES articles: fairseq's validation and the
`verify` queries) and a test part (perplexity). The explain queries are
lines of the original test.txt, the first one the query of the paper's
Table 2. Everything is written under --out (git-ignored); nothing is copied
into the repository. Without the data the script prints a message and exits 0.
"""
import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # run as a script: the repository's examples and plugin

from examples.recipes.pipeline import PLUGIN_DIR, eval_lm, fairseq, perplexity  # noqa: E402

HELD_OUT_ARTICLES = 32  # of the 64 articles of test.txt
TITLE = re.compile(r"^ = [^=].* = $")
LAYERS = ["decoder.layers.1.fc1", "decoder.layers.1.fc2"]
EXPLAIN_LAYER = "decoder.layers.1.fc1"  # input: the normalised residual stream of the last block
TOKENS_PER_SAMPLE = 128
# (test.txt line, the words that start at the query token): the first is the paper's Table 2 query.
QUERIES = [(656, "Her principal role was for combat"), (194, "displacement increased over")]


def split_test(test_txt, out_dir):
    """valid.txt = the first HELD_OUT_ARTICLES articles of test.txt, test.txt = the rest."""
    with open(test_txt, encoding="utf-8") as f:
        lines = f.readlines()
    starts = [i for i, line in enumerate(lines) if TITLE.match(line)]
    cut = starts[HELD_OUT_ARTICLES]
    os.makedirs(out_dir, exist_ok=True)
    for name, part in (("valid.txt", lines[:cut]), ("test.txt", lines[cut:])):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            f.writelines(part)
    return {"held_out_valid_lines": f"1-{cut}", "test_lines": f"{cut + 1}-{len(lines)}"}


def query_position(test_txt, line, phrase):
    words = open(test_txt, encoding="utf-8").read().split("\n")[line - 1].split()
    first = phrase.split()
    for i in range(len(words)):
        if words[i:i + len(first)] == first:
            return i
    raise ValueError(f"{phrase!r} not in line {line} of {test_txt}")


def dual_form(*args):
    proc = subprocess.run([sys.executable, "-m", "examples.dual_form", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode not in (0, 1):  # 1: verify above its threshold, still a result to report
        raise RuntimeError(f"dual_form {args[0]} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def train(data_bin, save_dir, record_dir, max_update, lr):
    return fairseq(
        "train", data_bin, "--user-dir", PLUGIN_DIR, "--task", "dual_form_language_modeling",
        "--dual-form-record", ",".join(LAYERS), "--dual-form-dir", record_dir,
        "--arch", "fwp_lm_tiny",  # the plugin's Delta Net: linear attention, delta rule, no positions
        "--optimizer", "sgd", "--lr", lr, "--lr-scheduler", "inverse_sqrt", "--warmup-updates", 200,
        "--tokens-per-sample", TOKENS_PER_SAMPLE, "--sample-break-mode", "none", "--max-tokens", 512,
        "--max-update", max_update, "--save-dir", save_dir, "--no-epoch-checkpoints", "--seed", 1,
        "--log-format", "simple", "--log-interval", 100, "--num-workers", 0)


def machine():
    import numpy
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M %Z")}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.path.join(REPO, "data", "wikitext-2"))
    parser.add_argument("--out", default=os.path.join(REPO, "work_dirs", "dual_form"))
    parser.add_argument("--max-update", type=int, default=3000)
    parser.add_argument("--lr", type=float, default=2.0)
    args = parser.parse_args(argv)
    valid_txt, test_txt = (os.path.join(args.data, name) for name in ("valid.txt", "test.txt"))
    if not (os.path.exists(valid_txt) and os.path.exists(test_txt)):
        print(f"skipping the WikiText-2 dual-form demo: {valid_txt} and {test_txt} not found")
        return 0

    out = os.path.abspath(args.out)
    record_dir, save_dir, data_bin = (os.path.join(out, name) for name in ("record", "checkpoints", "data-bin"))
    if os.path.exists(record_dir):
        raise SystemExit(f"{record_dir} exists: a record starts with a fresh run, remove {out} first")
    summary = {"machine": machine(), "split": split_test(test_txt, os.path.join(out, "raw"))}
    raw = os.path.join(out, "raw")
    fairseq("preprocess", "--only-source", "--trainpref", valid_txt, "--validpref", os.path.join(raw, "valid.txt"),
            "--testpref", os.path.join(raw, "test.txt"), "--destdir", data_bin, "--workers", 1)

    start = time.time()
    log = train(data_bin, save_dir, record_dir, args.max_update, args.lr)
    summary["train_seconds"] = round(time.time() - start, 1)
    summary["train_log_tail"] = [line for line in log.splitlines() if "| train |" in line or "| valid |" in line][-2:]
    checkpoint = os.path.join(save_dir, "checkpoint_last.pt")
    summary["test_perplexity"] = perplexity(eval_lm(data_bin, checkpoint, tokens_per_sample=TOKENS_PER_SAMPLE))

    start = time.time()
    dual_form("verify", "--dir", record_dir, "--checkpoint", checkpoint, "--num-queries", 256,
              "--json", os.path.join(out, "verify.json"))
    summary["verify_seconds"] = round(time.time() - start, 1)
    summary["verify"] = json.load(open(os.path.join(out, "verify.json")))

    summary["explain"] = []
    for i, (line, phrase) in enumerate(QUERIES, start=1):
        position = query_position(test_txt, line, phrase)
        start = time.time()
        dual_form("explain", "--dir", record_dir, "--checkpoint", checkpoint, "--layer", EXPLAIN_LAYER,
                  "--query-file", test_txt, "--line", line, "--position", position, "--top-k", 3,
                  "--out", os.path.join(out, f"explain{i}"))
        summary["explain"].append({"line": line, "position": position, "seconds": round(time.time() - start, 1),
                                   "dir": os.path.join(out, f"explain{i}")})
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps({k: v for k, v in summary.items() if k != "verify"}, indent=2))
    for item in summary["explain"]:
        print(open(os.path.join(item["dir"], "explain.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
