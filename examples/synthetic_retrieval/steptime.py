"""Time training steps (forward, backward, Adam) per model and S, to plan a sweep.

    python -m examples.synthetic_retrieval.steptime --setting 1 --models sum-dpfp3,sum-linear --sizes 100,600

Prints milliseconds per step (median of ``--repeats`` timings of ``--steps``
steps, after one warm-up step) with the machine and versions. Multiply by the
steps a run takes (a few hundred to several thousand, see README.md) for a
sweep's wall time.
"""
import argparse
import platform
import statistics
import time
from dataclasses import replace

import torch

from .data import SETTINGS
from .models import build_model
from .sweep import model_list, positive, size_list
from .train import TrainConfig, train_steps


def step_seconds(model_name, num_keys, setting, steps, repeats):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = build_model(model_name, num_keys)
    optimizer = torch.optim.Adam(model.parameters(), lr=TrainConfig.lr)
    config = replace(TrainConfig(), eval_every=1)
    train_steps(model, optimizer, num_keys, setting, config, generator)  # warm-up
    config = replace(config, eval_every=steps)
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        train_steps(model, optimizer, num_keys, setting, config, generator)
        timings.append((time.perf_counter() - start) / steps)
    return statistics.median(timings)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", type=int, choices=SETTINGS, required=True)
    parser.add_argument("--models", type=model_list, required=True)
    parser.add_argument("--sizes", type=size_list, required=True)
    parser.add_argument("--threads", type=positive(int), default=1)
    parser.add_argument("--steps", type=positive(int), default=2, help="steps per timing (default 2)")
    parser.add_argument("--repeats", type=positive(int), default=3, help="timings per point (default 3)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"setting {args.setting}, batch {TrainConfig.batch_size}; ms per training step")
    print("| model | " + " | ".join(f"S={S}" for S in args.sizes) + " |")
    print("|---" * (len(args.sizes) + 1) + "|")
    for model in args.models:
        cells = [f"{1000 * step_seconds(model, S, args.setting, args.steps, args.repeats):.0f}" for S in args.sizes]
        print(f"| {model} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
