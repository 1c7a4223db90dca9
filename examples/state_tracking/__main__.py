"""Train every row on every task on short sequences, test it on longer ones, and report.

    python -m examples.state_tracking --out runs/state_tracking [--tasks parity mod3 s3] [--rows ROW ...]
                                      [--seeds 1 2 3] [--workers 2] [--updates N]

Each run: AdamW (lr 3e-3, weight decay 0.01, gradient norm clipped at 1), batches of
64 sequences (32 for S3) at the training lengths, STEPS[task] updates (--updates: another number, for a
quicker look), one thread. The score at each test
length is the accuracy of the state after the last token (the whole sequence's parity, count or
permutation; chance is 1/classes) over 256 test sequences. Runs go two at a time; results go to
OUT/results.json as they finish (an interrupted run resumes), then the table (the median over seeds, and
how many seeds reach 0.99 at the longest length) and OUT/state_tracking.png.
"""
import argparse
import concurrent.futures
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from .model import StateTracker
from .rows import ROWS
from .tasks import TASKS

STEPS = {"parity": 600, "mod3": 600, "s3": 1600}
BATCH = {"parity": 64, "mod3": 64, "s3": 32}
TEST_SEQUENCES = 256
SOLVED = 0.99


def train_and_test(task_name, row, seed, updates):
    """One run in a worker process: {"accuracy": {length: accuracy at the last token}, "seconds", "loss",
    "updates"}."""
    torch.set_num_threads(1)
    task = TASKS[task_name]
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = StateTracker(task, ROWS[row])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    start = time.time()
    for _ in range(updates):
        tokens, states = task.training_batch(BATCH[task_name], generator)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), states.flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()
    accuracy = {}
    with torch.no_grad():
        for length in task.test_lengths:
            tokens, states = task.batch(TEST_SEQUENCES, length, generator)
            accuracy[length] = (model(tokens)[:, -1].argmax(-1) == states[:, -1]).float().mean().item()
    return {"accuracy": accuracy, "seconds": round(time.time() - start, 1), "loss": loss.item(), "updates": updates}


def key(task, row, seed):
    return f"{task} | {row} | {seed}"


def table(results, tasks, rows, seeds):
    """Markdown: per task, the median accuracy over seeds at each test length and the seeds solved."""
    lines = []
    for task in tasks:
        lengths = TASKS[task].test_lengths
        lines += [f"\n**{task}** (trained on lengths {TASKS[task].train_lengths[0]}-{TASKS[task].train_lengths[1]}; "
                  f"accuracy of the last state, median of {len(seeds)} seeds)\n",
                  "| row | " + " | ".join(f"T = {n}" for n in lengths) + " | seeds solved | seconds |",
                  "|---|" + "---|" * (len(lengths) + 2)]
        for row in rows:
            runs = [results[key(task, row, s)] for s in seeds if key(task, row, s) in results]
            if not runs:
                continue
            medians = [statistics.median(r["accuracy"][str(n)] for r in runs) for n in lengths]
            solved = sum(r["accuracy"][str(lengths[-1])] >= SOLVED for r in runs)
            seconds = statistics.median(r["seconds"] for r in runs)
            lines.append(f"| {row} | " + " | ".join(f"{m:.2f}" for m in medians) + f" | {solved}/{len(runs)} | "
                         f"{seconds:.0f} |")
    return "\n".join(lines)


def plot(results, tasks, rows, seeds, path):
    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq's import leaves the root logger verbose
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        lengths = TASKS[task].test_lengths
        for row in rows:
            runs = [results[key(task, row, s)] for s in seeds if key(task, row, s) in results]
            if runs:
                ax.plot(lengths, [statistics.median(r["accuracy"][str(n)] for r in runs) for n in lengths],
                        marker="o", label=row)
        ax.axvline(TASKS[task].train_lengths[1], color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{task} (dotted: longest training length)")
        ax.set_xlabel("test length")
        ax.set_ylabel("accuracy of the last state")
    axes[0][-1].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), metavar="ROW",
                        help="rows to run (default: all): " + ", ".join(ROWS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--workers", type=int, default=2, help="runs side by side, one thread each")
    parser.add_argument("--updates", type=int, help="updates per run (default: each task's, " +
                        ", ".join(f"{task} {n}" for task, n in STEPS.items()) + ")")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.updates is not None and args.updates < 1:
        parser.error(f"--updates must be >= 1, got {args.updates}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "results.json")
    results = json.load(open(path)) if os.path.exists(path) else {}
    updates = {task: args.updates or STEPS[task] for task in args.tasks}
    # a run is done when it has a result of as many updates (a result that does not say is of STEPS')
    todo = [(t, r, s, updates[t]) for t in args.tasks for r in args.rows for s in args.seeds
            if key(t, r, s) not in results or results[key(t, r, s)].get("updates", STEPS[t]) != updates[t]]
    start = time.time()
    with concurrent.futures.ProcessPoolExecutor(args.workers) as pool:
        futures = {pool.submit(train_and_test, *run): run for run in todo}
        for future in concurrent.futures.as_completed(futures):
            run = futures[future]
            result = future.result()
            result["accuracy"] = {str(n): a for n, a in result["accuracy"].items()}
            results[key(*run[:3])] = result
            with open(path + ".tmp", "w") as f:
                json.dump(results, f, indent=1)
            os.replace(path + ".tmp", path)
            print(f"{key(*run[:3])}: {result['accuracy']} ({result['seconds']} s)", flush=True)
    machine = platform.processor() or platform.machine()
    print(f"\n{len(todo)} runs in {time.time() - start:.0f} s on {os.cpu_count()} cores ({machine}), "
          f"torch {torch.__version__}, Python {sys.version.split()[0]}")
    print(table(results, args.tasks, args.rows, args.seeds))
    plot(results, args.tasks, args.rows, args.seeds, os.path.join(args.out, "state_tracking.png"))
    print(f"plot: {os.path.join(args.out, 'state_tracking.png')}")


if __name__ == "__main__":
    main()
