"""A full-size rehearsal of uptraining a published model, on the CPU: what the conversion of a
transformer_vaswani_wmt_en_de_big (about 210M parameters, random weights, a joined dictionary of 32,768
types) to each row of the WMT16 recipe costs in time and peak memory, and one fairseq-generate batch through
each converted model beside the softmax original.

    .venv/bin/python examples/speed/uptrain_big.py --out /tmp/uptrain_big [--sentences 16]

The model is saved as the published ones were (its config as `args` alone) and packed as fairseq's archives
are (model.pt, dict.en.txt, dict.de.txt, bpecodes), and converted
with `python -m fairseq_fwp.uptrain --pretrained FOLDER`, each in a process of its own whose peak resident
memory is reported. The batch: --sentences source sentences of 20 random words, beam 4, at most 30 target
tokens (random weights never stop earlier), one thread per process.
"""
import argparse
import os
import platform
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import fairseq_fwp  # noqa: E402,F401  (torch.load of fairseq's checkpoints)
from examples.recipes.commands import PLUGIN_DIR, fairseq  # noqa: E402
from examples.recipes.published_layouts import write_archive  # noqa: E402
from examples.recipes.wmt16_uptraining import WMT16_ROWS  # noqa: E402

TYPES = 32768
MEASURED = ("import resource, sys, time; sys.argv = ['uptrain'] + sys.argv[1:]; start = time.time(); "
            "from fairseq_fwp import uptrain; uptrain.main(); "
            "print(f'SECONDS {time.time() - start:.1f} PEAK_MB {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}')")


def measured_conversion(source, out, row_flags):
    """`python -m fairseq_fwp.uptrain --pretrained SOURCE --out OUT -- ROW_FLAGS` in a process of its own: (its
    seconds, its peak resident memory in MB), as text."""
    output = subprocess.run([sys.executable, "-c", MEASURED, "--pretrained", str(source), "--out", str(out), "--",
                             *row_flags], capture_output=True, text=True, cwd=ROOT)
    if output.returncode:
        raise RuntimeError(output.stderr[-3000:])
    return re.search(r"SECONDS ([0-9.]+) PEAK_MB (\d+)", output.stdout).groups()


def published_stand_in(out):
    """A random transformer_vaswani_wmt_en_de_big packed as fairseq's archives, saved as the published ones
    were (args only); returns (its folder, its parameter count)."""
    import torch

    folder = os.path.join(out, "published")
    write_archive(folder, "transformer_vaswani_wmt_en_de_big", "args", ["--share-all-embeddings"],
                  words=[f"w{i}" for i in range(TYPES - 4)])  # fairseq adds its 4 specials
    state = torch.load(os.path.join(folder, "model.pt"), weights_only=False)["model"]
    unique = {x.data_ptr(): x.numel() for name, x in state.items() if not name.endswith("version")}  # shared once
    return folder, sum(unique.values())


def test_batch(out, folder, sentences):
    raw = os.path.join(out, "raw")
    os.makedirs(raw, exist_ok=True)
    for lang in ("en", "de"):
        with open(os.path.join(raw, f"test.{lang}"), "w") as f:
            for i in range(sentences):
                f.write(" ".join(f"w{(i * 7919 + j * 104729) % 30000}" for j in range(20)) + "\n")
    data = os.path.join(out, "bin")
    if not os.path.exists(os.path.join(data, "dict.en.txt")):
        fairseq("preprocess", "-s", "en", "-t", "de", "--testpref", os.path.join(raw, "test"), "--destdir", data,
                "--srcdict", os.path.join(folder, "dict.en.txt"), "--tgtdict", os.path.join(folder, "dict.de.txt"))
    return data


def generate_seconds(data, checkpoint, sentences):
    output = fairseq("generate", data, "--user-dir", PLUGIN_DIR, "--path", checkpoint, "--gen-subset", "test",
                     "--beam", 4, "--batch-size", sentences, "--max-len-a", 0, "--max-len-b", 30, "--cpu")
    return float(re.search(r"Translated .* in ([0-9.]+)s", output).group(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sentences", type=int, default=16)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    folder, parameters = published_stand_in(args.out)
    data = test_batch(args.out, folder, args.sentences)
    print(f"# uptraining rehearsal, {time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()} cores, 1 thread;"
          f" transformer_vaswani_wmt_en_de_big, {parameters / 1e6:.0f}M parameters, random weights")
    print("| model | conversion (s) | conversion peak memory (MB) | generate batch (s) | vs softmax |")
    print("|---|---|---|---|---|")
    softmax = generate_seconds(data, os.path.join(folder, "model.pt"), args.sentences)
    print(f"| softmax (the original) | | | {softmax:.1f} | 1.00x |", flush=True)
    for row, flags in WMT16_ROWS.items():
        out = os.path.join(args.out, row)
        seconds, peak = measured_conversion(folder, out, flags)
        generated = generate_seconds(data, os.path.join(out, "model.pt"), args.sentences)
        print(f"| {row} | {seconds} | {peak} | {generated:.1f} | {softmax / generated:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
