"""What the modules a softmax model lacks do to its converted fast-weight model, before any update.

    .venv/bin/python examples/small_real_data/conversion_effects.py --out runs/multi30k

Needs the Multi30k softmax row of that --out (python -m examples.recipes.small_real_data multi30k
--out runs/multi30k --rows softmax). Converts its best checkpoint (fairseq_fwp/uptraining/conversion.py) into the
DPFP-256 delta-rule model, and into the same model plus one added module each (a decay gate, an
output gate, a short convolution of width 4) and all three, with the added modules started as ungated
and as fresh (uptrain's --added-modules). Prints, for each, the relative change of the decoder's
output (teacher-forced logits at the validation set's target tokens, |with - without| / |without|) against the
conversion without added modules (every parameter they share is that conversion's, beta's projection
included), and sacreBLEU on test_2016_flickr right after conversion.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fairseq_fwp.uptraining import conversion  # noqa: E402
from examples.recipes import translation  # noqa: E402
from examples.recipes.commands import PLUGIN_DIR  # noqa: E402
from examples.recipes.small_real_data import (MULTI30K_GENERATE, MULTI30K_MODEL,  # noqa: E402
                                                 MULTI30K_TRAINING)

BASE = ["--fwp-feature-map", "dpfp", "--fwp-dpfp-nu", "2", "--fwp-update-rule", "delta"]
ADDED = {"decay gate": ["--fwp-update-rule", "gated-delta"], "output gate": ["--fwp-output-gate", "on"],
         "short convolution": ["--fwp-short-conv", "4"],
         "all three": ["--fwp-update-rule", "gated-delta", "--fwp-output-gate", "on", "--fwp-short-conv", "4"]}


def valid_logits(checkpoint, data_bin):
    """The decoder's teacher-forced output logits at every target token of the validation set (padding
    left out), batch by batch (in order)."""
    from fairseq import checkpoint_utils

    (model,), _, task = checkpoint_utils.load_model_ensemble_and_task([checkpoint], arg_overrides={"data": data_bin})
    model.eval()
    task.load_dataset("valid")
    batches = task.get_batch_iterator(task.dataset("valid"), max_tokens=4096, seed=1).next_epoch_itr(shuffle=False)
    with torch.no_grad():
        return [model(**batch["net_input"])[0][batch["target"].ne(task.target_dictionary.pad())]
                for batch in batches]


def relative_change(logits, reference):
    difference = sum(float((a - b).pow(2).sum()) for a, b in zip(logits, reference))
    return (difference / sum(float(b.pow(2).sum()) for b in reference)) ** 0.5


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the small_real_data multi30k --out with a trained softmax row")
    args = parser.parse_args()
    source = os.path.join(args.out, "checkpoints", "softmax", "checkpoint_best.pt")
    data_bin, work = os.path.join(args.out, "bin"), os.path.join(args.out, "conversion_effects")
    os.makedirs(work, exist_ok=True)
    argv = [data_bin, "--user-dir", PLUGIN_DIR, "--arch", "fwp_transformer_tiny", *MULTI30K_MODEL, *MULTI30K_TRAINING]

    def converted(name, flags, added_modules, like=None):
        """Converts into BASE + flags; with `like`, a checkpoint whose new parameters (beta's projection) the
        conversion takes over, so that only the added module differs from it."""
        path = os.path.join(work, f"{name.replace(' ', '-')}-{added_modules}.pt")
        conversion.convert(source, path, argv + BASE + flags, added_modules=added_modules)
        if like is not None:
            checkpoint, shared = torch.load(path, weights_only=False), torch.load(like, weights_only=False)["model"]
            checkpoint["model"].update({name: value for name, value in shared.items() if name in checkpoint["model"]})
            torch.save(checkpoint, path)
        bleu = translation.translate_and_score(args.out, path, "en", "de", MULTI30K_GENERATE, path[:-3])["sacrebleu"]
        return path, bleu

    plain, plain_bleu = converted("none", [], "ungated")
    reference = valid_logits(plain, data_bin)
    print("| added to DPFP-256 delta | added modules | output change (relative) | BLEU right after conversion |")
    print("|---|---|---|---|")
    print(f"| nothing | | 0 | {plain_bleu:.1f} |")
    for name, flags in ADDED.items():
        for added_modules in conversion.ADDED_MODULES:
            path, bleu = converted(name, flags, added_modules, like=plain)
            change = relative_change(valid_logits(path, data_bin), reference)
            print(f"| {name} | {added_modules} | {change:.3f} | {bleu:.1f} |", flush=True)


if __name__ == "__main__":
    main()
