"""A full-size rehearsal of uptraining transformer_lm.wiki103.adaptive, on the CPU: what the conversion of a
transformer_lm_wiki103 (16 layers of 1024, 8 heads, adaptive input and softmax over 267,744 types with cutoffs
20000,60000, tied; about 247M parameters, random weights) to each row of the WikiText-103 uptraining recipe
costs in time and peak memory, and fairseq-eval-lm's throughput of each converted model beside the softmax
original on blocks of 3,072 tokens.

    .venv/bin/python examples/speed/uptrain_wiki103_big.py --out /tmp/uptrain_wiki103_big [--blocks 2]

The model is saved as the published one was (its config as `args` alone, a pickle) and packed as its archive
is (adaptive_lm_wiki103.v2.tar.bz2: model.pt and dict.txt in one folder); each row is converted with
`python -m fairseq_fwp.uptrain --pretrained FOLDER` in a process of its own whose peak resident memory is
reported, and the first row once more from the .tar.bz2 (its extraction included). The text scored: --blocks
blocks of 3,072 random words, fairseq-eval-lm --tokens-per-sample 3072 --max-tokens 3072 --softmax-batch 1024
for every model (its throughput as eval-lm reports it), and for the fast-weight models also with the state
carried in 512-token segments (--task fwp_stream_lm --batch-size 1).
"""
import argparse
import os
import platform
import random
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import fairseq_fwp  # noqa: E402,F401  (torch.load of fairseq's checkpoints)
from examples.recipes import language_model, text  # noqa: E402
from examples.recipes.commands import PLUGIN_DIR, fairseq  # noqa: E402
from examples.recipes.published_layouts import pack, write_lm_archive  # noqa: E402
from examples.recipes.rows import WIKITEXT103_UPTRAINING  # noqa: E402
from examples.speed.uptrain_big import measured_conversion  # noqa: E402

TYPES = 267744  # the published dict.txt's, with fairseq's 4 specials
BLOCK = 3072


def published_stand_in(out):
    """A random transformer_lm_wiki103 packed as the published archive (once); returns (its folder, its
    archive, its parameter count, the seconds packing took, None where it was packed before)."""
    import torch

    folder = os.path.join(out, "adaptive_lm_wiki103.v2")
    archive = os.path.join(out, "adaptive_lm_wiki103.v2.tar.bz2")
    if not os.path.exists(os.path.join(folder, "model.pt")):
        write_lm_archive(folder, "transformer_lm_wiki103", "args", ["--tokens-per-sample", BLOCK],
                         words=[f"w{i}" for i in range(TYPES - 4)])
    packing = None
    if not os.path.exists(archive):
        began = time.time()
        pack(folder, archive, top="adaptive_lm_wiki103.v2")
        packing = time.time() - began
    state = torch.load(os.path.join(folder, "model.pt"), weights_only=False)["model"]
    unique = {x.data_ptr(): x.numel() for name, x in state.items() if not name.endswith("version")}  # tied once
    return folder, archive, sum(unique.values()), packing


def test_text(out, folder, blocks):
    raw = os.path.join(out, "raw")
    os.makedirs(raw, exist_ok=True)
    rng = random.Random(0)
    words = [f"w{rng.randrange(TYPES - 4)}" for _ in range(blocks * BLOCK)]
    text.write_lines(os.path.join(raw, "test.txt"), [" ".join(words[i:i + 100]) for i in range(0, len(words), 100)])
    data = os.path.join(out, "bin")
    if not os.path.exists(os.path.join(data, "test.bin")):
        fairseq("preprocess", "--only-source", "--srcdict", os.path.join(folder, "dict.txt"), "--testpref",
                os.path.join(raw, "test.txt"), "--destdir", data, "--workers", 1)
    return data


def tokens_per_second(data, checkpoint, *flags):
    output = fairseq("eval-lm", data, "--user-dir", PLUGIN_DIR, "--path", checkpoint, "--gen-subset", "test",
                     "--tokens-per-sample", BLOCK, "--max-tokens", BLOCK, "--softmax-batch", 1024, "--cpu",
                     "--num-workers", 0, *flags)
    return language_model.parse_eval_lm(output)["tokens_per_s"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--blocks", type=int, default=2, help="blocks of 3,072 tokens that eval-lm scores")
    args = parser.parse_args()
    os.environ["XDG_CACHE_HOME"] = os.path.join(args.out, "cache")  # the extraction's, not the user's
    folder, archive, parameters, packing = published_stand_in(args.out)
    data = test_text(args.out, folder, args.blocks)
    threads = os.environ.get("OMP_NUM_THREADS", "all")
    print(f"# uptraining rehearsal, {time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()} cores, "
          f"{threads} threads; transformer_lm_wiki103, {parameters / 1e6:.0f}M parameters, random weights; "
          f"{os.path.getsize(archive) / 1e9:.2f} GB archive"
          + (f" (packed in {packing:.0f} s)" if packing is not None else ""))
    print("| model | conversion (s) | conversion peak memory (MB) | eval-lm, blocks of 3,072 (tokens/s) | vs softmax "
          "| eval-lm, carried in 512-token segments (tokens/s) |")
    print("|---|---|---|---|---|---|")
    softmax = tokens_per_second(data, os.path.join(folder, "model.pt"))
    print(f"| softmax (the original) | | | {softmax:.0f} | 1.00x | |", flush=True)
    for row, spec in WIKITEXT103_UPTRAINING.items():
        out = os.path.join(args.out, row)
        seconds, peak = measured_conversion(folder, out, spec.flags_for())
        checkpoint = os.path.join(out, "model.pt")
        blocks = tokens_per_second(data, checkpoint)
        carried = tokens_per_second(data, checkpoint, "--task", "fwp_stream_lm", "--batch-size", 1,
                                    "--tokens-per-sample", 512)
        print(f"| {row} | {seconds} | {peak} | {blocks:.0f} | {blocks / softmax:.2f}x | {carried:.0f} |", flush=True)
    first = next(iter(WIKITEXT103_UPTRAINING))
    shutil.rmtree(os.environ["XDG_CACHE_HOME"], ignore_errors=True)  # extracted anew
    seconds, peak = measured_conversion(archive, os.path.join(args.out, f"{first}-from-archive"),
                                        WIKITEXT103_UPTRAINING[first].flags_for())
    print(f"| {first}, from the .tar.bz2 (extracted into the cache first) | {seconds} | {peak} | | | |")


if __name__ == "__main__":
    main()
