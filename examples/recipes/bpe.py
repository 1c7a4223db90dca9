"""Joint BPE with either of the two tools fairseq's own --bpe knows: subword-nmt or fastBPE.

Both write codes in the same format (pairs to merge, "@@ " continuation
marks), which fairseq-interactive and the hub interface read with
``--bpe subword_nmt --bpe-codes CODES`` or ``--bpe fastbpe --bpe-codes CODES``
(``FAIRSEQ_BPE``), together with ``--tokenizer moses``, to translate raw text.

fastBPE learns with its command-line program (``fastbpe learnbpe``, built
from the fastBPE package's sources by scripts/setup_env.sh into the
environment's bin folder) and applies codes with its Python module, the one
fairseq's ``--bpe fastbpe`` uses.
"""
import os
import shutil
import subprocess
import sys

BPE_TOOLS = ("subword-nmt", "fastbpe")
FAIRSEQ_BPE = {"subword-nmt": "subword_nmt", "fastbpe": "fastbpe"}


def learn(tool, tokenized_files, codes_path, merges, workers=1):
    """One BPE for all the given files (both languages): the joined dictionary of the paper's setup."""
    _check(tool)
    if tool == "fastbpe":
        with open(codes_path, "w", encoding="utf-8") as codes:
            subprocess.run([fastbpe_program(), "learnbpe", str(merges), *map(str, tokenized_files)],
                           stdout=codes, check=True)
        return
    from subword_nmt.learn_bpe import learn_bpe

    joint = codes_path + ".train-text"
    with open(joint, "w", encoding="utf-8") as out:
        for path in tokenized_files:
            with open(path, encoding="utf-8") as f:
                out.writelines(f)
    with open(joint, encoding="utf-8") as infile, open(codes_path, "w", encoding="utf-8") as outfile:
        learn_bpe(infile, outfile, merges, num_workers=workers)
    os.remove(joint)


def apply(tool, codes_path, lines):
    """The lines with the codes applied ("@@ " marks continued subwords)."""
    _check(tool)
    if tool == "fastbpe":
        import fastBPE

        return fastBPE.fastBPE(codes_path).apply(list(lines))
    from subword_nmt.apply_bpe import BPE

    with open(codes_path, encoding="utf-8") as codes:
        bpe = BPE(codes)
    return [bpe.process_line(line) for line in lines]


def fastbpe_program():
    """fastBPE's command-line program: in this environment's bin folder, else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "fastbpe")
    program = here if os.path.exists(here) else shutil.which("fastbpe")
    if program is None:
        raise FileNotFoundError(
            "fastBPE's program is not installed: bash scripts/setup_env.sh builds it into .venv/bin, or compile "
            "fastBPE's main.cc yourself (g++ -std=c++11 -pthread -O3 fastBPE/main.cc -IfastBPE -o fastbpe) "
            "and put it on PATH; --bpe-tool subword-nmt needs nothing else")
    return program


def _check(tool):
    if tool not in BPE_TOOLS:
        raise ValueError(f"BPE tool must be one of {', '.join(BPE_TOOLS)}; got {tool!r}")
