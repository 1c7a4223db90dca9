"""Translation recipe steps shared by WMT14 En-De and Multi30k: prepare, train, translate and score.

Prepared layout (OUT is the --out folder):
    OUT/raw/{train,valid,test}.{src,tgt}   the text as given (test: the references for sacreBLEU)
    OUT/tok/...                            normalised and tokenised; train and valid cleaned
    OUT/bpe/codes, OUT/bpe/...             joint BPE (subword-nmt or fastBPE: bpe.py)
    OUT/bin/                               fairseq-preprocess --joined-dictionary
"""
import os
import re

import sacrebleu

from . import bpe, text
from .commands import PLUGIN_DIR, fairseq
from .prepared import preparing


def prepare(pairs, src, tgt, out, merges, workers=1, bpe_tool="subword-nmt"):
    """pairs: {"train": [(src_lines, tgt_lines), ...], "valid": [...], "test": [...]} of raw text.

    Once per OUT, whoever else prepares it at the same time (prepared.py); a BPE'd corpus that comes
    out implausible (check_subwords) stops here."""
    with preparing(out) as staging:
        if staging is None:
            print(f"{out}: prepared already", flush=True)
            return
        _prepare(pairs, src, tgt, staging, merges, workers, bpe_tool)


def _prepare(pairs, src, tgt, out, merges, workers, bpe_tool):
    for folder in ("raw", "tok", "bpe"):
        os.makedirs(os.path.join(out, folder), exist_ok=True)
    for split, parts in pairs.items():
        raw = {src: [line for s, _ in parts for line in s], tgt: [line for _, t in parts for line in t]}
        if len(raw[src]) != len(raw[tgt]):
            raise ValueError(f"{split}: {len(raw[src])} {src} lines but {len(raw[tgt])} {tgt} lines")
        tok = {lang: text.tokenize(lines, lang, workers) for lang, lines in raw.items()}
        if split != "test":  # every test sentence is kept and translated
            tok[src], tok[tgt] = text.clean_pairs(tok[src], tok[tgt])
        for lang in (src, tgt):
            text.write_lines(os.path.join(out, "raw", f"{split}.{lang}"), raw[lang])
            text.write_lines(os.path.join(out, "tok", f"{split}.{lang}"), tok[lang])
        print(f"{split}: {len(raw[src])} pairs, {len(tok[src])} after cleaning", flush=True)
    codes = os.path.join(out, "bpe", "codes")
    bpe.learn(bpe_tool, [os.path.join(out, "tok", f"train.{lang}") for lang in (src, tgt)], codes, merges, workers)
    with open(os.path.join(out, "bpe", "tool"), "w") as f:  # what fairseq-interactive's --bpe must be
        f.write(bpe.FAIRSEQ_BPE[bpe_tool] + "\n")
    for split in pairs:
        for lang in (src, tgt):
            tokenized = text.read_lines(os.path.join(out, "tok", f"{split}.{lang}"))
            text.write_lines(os.path.join(out, "bpe", f"{split}.{lang}"), bpe.apply(bpe_tool, codes, tokenized))
    check_subwords(out, src, tgt)
    bpe_dir = os.path.join(out, "bpe")
    fairseq("preprocess", "--source-lang", src, "--target-lang", tgt, "--trainpref", f"{bpe_dir}/train",
            "--validpref", f"{bpe_dir}/valid", "--testpref", f"{bpe_dir}/test", "--destdir", os.path.join(out, "bin"),
            "--joined-dictionary", "--workers", workers, echo=True)


def check_subwords(out, src, tgt):
    """Stops where the BPE'd training text holds far fewer subword types than the codes make: the mark of
    codes applied while incomplete, which split most words into characters (a correct corpus holds about
    one type per merge; a character-split one a few hundred types in all)."""
    merges = sum(not line.startswith("#version") for line in text.read_lines(os.path.join(out, "bpe", "codes")))
    types = {token for lang in (src, tgt) for line in text.read_lines(os.path.join(out, "bpe", f"train.{lang}"))
             for token in line.split()}
    if merges > 0 and len(types) < merges / 2:
        raise RuntimeError(f"the BPE'd training text holds {len(types)} subword types, but its codes make {merges} "
                           f"merges: the codes were applied while incomplete (another preparation writing "
                           f"them?). Delete {out} and prepare again")


def train(data_bin, save_dir, arch, row_flags, hyper_flags, extra=(), log=None):
    os.makedirs(save_dir, exist_ok=True)
    return fairseq("train", data_bin, "--user-dir", PLUGIN_DIR, "--arch", arch, *hyper_flags, *row_flags,
                   "--save-dir", save_dir, *extra, echo=True, log=log or os.path.join(save_dir, "train.log"))


def hypotheses(generate_output, expected):
    """The H- lines of fairseq-generate in sentence order; every sentence must be there."""
    found = {int(i): hyp for i, hyp in re.findall(r"^H-(\d+)\t[^\t]*\t(.*)$", generate_output, flags=re.M)}
    if sorted(found) != list(range(expected)):
        missing = sorted(set(range(expected)) - set(found))[:10]
        raise RuntimeError(f"fairseq-generate translated {len(found)} of {expected} sentences (missing e.g. {missing})")
    return [found[i] for i in range(expected)]


def split_compounds(line):
    """Ott et al. (2018)'s compound splitting for tokenised BLEU on WMT14 En-De."""
    return re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", line)


def translate_and_score(prepared, checkpoint, src, tgt, generate_flags, out_prefix, extra=()):
    """Translate the test set; sacreBLEU on detokenised output, and tokenised BLEU with compound splitting."""
    output = fairseq("generate", os.path.join(prepared, "bin"), "--user-dir", PLUGIN_DIR, "--path", checkpoint,
                     "--source-lang", src, "--target-lang", tgt, "--gen-subset", "test", "--remove-bpe",
                     *generate_flags, *extra, echo=True, log=out_prefix + ".generate.log")
    references = text.read_lines(os.path.join(prepared, "raw", f"test.{tgt}"))
    tokenized_refs = text.read_lines(os.path.join(prepared, "tok", f"test.{tgt}"))
    hyps = hypotheses(output, len(references))
    detok = text.detokenize(hyps, tgt)
    text.write_lines(out_prefix + ".hyp.tok", hyps)
    text.write_lines(out_prefix + ".hyp.detok", detok)
    sacre = sacrebleu.corpus_bleu(detok, [references])
    tokenized = sacrebleu.corpus_bleu([split_compounds(h) for h in hyps],
                                      [[split_compounds(r) for r in tokenized_refs]], tokenize="none")
    speed = re.search(r"Translated .* in ([0-9.]+)s \(([0-9.]+) sentences/s, ([0-9.]+) tokens/s\)", output)
    return {"sacrebleu": sacre.score, "sacrebleu_signature": str(sacre), "tokenized_bleu": tokenized.score,
            "sentences": len(hyps), "generate_tokens_per_s": float(speed.group(3)) if speed else None}
