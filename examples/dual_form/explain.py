"""Which training passages does a test position attend to? (paper Sec. 5.5 and Table 2)

The query is the layer's input x at one position of a test text. Its
attention weight on training row t is alpha_t = x_t . x (Def. 2.1, Eq. 14).
As in the paper, the weights of all rows that read the same training token
(it is seen once per epoch) are summed; the top-k tokens are shown with the
passage around them, and the attention is also summed per training
document. Everything is float64 with fixed chunking and stable sorting, so
the output is the same on every run.
"""
import json
import os
import re
from dataclasses import dataclass

import numpy as np

from .capture import load_checkpoint, query_input
from .corpus import WIKITEXT_TITLE, TrainingStream
from .dual import attention_weights
from .plot import plot_attention


def read_query_line(path, line_number, title_pattern=WIKITEXT_TITLE):
    """(words of line `line_number` (1-based) of a raw text file, title of the document it is in)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if not 1 <= line_number <= len(lines):
        raise ValueError(f"--line {line_number}: {path} has {len(lines)} lines")
    title = re.compile(title_pattern)
    above = (" ".join(text.split()) for text in reversed(lines[:line_number - 1]))
    doc = next((t.strip("= ") for t in above if title.match(t)), None)
    return lines[line_number - 1].split(), doc


@dataclass
class Explanation:
    report: dict  # JSON-ready: query, top-k passages, attention per document
    per_token: np.ndarray  # summed attention per training token; index i is stream offset i - 1
    doc_starts: np.ndarray  # stream offsets where documents start


def _query_passage(words, before):
    """The last `before` words of the context, then the query token in bold."""
    shown = words[-before - 1:]
    return " ".join(["…"] * (len(shown) < len(words)) + shown[:-1] + [f"**{shown[-1]}**"])


def explain(record, checkpoint, layer, words, position=-1, top_k=3, window=12, data=None,
            title_pattern=WIKITEXT_TITLE, query_title=None):
    """The Explanation of `words[position]` for `layer` (see write_report for the files)."""
    record.check_layer(layer)
    if not -len(words) <= position < len(words):
        raise ValueError(f"--position {position} is outside the query's {len(words)} words")
    position %= len(words)
    model, task, num_updates = load_checkpoint(checkpoint, data)
    query, context, unknown = query_input(model, task, layer, record.manifest["layouts"][layer],
                                          words[:position + 1], task.args.tokens_per_sample)
    rows = record.rows_before(num_updates)
    alpha = attention_weights(record, layer, query, rows)
    stream = TrainingStream(data or task.args.data, task.source_dictionary, title_pattern)

    # Slot i holds training stream offset i - 1; slot 0 is the eos read before the first token.
    slots = np.asarray(record.index["token_offset"][:rows]) + 1
    per_token = np.bincount(slots, weights=alpha, minlength=len(stream) + 1)
    times_seen = np.bincount(slots, minlength=len(stream) + 1)
    top = np.argsort(-per_token, kind="stable")[:top_k]
    docs = stream.document_of(np.arange(-1, len(stream)))
    per_doc = np.bincount(docs + 1, weights=per_token, minlength=len(stream.doc_titles) + 1)
    tokens_per_doc = np.bincount(docs + 1, minlength=len(stream.doc_titles) + 1)
    report = {
        "layer": layer,
        "num_updates": num_updates,
        "training_rows": rows,
        "query": {"title": query_title, "passage": _query_passage(context, window), "token": context[-1],
                  "position": position, "context_words": len(context), "unknown_words": unknown},
        "total_attention": float(alpha.sum()),
        "top": [{"rank": rank + 1, "token_offset": int(slot - 1), "token": stream.token(slot - 1),
                 "attention": float(per_token[slot]), "times_seen": int(times_seen[slot]),
                 "document": stream.title(docs[slot]), "passage": stream.passage(slot - 1, window, window)}
                for rank, slot in enumerate(top)],
        "documents": [{"document": stream.title(d - 1), "attention": float(per_doc[d]),
                       "tokens": int(tokens_per_doc[d])}
                      for d in np.argsort(-per_doc, kind="stable") if tokens_per_doc[d]],
    }
    return Explanation(report, per_token, stream.doc_starts)


def markdown(result, num_documents=10):
    """result: Explanation.report; a table like the paper's Table 2, then the documents by attention."""
    q = result["query"]
    lines = [f"Layer `{result['layer']}`, checkpoint after {result['num_updates']} updates, "
             f"{result['training_rows']} training rows; total attention {result['total_attention']:.4g}.", "",
             "| | page | passage | attention |", "| --- | --- | --- | --- |",
             f"| Query | {q['title'] or ''} | {q['passage']} | |"]
    lines += [f"| Top-{t['rank']} | {t['document']} | {t['passage']} | {t['attention']:.4g} |" for t in result["top"]]
    lines += ["", "| document | total attention | tokens | per token |", "| --- | --- | --- | --- |"]
    lines += [f"| {d['document']} | {d['attention']:.4g} | {d['tokens']} | {d['attention'] / d['tokens']:.3g} |"
              for d in result["documents"][:num_documents]]
    return "\n".join(lines) + "\n"


def write_report(explanation, out_dir):
    """explain.json, explain.md and attention.png in out_dir; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {kind: os.path.join(out_dir, name)
             for kind, name in (("json", "explain.json"), ("markdown", "explain.md"), ("png", "attention.png"))}
    with open(paths["json"], "w") as f:
        json.dump(explanation.report, f, indent=2, ensure_ascii=False)
    with open(paths["markdown"], "w") as f:
        f.write(markdown(explanation.report))
    plot_attention(explanation, paths["png"])
    return paths
