"""The training token stream that the record's token_offset points into, with its documents.

fairseq's language_modeling task concatenates the binarised lines of the
train split (each ending in eos) into one stream and cuts it into blocks
(TokenBlockDataset). A document starts at a line that matches a title
pattern; the default is WikiText's article titles, `= Title =` (section
headings `= = Heading = =` do not match). In passages, an end-of-line eos
is shown as ¶.
"""
import os
import re

import numpy as np

WIKITEXT_TITLE = r"^= [^=].* =$"
PARAGRAPH_MARK = "¶"  # how an end-of-line eos is shown in passages


class TrainingStream:
    def __init__(self, data_dir, dictionary, title_pattern=WIKITEXT_TITLE):
        from fairseq.data import data_utils

        dataset = data_utils.load_indexed_dataset(os.path.join(data_dir, "train"), dictionary, combine=True)
        if dataset is None:
            raise FileNotFoundError(f"no binarised train split in {data_dir}")
        self.dictionary = dictionary
        lines = [dataset[i].numpy() for i in range(len(dataset))]
        self.tokens = np.concatenate(lines)
        line_starts = np.cumsum([0] + [len(line) for line in lines[:-1]])
        title = re.compile(title_pattern)
        self.doc_starts, self.doc_titles = [], []
        for start, line in zip(line_starts, lines):
            text = self.words(line[:-1])  # without the eos
            if title.match(text):
                self.doc_starts.append(start)
                self.doc_titles.append(text.strip("= "))
        self.doc_starts = np.array(self.doc_starts, dtype=np.int64)

    def __len__(self):
        return len(self.tokens)

    def words(self, ids):
        eos = self.dictionary.eos()
        return " ".join(PARAGRAPH_MARK if i == eos else self.dictionary[i] for i in ids)

    def document_of(self, offsets):
        """Document index of each stream offset; -1 before the first title (or for the leading eos, offset -1)."""
        return np.searchsorted(self.doc_starts, offsets, side="right") - 1

    def title(self, doc):
        return self.doc_titles[doc] if doc >= 0 else "(no title)"

    def token(self, offset):
        return PARAGRAPH_MARK if offset < 0 else self.words([self.tokens[offset]])

    def passage(self, offset, before, after):
        """The words around `offset`, within its document, with the token at `offset` in bold."""
        if offset < 0:  # the eos fairseq reads before the first token
            return f"**{PARAGRAPH_MARK}** {self.words(self.tokens[:after])} …"
        doc = self.document_of(offset)
        doc_start = self.doc_starts[doc] if doc >= 0 else 0
        doc_end = self.doc_starts[doc + 1] if doc + 1 < len(self.doc_starts) else len(self.tokens)
        start, stop = max(doc_start, offset - before), min(doc_end, offset + after + 1)
        return " ".join(filter(None, [
            "…" if start > doc_start else "",
            self.words(self.tokens[start:offset]),
            f"**{self.token(offset)}**",
            self.words(self.tokens[offset + 1:stop]),
            "…" if stop < doc_end else "",
        ]))
