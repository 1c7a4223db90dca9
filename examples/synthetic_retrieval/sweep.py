"""The sweep command: train every (model, S) of one setting and log each run as CSV.

    python -m examples.synthetic_retrieval.sweep --setting 1 --out runs/synthetic_retrieval
    python -m examples.synthetic_retrieval.sweep --setting 2 --out runs/synthetic_retrieval

Defaults are the paper's: setting 1 runs the Figure 2 models for S = 20..600
step 20; setting 2 the Figure 3/5 models (plus the gated rule) for
S = 20..200 step 20. The sweep is resumable: a finished run (its CSV exists)
is skipped, an interrupted one starts over. ``--shard K/N`` runs every N-th
job starting at K, so N processes (e.g. one per core, ``--threads 1``) split
a sweep without overlapping. Every invocation appends a JSON line (command,
machine, versions, wall time) to ``OUT/sweeps.jsonl``.
"""
import argparse
import json
import os
import platform
import socket
import sys
import time

import torch

from .data import SETTINGS, sequence_length
from .logs import RunLog, best_loss, read_run, run_path
from .names import MODEL_NAME_HELP, parse_model_name
from .train import TrainConfig, train

DEFAULT_MODELS = {
    1: ["softmax", "sum-linear", "sum-dpfp1", "sum-dpfp2", "sum-dpfp3", "sum-favor64", "sum-favor128",
        "sum-favor512"],
    2: ["sum-linear", "sum-dpfp1", "sum-dpfp2", "delta-linear", "delta-dpfp1", "delta-dpfp2", "fwm-tanh",
        "fwm-dpfp1", "gated-dpfp1"],
}
DEFAULT_SIZES = {1: "20:600:20", 2: "20:200:20"}


def model_list(text):
    names = [name for name in text.split(",") if name]
    for name in names:
        try:
            parse_model_name(name)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    if not names:
        raise argparse.ArgumentTypeError(f"give at least one model: {MODEL_NAME_HELP}")
    return names


def size_list(text):
    """Comma-separated S values and FIRST:LAST:STEP ranges (inclusive), e.g. ``20,60,180:320:20``; every S >= 2."""
    sizes = set()
    try:
        for item in text.split(","):
            if ":" in item:
                first, last, step = (int(part) for part in item.split(":"))
                sizes.update(range(first, last + 1, step))
            else:
                sizes.add(int(item))
    except ValueError:
        sizes = set()
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError(
            f"sizes must be comma-separated integers >= 2 or FIRST:LAST:STEP ranges; got {text!r}")
    return sorted(sizes)


def shard(text):
    """``K/N`` with 0 <= K < N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"shard must be K/N with 0 <= K < N, e.g. 0/2; got {text!r}")
    return index, count


def positive(kind):
    def parse(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0; got {text!r}")
        return value
    return parse


def step_count(text):
    value = int(text)
    if value < 100 or value % 100:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 100 (the evaluation interval); got {text!r}")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", type=int, choices=SETTINGS, required=True,
                        help="1: L = S without replacement; 2: L = 2S with replacement")
    parser.add_argument("--out", required=True, help="log directory (shared by both settings)")
    parser.add_argument("--models", type=model_list, help=f"comma list; each {MODEL_NAME_HELP}")
    parser.add_argument("--sizes", type=size_list, help="numbers of keys S, e.g. 20:600:20 or 20,60,180:320:20")
    parser.add_argument("--threads", type=positive(int), default=1, help="torch threads per process (default 1)")
    parser.add_argument("--shard", type=shard, default=(0, 1), help="K/N: run jobs K, K+N, K+2N, ... (default 0/1)")
    parser.add_argument("--max-steps", type=step_count, default=TrainConfig.max_steps)
    parser.add_argument("--lr", type=positive(float), default=TrainConfig.lr)
    parser.add_argument("--batch-size", type=positive(int), default=TrainConfig.batch_size)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--patience", type=positive(int), default=TrainConfig.patience,
                        help="stop after this many evaluations without a new best (default: the authors' 11)")
    parser.add_argument("--d-key", type=positive(int), default=TrainConfig.d_key,
                        help="key size d_key (default: the paper's 64); D is 2 d_key nu for DPFP-nu")
    args = parser.parse_args(argv)
    args.models = args.models or DEFAULT_MODELS[args.setting]
    args.sizes = args.sizes or size_list(DEFAULT_SIZES[args.setting])
    return args


def jobs(args):
    """This shard's (model, S) pairs, every N-th of one fixed order.

    The order walks S upwards and the models forwards, then backwards, at
    alternate S, so that each shard gets small and large S of every model
    (with a plain model loop and an even number of models, shard 0/2 would
    get the same half of the models at every S).
    """
    everything = [(model, size) for i, size in enumerate(args.sizes)
                  for model in (args.models if i % 2 == 0 else args.models[::-1])]
    index, count = args.shard
    return everything[index::count]


def run_one(args, config, model, num_keys):
    path = run_path(args.out, args.setting, model, num_keys)
    with RunLog(path, model=model, setting=args.setting, num_keys=num_keys,
                seq_len=sequence_length(args.setting, num_keys),
                lr=config.lr, batch_size=config.batch_size, seed=config.seed, d_key=config.d_key) as log:
        stop = train(model, num_keys, args.setting, config, on_evaluation=log.write)
        log.finish()
    rows = read_run(path)
    print(f"setting {args.setting} {model:>14} S={num_keys:<4} {stop:<11} best {best_loss(rows):.2e} "
          f"after {rows[-1]['step']} steps, {rows[-1]['wall_s']:.0f} s", flush=True)


def sweep_record(argv, args, started, runs_trained):
    """One line for OUT/sweeps.jsonl: the command, machine, versions and wall time."""
    return {"argv": sys.argv[1:] if argv is None else list(argv), "runs_trained": runs_trained,
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "wall_s": round(time.time() - started, 1), "host": socket.gethostname(),
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": args.threads,
            "torch": torch.__version__, "python": platform.python_version()}


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    config = TrainConfig(lr=args.lr, batch_size=args.batch_size, max_steps=args.max_steps, seed=args.seed,
                         patience=args.patience, d_key=args.d_key)
    started, runs_trained = time.time(), 0
    for model, num_keys in jobs(args):
        if not os.path.exists(run_path(args.out, args.setting, model, num_keys)):
            run_one(args, config, model, num_keys)
            runs_trained += 1
    record = sweep_record(argv, args, started, runs_trained)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweeps.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"{runs_trained} runs trained in {record['wall_s']:.0f} s", flush=True)

if __name__ == "__main__":
    main()
