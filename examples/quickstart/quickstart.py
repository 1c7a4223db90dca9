"""The quickstart job: every kind of fast-weight model through the real fairseq pipeline.

Generates the built-in synthetic translation and LM corpora, preprocesses
them, trains one tiny model per row for a fixed number of updates on CPU,
translates with beam search (sacreBLEU) or evaluates perplexity, and prints
a summary table.

    .venv/bin/python examples/quickstart/quickstart.py [--out quickstart_out] [--mt-updates 250] [--lm-updates 150]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fairseq_fwp.synthetic_data import write_corpora  # noqa: E402
from fairseq_fwp.recipes.pipeline import (  # noqa: E402
    bleu, eval_lm, generate, perplexity, preprocess_lm, preprocess_translation, train_lm,
    train_translation, train_words_per_second,
)

# (feature map, update rule, extra flags). MT rows follow Table 1 (sum rule,
# attention normalisation) plus a delta-rule decoder; LM rows follow Table 2.
MT_ROWS = [("softmax", "-", []), ("linear", "sum", []), ("performer", "sum", []), ("dpfp", "sum", []),
           ("dpfp", "delta", [])]
LM_ROWS = [("softmax", "-", ["--fwp-positions", "on"]), ("linear", "sum", []), ("linear", "delta", []),
           ("performer", "delta", []), ("dpfp", "delta", [])]


def row_flags(feature_map, rule, extra):
    flags = ["--fwp-feature-map", feature_map, *extra]
    return flags + (["--fwp-update-rule", rule] if rule != "-" else [])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="quickstart_out")
    parser.add_argument("--mt-updates", type=int, default=250)
    parser.add_argument("--lm-updates", type=int, default=150)
    args = parser.parse_args(argv)

    start = time.time()
    print(f"{len(MT_ROWS)} translation and {len(LM_ROWS)} language models, trained one after the other; "
          "preparing the synthetic corpora", flush=True)
    mt_raw, lm_raw = write_corpora(os.path.join(args.out, "raw"), n_train=3000, n_eval=203)
    mt_bin, lm_bin = os.path.join(args.out, "bin-mt"), os.path.join(args.out, "bin-lm")
    preprocess_translation(mt_raw, mt_bin)
    preprocess_lm(lm_raw, lm_bin)

    results = []
    for feature_map, rule, extra in MT_ROWS:
        save = os.path.join(args.out, f"mt-{feature_map}-{rule}")
        print(f"[{time.time() - start:5.0f}s] training translation {feature_map}/{rule}", flush=True)
        log = train_translation(mt_bin, save, *row_flags(feature_map, rule, extra), "--dropout", 0,
                                max_update=args.mt_updates, lr=0.003, warmup=100)
        score = bleu(generate(mt_bin, os.path.join(save, "checkpoint_last.pt")))
        results.append(("translation", feature_map, rule, f"BLEU {score:.1f}", train_words_per_second(log)))
        print(f"[{time.time() - start:5.0f}s] translation {feature_map}/{rule}: BLEU {score:.1f}", flush=True)
    for feature_map, rule, extra in LM_ROWS:
        save = os.path.join(args.out, f"lm-{feature_map}-{rule}")
        print(f"[{time.time() - start:5.0f}s] training language model {feature_map}/{rule}", flush=True)
        log = train_lm(lm_bin, save, *row_flags(feature_map, rule, extra), max_update=args.lm_updates)
        # the paper's protocol: windows of the training length, stride 1 (tests/test_sliding_window.py)
        ppl = perplexity(eval_lm(lm_bin, os.path.join(save, "checkpoint_last.pt"), "--context-window", 63))
        results.append(("language model", feature_map, rule, f"ppl {ppl:.2f}", train_words_per_second(log)))
        print(f"[{time.time() - start:5.0f}s] language model {feature_map}/{rule}: ppl {ppl:.2f}", flush=True)

    print(f"\nSummary ({args.mt_updates} MT / {args.lm_updates} LM updates per row, CPU, "
          f"{time.time() - start:.0f}s in all):\n")
    print("| task | feature map | update rule | test score | train words/s |")
    print("|---|---|---|---|---|")
    for task, feature_map, rule, score, wps in results:
        print(f"| {task} | {feature_map} | {rule} | {score} | {wps:.0f} |")


if __name__ == "__main__":
    main()
