"""Per-token cost of generation: softmax vs fast-weight decoders, through fairseq's SequenceGenerator.

Builds fwp_lm_tiny-shaped language models with random weights, generates
--length tokens greedily from a 4-token prompt (examples/recipes/decoding_cost.py),
and reports the decoder's time per token around a few positions (median of
the 32 steps from there) and the size of its state there. A softmax
decoder's key/value cache grows with the position, and its time with it; a
fast-weight decoder's state (W, z) does not.

    OMP_NUM_THREADS=1 .venv/bin/python examples/speed/decoding_cost.py [--batch 4] [--layers 2] [--dim 64]

--json FILE also writes every step's time and state size per decoder (the quickstart plots them).
"""
import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.recipes.decoding_cost import build_random_model, generation_cost, numbered_dictionary  # noqa: E402

MODELS = {
    "softmax": ["--fwp-feature-map", "softmax", "--fwp-positions", "on"],
    "linear-delta": ["--fwp-feature-map", "linear", "--fwp-update-rule", "delta"],
    "dpfp-delta": ["--fwp-feature-map", "dpfp", "--fwp-update-rule", "delta"],
    "linear-deltaproduct-2": ["--fwp-feature-map", "linear", "--fwp-update-rule", "delta", "--fwp-householder-steps",
                              "2", "--fwp-negative-eigenvalues", "on", "--fwp-qk-norm", "l2"],
    "linear-gated-delta": ["--fwp-feature-map", "linear", "--fwp-update-rule", "gated-delta"],
    "linear-kda": ["--fwp-feature-map", "linear", "--fwp-update-rule", "kda"],  # a decay per key channel
}
WINDOW = 32  # steps timed from each position on (their median)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4, help="sequences generated together")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64, help="d_model (4 heads, FFN 4 d_model)")
    parser.add_argument("--positions", type=int, nargs="+", default=[16, 256, 1024])
    parser.add_argument("--json", help="write every step's seconds and state bytes per decoder here")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                        help="decoders to measure (default: all)")
    args = parser.parse_args()
    length = max(args.positions) + WINDOW
    dictionary = numbered_dictionary(1000)
    print(f"# generation cost per token (fairseq SequenceGenerator, greedy); {platform.machine()} "
          f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{time.strftime('%Y-%m-%d')}; batch {args.batch}, {args.layers} layers, d_model {args.dim}")
    print("| decoder | " + " | ".join(f"ms/token @{p}" for p in args.positions) + " | "
          + " | ".join(f"state KiB @{p}" for p in args.positions) + " | whole generate (s) |")
    print("|---" * (2 + 2 * len(args.positions)) + "|")
    shape = ["--decoder-layers", args.layers, "--decoder-embed-dim", args.dim, "--decoder-ffn-embed-dim",
             4 * args.dim, "--tokens-per-sample", length + 8, "--dropout", 0]
    steps = {}
    for name in args.models:
        flags = MODELS[name]
        model = build_random_model("language_modeling", "fwp_lm_tiny", shape + flags, dictionary)
        cost = generation_cost(model, dictionary, length, args.batch)
        steps[name] = {"seconds": cost.seconds, "state_bytes": cost.state_bytes}
        at = [cost.at(p, WINDOW) for p in args.positions]
        print(f"| {name} | " + " | ".join(f"{1e3 * seconds:.2f}" for seconds, _ in at) + " | "
              + " | ".join(f"{size / 1024:.0f}" for _, size in at) + f" | {cost.total_seconds:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(steps, f)


if __name__ == "__main__":
    main()
