"""fairseq-train words/s of fwp_lm_tiny-sized LMs: fast weights vs softmax.

Trains each model for a fixed number of updates (4096 tokens per batch) on
the built-in synthetic LM corpus at --tokens-per-sample 256 and 1024, and
prints fairseq's own words/s and the ratio to softmax measured in the same
run.

    .venv/bin/python examples/speed/train_speed.py [--updates 40] [--out speed_out]
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from examples.recipes.synthetic_data import write_corpora  # noqa: E402
from examples.recipes.pipeline import preprocess_lm, train_lm, train_words_per_second  # noqa: E402

MODELS = {
    "softmax": ["--fwp-feature-map", "softmax", "--fwp-positions", "on"],
    "linear-sum": ["--fwp-feature-map", "linear", "--fwp-update-rule", "sum"],
    "linear-delta": ["--fwp-feature-map", "linear", "--fwp-update-rule", "delta"],
    "dpfp-delta": ["--fwp-feature-map", "dpfp", "--fwp-update-rule", "delta"],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--out", default="speed_out")
    args = parser.parse_args()
    _, lm_raw = write_corpora(os.path.join(args.out, "raw"), n_train=20000, n_eval=50)
    data = os.path.join(args.out, "bin-lm")
    preprocess_lm(lm_raw, data)
    print(f"# fairseq-train words/s, fwp_lm_tiny (2 layers, d_model 64, 4 heads), {args.updates} updates, "
          f"4096 tokens per batch, CPU {os.cpu_count()} cores")
    print("| tokens per sample | model | words/s | vs softmax |")
    print("|---|---|---|---|")
    for length in (256, 1024):
        speeds = {}
        for name, flags in MODELS.items():
            log = train_lm(data, os.path.join(args.out, f"{name}-{length}"), *flags, "--max-tokens", 4096,
                           "--no-save", "--disable-validation", max_update=args.updates,
                           tokens_per_sample=length)
            speeds[name] = train_words_per_second(log)
            print(f"| {length} | {name} | {speeds[name]:.0f} | {speeds[name] / speeds['softmax']:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
