"""Per-token cost of incremental decoding: softmax vs fast-weight decoders.

Builds fwp_lm_tiny-sized language models in-process (fairseq's own argument
parsing and model builder), feeds tokens one at a time through fairseq's
incremental decoding, and reports the time per token around positions 16,
256 and 1024 and the size of the decoder state there. A softmax decoder's
key/value cache grows with the position; a fast-weight decoder's state (W, z)
does not.

    .venv/bin/python examples/speed/decoding_cost.py [--batch 4] [--layers 2] [--dim 64]   # docs: --dim 256 --batch 16
"""
import argparse
import os
import platform
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from fairseq import options  # noqa: E402
from fairseq.data import Dictionary  # noqa: E402
from fairseq_fwp.modules.state import buffer_tensors  # noqa: E402

POSITIONS = (16, 256, 1024)
WINDOW = 32  # tokens timed from each position on (median)
MODELS = {
    "softmax": ["--fwp-feature-map", "softmax", "--fwp-positions", "on"],
    "linear-delta": ["--fwp-feature-map", "linear", "--fwp-update-rule", "delta"],
    "dpfp-delta": ["--fwp-feature-map", "dpfp", "--fwp-update-rule", "delta"],
}


def build_lm(flags, layers, dim, vocab=1000):
    from fairseq_fwp.models.fwp_transformer_lm import FastWeightTransformerLanguageModel

    d = Dictionary()
    for i in range(vocab):
        d.add_symbol(f"w{i}")
    argv = ["/nonexistent", "--task", "language_modeling", "--arch", "fwp_lm_tiny", "--user-dir",
            os.path.join(ROOT, "fairseq_fwp"), "--tokens-per-sample", str(max(POSITIONS) + WINDOW + 1),
            "--decoder-layers", str(layers), "--decoder-embed-dim", str(dim), *flags]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    task = types.SimpleNamespace(source_dictionary=d, target_dictionary=d)
    return FastWeightTransformerLanguageModel.build_model(args, task).eval(), d


def state_bytes(incremental_state):
    return sum(x.numel() * x.element_size() for buf in incremental_state.values() for x in buffer_tensors(buf))


@torch.no_grad()
def measure(model, d, batch):
    tokens = torch.randint(d.nspecial, len(d), (batch, max(POSITIONS) + WINDOW + 1))
    state, per_token, sizes = {}, {}, {}
    for t in range(tokens.shape[1]):
        start = time.perf_counter()
        model.decoder(tokens[:, : t + 1], incremental_state=state)
        elapsed = time.perf_counter() - start
        for p in POSITIONS:
            if p <= t < p + WINDOW:
                per_token.setdefault(p, []).append(elapsed)
            if t == p:
                sizes[p] = state_bytes(state)
    return {p: sorted(v)[len(v) // 2] for p, v in per_token.items()}, sizes


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4, help="sequences decoded together (e.g. a beam)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"# decoding cost per token, CPU {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}; batch {args.batch}, {args.layers} layers, d_model {args.dim}")
    print("| decoder | " + " | ".join(f"ms/token @{p}" for p in POSITIONS) + " | "
          + " | ".join(f"state KiB @{p}" for p in POSITIONS) + " |")
    print("|---" * (1 + 2 * len(POSITIONS)) + "|")
    for name, flags in MODELS.items():
        model, d = build_lm(flags, args.layers, args.dim)
        times, sizes = measure(model, d, args.batch)
        print(f"| {name} | " + " | ".join(f"{1e3 * times[p]:.2f}" for p in POSITIONS) + " | "
              + " | ".join(f"{sizes[p] / 1024:.0f}" for p in POSITIONS) + " |", flush=True)


if __name__ == "__main__":
    main()
