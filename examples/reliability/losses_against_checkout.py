"""Has a change altered what the recipes train? The first training losses of every row of the small-real-data
recipes (Multi30k, WikiText-2), trained by this checkout's plugin and by another's on the same prepared data
and seed, side by side; uptrained rows are converted from each checkout's own softmax row.

    git worktree add /tmp/before COMMIT
    .venv/bin/python examples/reliability/losses_against_checkout.py /tmp/before --data-dir data --out /tmp/losses \
        [--updates 60] [--corpora multi30k wikitext2] [--rows ROW ...] [--max-tokens 1024]

Both checkouts run the fairseq-train of this environment with --user-dir pointing at their own plugin, one
thread each, two at a time (this checkout's and the other's of one row side by side). Prints, per row, the
largest difference of the logged losses (fairseq logs 3 decimals) and writes OUT/losses.json. --max-tokens
gives the translation rows a smaller batch than the recipe's 4,096 tokens (the same code runs, faster).
"""
import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from examples.recipes import language_model, rows, small_real_data as recipe  # noqa: E402
from examples.recipes.commands import BIN_DIR  # noqa: E402

UPTRAINING_WARMUP = 10
TRANSFER_STEPS = 20  # the rows' 100 attention-transfer steps, shortened: the code path is the same


def losses(log):
    return {int(n): float(loss) for loss, n in re.findall(r"train_inner \| .*? loss=([0-9.]+),.*?num_updates=(\d+)", log)}


def train_command(corpus, out, row, checkout, save, updates, extra=(), max_tokens=None):
    """fairseq-train's arguments for `row` as the recipe gives them, with the checkout's plugin."""
    spec = (rows.MULTI30K if corpus == "multi30k" else rows.WIKITEXT2)[row]
    if corpus == "multi30k":
        flags = [os.path.join(out, "bin"), "--arch", "fwp_transformer_tiny", *recipe.MULTI30K_MODEL,
                 *recipe.MULTI30K_TRAINING, *(["--max-tokens", str(max_tokens)] if max_tokens else [])]
    else:
        streams, length = recipe.stream_shape(row)
        flags = [os.path.join(out, "bin"), "--arch", "fwp_lm_tiny",
                 *map(str, language_model.task_flags(spec.task, length, streams)), *recipe.WIKITEXT2_MODEL,
                 *recipe.WIKITEXT2_TRAINING]
    return [os.path.join(BIN_DIR, "fairseq-train"), *flags, *spec.flags, "--seed", "1", "--max-update", str(updates),
            "--log-interval", "1", "--save-dir", save, "--no-save-optimizer-state", *extra,
            "--user-dir", os.path.join(checkout, "fairseq_fwp")]


def convert_command(corpus, out, row, checkout, source, converted, updates, max_tokens):
    """The checkout's own conversion of its softmax row into `row`, in a process of its own (a checkout before
    the uptraining package holds it in fairseq_fwp/uptrain.py)."""
    spec = (rows.MULTI30K if corpus == "multi30k" else rows.WIKITEXT2)[row]
    argv = train_command(corpus, out, row, checkout, os.path.dirname(converted), updates, max_tokens=max_tokens)[1:]
    transfer = min(spec.uptraining.transfer_steps, TRANSFER_STEPS)
    code = (f"import sys; sys.path.insert(0, {checkout!r})\n"
            "try:\n    from fairseq_fwp.uptraining.conversion import convert\n"
            "except ImportError:\n    from fairseq_fwp.uptrain import convert\n"
            f"convert({source!r}, {converted!r}, {argv!r}, {transfer})")
    return [sys.executable, "-c", code]


def run_pair(commands):
    """Run the two commands side by side, one thread each; returns their outputs."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for c in commands]
    outputs = [p.communicate()[0] for p in procs]
    for proc, output in zip(procs, outputs):
        if proc.returncode:
            raise RuntimeError(output[-3000:])
    return outputs


def compare_row(corpus, out, row, checkouts, work, updates, max_tokens):
    spec = (rows.MULTI30K if corpus == "multi30k" else rows.WIKITEXT2)[row]
    saves = [os.path.join(work, name, corpus, row) for name in ("this", "other")]
    extra = [[] for _ in checkouts]
    if spec.uptraining is not None:
        sources = [os.path.join(work, name, corpus, spec.uptraining.source, "checkpoint_last.pt")
                   for name in ("this", "other")]
        converted = [os.path.join(save, "converted.pt") for save in saves]
        for save in saves:
            os.makedirs(save, exist_ok=True)
        run_pair([convert_command(corpus, out, row, c, s, v, updates, max_tokens)
                  for c, s, v in zip(checkouts, sources, converted)])
        for flags, source, path in zip(extra, sources, converted):
            flags += ["--finetune-from-model", path, "--warmup-updates", str(UPTRAINING_WARMUP)]
            if spec.uptraining.distillation:
                flags += ["--criterion", "fwp_distillation", "--teacher-checkpoint", source,
                          "--distillation-weight", str(spec.uptraining.distillation)]
    logs = run_pair([train_command(corpus, out, row, c, save, updates, e, max_tokens)
                     for c, save, e in zip(checkouts, saves, extra)])
    this, other = (losses(log) for log in logs)
    if sorted(this) != list(range(1, updates + 1)) or sorted(other) != sorted(this):
        raise RuntimeError(f"{row}: logged updates {sorted(this)} and {sorted(other)}")
    return {"largest_difference": max(abs(this[n] - other[n]) for n in this), "this": this, "other": other}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other", help="the other checkout (a git worktree)")
    parser.add_argument("--data-dir", default=recipe.DEFAULT_DATA)
    parser.add_argument("--out", required=True)
    parser.add_argument("--updates", type=int, default=60)
    parser.add_argument("--corpora", nargs="+", default=["multi30k", "wikitext2"], choices=["multi30k", "wikitext2"])
    parser.add_argument("--rows", nargs="+", help="a subset of the rows (default: all)")
    parser.add_argument("--max-tokens", type=int, help="the translation rows' batch (default: the recipe's)")
    args = parser.parse_args()
    checkouts = [ROOT, os.path.abspath(args.other)]
    results_path = os.path.join(args.out, "losses.json")
    results = json.load(open(results_path)) if os.path.exists(results_path) else {}
    for corpus in args.corpora:
        prepare, _, _, table, _ = recipe.CORPORA[corpus]
        data = os.path.join(args.out, corpus)
        prepare(args.data_dir, data)
        # sources first: uptrained rows start from their checkout's own softmax row
        ordered = sorted(table, key=lambda row: table[row].uptraining is not None)
        for row in ordered:
            if (args.rows and row not in args.rows) or f"{corpus}/{row}" in results:
                continue
            results[f"{corpus}/{row}"] = compare_row(corpus, data, row, checkouts, os.path.join(args.out, "runs"),
                                                     args.updates, args.max_tokens)
            print(f"{corpus}/{row}: largest loss difference {results[f'{corpus}/{row}']['largest_difference']:.4f}",
                  flush=True)
            with open(results_path, "w") as f:
                json.dump(results, f, indent=1)
    worst = max(r["largest_difference"] for r in results.values())
    print(f"{len(results)} rows, largest difference of a logged loss: {worst:.4f}")


if __name__ == "__main__":
    main()
