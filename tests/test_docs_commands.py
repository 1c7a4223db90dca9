"""Every shell command in a code block of the README and docs/ runs as written, on small generated data
("my data": tok/ and text/, and a stand-in of fairseq's published WikiText-103 LM served under its hub name),
with a tiny budget added where a user trying it would add one. A block that cannot run here says why, in the
page, just above it:

    <!-- not run by the docs test: needs the network -->

with one of REASONS; the test lists those blocks as skipped, with their reasons (scripts/test.sh shows
skips). The blocks run in one folder, the README's first, then docs/ page by page, so a page's commands
find what the README's made (data-bin/my_pair, data-bin/my_lm, ckpt/my_pair) and no two commands may
write to the same checkpoint folder."""
import dataclasses
import glob
import os
import re
import subprocess
import sys

import pytest

from examples.recipes import preloaded
from examples.recipes.synthetic_data import write_corpora

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
NOT_RUN = re.compile(r"<!-- not run by the docs test: (.+?) -->")
REASONS = (
    "needs the network",
    "needs a GPU",
    "needs the network and a GPU",
    "changes this clone (adds a git worktree)",
    "a full-size benchmark: minutes and gigabytes",
    "a long run: minutes by design",
    "the two commands: CI runs the test command; tests/test_quickstart.py runs the quickstart job",
)
FENCE = re.compile(r"^```(\S*)\s*$")
# What a block may start with that makes an untagged block a shell command (tag it bash, or text for a synopsis).
COMMAND_START = re.compile(r"^(fairseq-|python |bash |git |nice |subword-nmt |\.venv/)")

# A tiny budget per program, as a user trying the command would give it: in place of a value the command
# gives, or appended (argparse: the last value of a flag wins). `...` in a command ("your other flags") is
# where appended flags go.
BUDGETS = [
    (re.compile(r"(^|\s)fairseq-train\s"), "--max-update 2 --update-freq 1"),  # each update one batch
    (re.compile(r"-m examples\.synthetic_retrieval\.sweep\s"), "--max-steps 100 --sizes 20 --models sum-linear"),
    (re.compile(r"-m examples\.state_tracking\s"), "--tasks parity --rows sum --seeds 1 --workers 1 --updates 20"),
    (re.compile(r"-m fairseq_fwp\.uptrain\s.*--attention-transfer-steps\s"), "--attention-transfer-steps 2"),
]
FLAG_AND_VALUE = re.compile(r"(--[\w-]+) (\S+)")
# What fairseq-train cannot do without, for a command whose `...` leaves it out: (the flags that give it,
# what a user would add).
ESSENTIALS = [(("--max-tokens", "--batch-size"), "--max-tokens 2048"), (("--optimizer",), "--optimizer adam --lr 5e-4")]
# The paper's big translation model, made small enough for a CPU.
SMALLER = re.compile(r"--arch \S+_big\b")
SMALL_MODEL = ("--encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 64 --decoder-embed-dim 64 "
               "--encoder-ffn-embed-dim 128 --decoder-ffn-embed-dim 128 --encoder-attention-heads 2 "
               "--decoder-attention-heads 2")
# What the pages' placeholders stand for, in the folder the README's commands made.
PLACEHOLDERS = {
    "docs/dual_form.md": {"DATA": "data-bin/my_lm", "RECORD": "record"},
    "docs/training.md": {"OUT/bin": "data-bin/my_pair", "OUT/bpe/codes": "codes",
                         "CKPT": "ckpt/my_pair/checkpoint_best.pt"},
}
STDIN = "a small red car drives home\n"  # fairseq-interactive's sentence
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9_]{2,}\b(?!=)")  # OUT, CKPT, ... (not VAR= assignments)


@dataclasses.dataclass
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence
    lang: str
    text: str
    not_run: str = None  # the page's reason, if it says the block cannot run here

    @property
    def name(self):
        return f"{self.page}:{self.line}"


def code_blocks(path):
    lines = open(path).read().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        reason = NOT_RUN.fullmatch(lines[i - 1].strip()) if i else None
        blocks.append(Block(os.path.relpath(path, ROOT), i + 1, fence.group(1), "\n".join(lines[i + 1:end]),
                            reason.group(1) if reason else None))
        i = end + 1
    return blocks


def command_blocks():
    return [b for page in PAGES for b in code_blocks(page) if b.lang == "bash"]


def commands(text):
    """The block's commands, each as its physical lines (a line ending in a backslash goes on)."""
    groups, current = [], []
    for line in text.split("\n"):
        current.append(line)
        if not line.rstrip().endswith("\\"):
            groups.append(current)
            current = []
    return groups + ([current] if current else [])


def with_budget(text, placeholders=None):
    """The block as a user would run it here: placeholders filled in, each command with its tiny budget at
    its end (before a trailing comment), in place of its `...`."""
    for name in sorted(placeholders or {}, key=len, reverse=True):
        text = re.sub(rf"\b{re.escape(name)}(?!\w)", placeholders[name], text)
    rewritten = []
    for lines in commands(text):
        whole = " ".join(lines)
        added = [flags for program, flags in BUDGETS if program.search(whole)]
        if added and SMALLER.search(whole):
            added.append(SMALL_MODEL)
        if added and " ..." in whole:
            added += [flags for given, flags in ESSENTIALS if not any(f"{flag} " in whole for flag in given)]
        if added:
            lines, appended = in_place(lines, " ".join(added))
            lines = [re.sub(r"\s\.\.\.(?=\s|$)", "", line) for line in lines]
            comment = re.search(r"\s+#\s", lines[-1])
            code, comment = (lines[-1][:comment.start()], lines[-1][comment.start():]) if comment else (lines[-1], "")
            lines[-1] = f"{code.rstrip()} {appended}{comment}" if appended else lines[-1]
        rewritten += lines
    return "\n".join(rewritten)


def in_place(lines, flags):
    """The command's lines with the values of those of `flags` it gives replaced (a flag after a `--` belongs
    to another parser), and the flags it does not give, to append."""
    appended = []
    for flag, value in FLAG_AND_VALUE.findall(flags):
        given = re.compile(rf"(?<=\s){re.escape(flag)} \S+")
        if any(given.search(line) for line in lines):
            lines = [given.sub(f"{flag} {value}", line) for line in lines]
        else:
            appended.append(f"{flag} {value}")
    return lines, " ".join(appended)


def write_my_data(home):
    """Word-level parallel text in tok/ and monolingual text in text/, as the README's commands expect; the
    same monolingual text as WikiText-103's files in wikitext-103/, and a mirror of fairseq's server in
    .mirror/ holding a stand-in of transformer_lm.wiki103.adaptive trained on it (published_mirror)."""
    mt, lm = write_corpora(os.path.join(home, "generated"), n_train=600, n_eval=8, seed=5)
    for folder in ("tok", "text", "wikitext-103"):
        os.makedirs(os.path.join(home, folder))
    for split in ("train", "valid", "test"):
        for side, lang in (("src", "en"), ("tgt", "de")):
            os.link(os.path.join(mt, f"{split}.{side}"), os.path.join(home, "tok", f"{split}.{lang}"))
        os.link(os.path.join(lm, f"{split}.txt"), os.path.join(home, "text", f"{split}.txt"))
        os.link(os.path.join(lm, f"{split}.txt"), os.path.join(home, "wikitext-103", f"wiki.{split}.tokens"))
    for name in ("fairseq_fwp", "examples", "scripts"):  # the commands run from the repository's root
        os.symlink(os.path.join(ROOT, name), os.path.join(home, name))
    return published_mirror(home, lm)


# transformer_lm_wiki103 at a tiny width, over the docs' LM text (40 types), with the docs' 512 positions
TINY_WIKI103 = ["--decoder-layers", 2, "--decoder-embed-dim", 32, "--decoder-ffn-embed-dim", 64,
                "--decoder-attention-heads", 4, "--adaptive-input-cutoff", "10,20",
                "--adaptive-softmax-cutoff", "10,20", "--tokens-per-sample", 512]


def published_mirror(home, text_dir):
    """A folder that serves --pretrained transformer_lm.wiki103.adaptive (FAIRSEQ_FWP_MIRROR): its stand-in,
    trained for 5 updates on `text_dir`'s text."""
    from examples.recipes.commands import fairseq
    from examples.recipes.published_layouts import pack, train_lm_archive

    work = os.path.join(home, ".stand-in")
    fairseq("preprocess", "--only-source", "--trainpref", os.path.join(text_dir, "train.txt"), "--validpref",
            os.path.join(text_dir, "valid.txt"), "--destdir", os.path.join(work, "bin"), "--workers", 1)
    folder = os.path.join(work, "adaptive_lm_wiki103.v2")
    train_lm_archive(folder, os.path.join(work, "bin"), os.path.join(work, "ckpt"), TINY_WIKI103, updates=5)
    mirror = os.path.join(home, ".mirror")
    os.makedirs(mirror)
    pack(folder, os.path.join(mirror, "adaptive_lm_wiki103.v2.tar.bz2"))
    return mirror


def test_a_budget_goes_where_a_user_adds_it():
    block = ("fairseq-train data-bin/x --arch fwp_transformer_wmt_en_de_big \\\n    --optimizer sgd ...   # a comment\n"
             "fairseq-generate data-bin/x --path OUT/ckpt.pt")
    got = with_budget(block, {"OUT": "ckpt"})
    train, generate = got.split("\n")[1:]
    assert train == f"    --optimizer sgd --max-update 2 --update-freq 1 {SMALL_MODEL} --max-tokens 2048   # a comment"
    assert generate == "fairseq-generate data-bin/x --path ckpt/ckpt.pt"
    assert got.startswith("fairseq-train data-bin/x --arch fwp_transformer_wmt_en_de_big \\\n")
    given = with_budget("fairseq-train data-bin/x --max-update 300 --update-freq 8 --optimizer sgd ...")
    assert given == "fairseq-train data-bin/x --max-update 2 --update-freq 1 --optimizer sgd --max-tokens 2048"
    transfer = with_budget("python -m fairseq_fwp.uptrain --out c.pt --attention-transfer-steps 100 -- data-bin/x")
    assert transfer == "python -m fairseq_fwp.uptrain --out c.pt --attention-transfer-steps 2 -- data-bin/x"


@pytest.mark.parametrize("block", [b for b in command_blocks() if b.not_run], ids=lambda b: b.name)
def test_what_the_docs_test_cannot_run_says_why(block):
    assert block.not_run in REASONS, f"{block.name}: '{block.not_run}' is none of {REASONS}"
    pytest.skip(f"{block.name} not run: {block.not_run}")


def test_every_command_block_is_tagged_and_its_placeholders_known():
    untagged = [b.name for page in PAGES for b in code_blocks(page)
                if b.lang == "" and COMMAND_START.match(b.text.lstrip())]
    assert not untagged, f"shell commands in untagged blocks (tag them bash, or text for a synopsis): {untagged}"
    unknown = {b.name: sorted(set(PLACEHOLDER.findall(code)))
               for b in command_blocks() if not b.not_run
               for code in [with_budget(b.text, PLACEHOLDERS.get(b.page)).split("#")[0]]
               if PLACEHOLDER.search(code)}
    assert not unknown, f"placeholders the docs test cannot fill (add them to PLACEHOLDERS): {unknown}"
    assert len([b for b in command_blocks() if not b.not_run]) >= 10  # the collection itself works


@pytest.mark.slow
def test_every_documented_command_runs_as_written(tmp_path, monkeypatch, own_server):
    home = str(tmp_path)
    # --pretrained NAME extracts the published archives into the test's cache: set before the test's own
    # preloaded server starts, as fairseq reads its cache folder when imported
    monkeypatch.setenv("XDG_CACHE_HOME", os.path.join(home, ".cache"))
    mirror = write_my_data(home)
    # fairseq-preprocess, -train, -generate and -eval-lm as stand-ins that run on that server (about 4 s less
    # per command; tests/test_preloaded.py holds its runs to the console scripts'); the rest, and
    # fairseq-interactive, as installed
    stand_ins = os.path.join(home, ".stand-ins")
    # --pretrained NAME reads the published archives from the mirror
    env = dict(os.environ, **preloaded.stand_ins(stand_ins), FAIRSEQ_FWP_MIRROR=mirror,
               PATH=os.pathsep.join([stand_ins, os.path.dirname(sys.executable), os.environ["PATH"]]))
    ran = []
    for block in command_blocks():
        if block.not_run:
            continue
        script = with_budget(block.text, PLACEHOLDERS.get(block.page))
        result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=home, env=env, input=STDIN,
                                capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, (f"{block.name} failed as written:\n{script}\n"
                                        f"{(result.stdout + result.stderr)[-3000:]}")
        ran.append(block.name)
    assert ran[0].startswith("README.md") and len(ran) >= 10
