"""Text preparation for translation: Moses-style normalisation and tokenisation
(sacremoses), length/ratio cleaning, detokenisation (joint BPE: bpe.py).

These follow fairseq's examples/translation/prepare-wmt14en2de.sh: punctuation
normalisation, tokenisation with aggressive hyphen splitting, cleaning of
training and validation pairs to 1-250 tokens and a length ratio <= 1.5
(Moses' clean-corpus-n.perl), one BPE learnt on both languages.
"""
import functools
import gzip
import multiprocessing

from sacremoses import MosesDetokenizer, MosesPunctNormalizer, MosesTokenizer


def read_lines(path):
    """Lines of a text file (gzip if it ends in .gz), without newlines."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def write_lines(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")


@functools.lru_cache(maxsize=None)
def _moses(lang):
    return MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)


def _tokenize_line(lang, line):
    normalizer, tokenizer = _moses(lang)
    # escape=False keeps & < > ' " as they are: BLEU is computed on plain text.
    return tokenizer.tokenize(normalizer.normalize(line), aggressive_dash_splits=True, return_str=True, escape=False)


def tokenize(lines, lang, workers=1):
    """Normalise punctuation and tokenise, Moses-style."""
    job = functools.partial(_tokenize_line, lang)
    if workers <= 1:
        return [job(line) for line in lines]
    with multiprocessing.Pool(workers) as pool:
        return pool.map(job, lines, chunksize=1000)


def detokenize(lines, lang):
    detokenizer = MosesDetokenizer(lang=lang)
    return [detokenizer.detokenize(line.split()) for line in lines]


def keep_pair(src, tgt, min_len=1, max_len=250, ratio=1.5):
    """clean-corpus-n.perl's test on one tokenised pair."""
    n, m = len(src.split()), len(tgt.split())
    if not (min_len <= n <= max_len and min_len <= m <= max_len):
        return False
    return n / m <= ratio and m / n <= ratio


def clean_pairs(src_lines, tgt_lines, **limits):
    kept = [(s, t) for s, t in zip(src_lines, tgt_lines) if keep_pair(s, t, **limits)]
    return [s for s, _ in kept], [t for _, t in kept]
