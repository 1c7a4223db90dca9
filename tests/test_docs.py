"""The docs say what the code does: every flag, architecture and rule the plugin has is in
docs/flags.md, and every file, folder and module the docs name exists."""
import glob
import importlib.util
import os
import re

import pytest

from fairseq_fwp.modules.attention_options import RULES
from helpers import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")) + glob.glob(os.path.join(ROOT, "examples", "*", "README.md"))
              + [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "fairseq_fwp", "ops", "README.md")])
REPO_PATH = re.compile(r"(?<![\w./-])((?:fairseq_fwp|csrc|examples|tests|scripts|docs)/[\w./-]*[\w/])(?![\w./<-])")
MODULE = re.compile(r"python -m (fairseq_fwp[\w.]*)")
LINK = re.compile(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)")


def read(path):
    with open(path) as f:
        return f.read()


def flags_doc():
    return read(os.path.join(ROOT, "docs", "flags.md"))


def registered_options(task, arch, *flags):
    """Every option string fairseq-train accepts for this task, arch and flags."""
    from fairseq import options

    parser = options.get_training_parser()
    argv = ["/nonexistent-data", "--task", task, "--arch", arch, "--user-dir", os.path.join(ROOT, "fairseq_fwp"),
            *flags]
    options.parse_args_and_arch(parser, argv)  # adds the model's, task's and criterion's options to parser
    return {name for action in parser._actions for name in action.option_strings}


def test_every_fwp_flag_is_in_the_flags_reference():
    names = set()
    for task, arch, flags in [("translation", "fwp_transformer_tiny", ()), ("fwp_stream_lm", "fwp_lm_tiny", ()),
                              ("language_modeling", "fwp_lm_tiny",
                               ("--criterion", "fwp_distillation", "--teacher-checkpoint", "t.pt"))]:
        names |= {n for n in registered_options(task, arch, *flags)
                  if n.startswith("--fwp-") or n in ("--teacher-checkpoint", "--distillation-weight")}
    assert len(names) > 15  # the collection itself works
    missing = sorted(n for n in names if f"`{n}`" not in flags_doc())
    assert not missing, f"docs/flags.md lacks {missing}"


def test_every_architecture_is_in_the_flags_reference():
    from fairseq.models import ARCH_MODEL_REGISTRY

    parse_args("translation", "fwp_transformer_tiny")  # imports the plugin
    archs = sorted(a for a in ARCH_MODEL_REGISTRY if a.startswith("fwp_"))
    assert "fwp_transformer_wmt_en_de_big" in archs
    missing = [a for a in archs if f"`{a}`" not in flags_doc()]
    assert not missing, f"docs/flags.md lacks {missing}"


def test_every_rule_that_refuses_flags_is_in_the_flags_reference():
    text = " ".join(flags_doc().split())
    missing = [rule.why for rule in RULES if rule.why not in text]
    assert not missing, f"docs/flags.md lacks the rules {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_path_and_module_a_doc_names_exists(doc):
    text = read(doc)
    paths = set(REPO_PATH.findall(text))
    links = {os.path.normpath(os.path.join(os.path.dirname(doc), link)) for link in LINK.findall(text)}
    missing = sorted(p for p in paths if not os.path.exists(os.path.join(ROOT, p)))
    missing += sorted(os.path.relpath(p, ROOT) for p in links if not os.path.exists(p))
    missing += sorted(m for m in set(MODULE.findall(text)) if importlib.util.find_spec(m) is None)
    assert not missing, f"{os.path.relpath(doc, ROOT)} names what does not exist: {missing}"


def test_the_path_check_finds_a_missing_file(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("see `fairseq_fwp/no_such_module.py` and [it](no_such.md)")
    with pytest.raises(AssertionError, match="no_such_module.py"):
        test_every_path_and_module_a_doc_names_exists(str(doc))


ANCHORED_LINK = re.compile(r"\]\(([^)#:\s]*\.md)?#([^)\s]+)\)")  # [text](page.md#heading) or [text](#heading)
FENCED = re.compile(r"^```.*?^```", re.S | re.M)


def heading_anchors(text):
    """The anchors a markdown renderer (GitHub's) gives the page's headings: lowercase, punctuation but
    hyphens and underscores dropped, spaces as hyphens, a repeated one numbered."""
    anchors = []
    for heading in re.findall(r"^#{1,6} +(.+?) *$", FENCED.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = sum(1 for a in anchors if a == slug or re.fullmatch(rf"{re.escape(slug)}-\d+", a))
        anchors.append(f"{slug}-{count}" if count else slug)
    return set(anchors)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_link_to_a_heading_finds_it(doc):
    broken = []
    for page, anchor in ANCHORED_LINK.findall(FENCED.sub("", read(doc))):
        target = os.path.normpath(os.path.join(os.path.dirname(doc), page)) if page else doc
        if os.path.exists(target) and anchor not in heading_anchors(read(target)):
            broken.append(f"{page}#{anchor}")
    assert not broken, f"{os.path.relpath(doc, ROOT)} links to headings that do not exist: {broken}"


def test_the_heading_check_finds_a_missing_heading(tmp_path):
    (tmp_path / "page.md").write_text("# Results: the table\n## Results: the table\n```\n# not a heading\n```\n")
    doc = tmp_path / "x.md"
    doc.write_text("[a](page.md#results-the-table) [b](page.md#results-the-table-1) [c](#here)\n## Here\n")
    test_every_link_to_a_heading_finds_it(str(doc))
    doc.write_text("[a](page.md#not-a-heading)")
    with pytest.raises(AssertionError, match="page.md#not-a-heading"):
        test_every_link_to_a_heading_finds_it(str(doc))


def commands_in(text, program):
    """The `program` command lines of a markdown text's bash blocks (continuations joined, `...` and
    comments left out), as argument lists."""
    import shlex

    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = [w for w in shlex.split(line, comments=True) if w != "..."]
            if words and words[0] == program:
                commands.append(words[1:])
    return commands


def test_the_readmes_training_commands_parse():
    from fairseq import options

    commands = commands_in(read(os.path.join(ROOT, "README.md")), "fairseq-train")
    assert len(commands) >= 3
    for argv in commands:
        argv = [os.path.join(ROOT, "fairseq_fwp") if a == "fairseq_fwp" else a for a in argv]
        args = options.parse_args_and_arch(options.get_training_parser(), argv)
        assert args.arch.startswith("fwp_"), argv


# Messages a user meets, each with the file that emits it: troubleshooting.md must explain every one, in
# the words the code uses (so an entry goes stale when its message changes).
MESSAGES = [
    ("Weights only load failed", "torch/serialization.py"),
    ("Cannot load model parameters from checkpoint", "fairseq/trainer.py"),
    ("this checkpoint is a translation model (fwp_transformer), which fairseq-eval-lm cannot ",
     "fairseq_fwp/models/fwp_transformer.py"),
    ("the fast-weight model would compute differently from the softmax checkpoint beyond its ", "fairseq_fwp/uptraining/conversion.py"),
    ("was saved from another model than ", "fairseq_fwp/compat.py"),
    ("--fwp-sum-norm is deprecated", "fairseq_fwp/models/fwp_config.py"),
]


@pytest.mark.parametrize("message,source", MESSAGES, ids=[m for m, _ in MESSAGES])
def test_troubleshooting_explains_each_message_in_the_codes_words(message, source):
    if source.startswith("fairseq_fwp/"):
        path = os.path.join(ROOT, source)
    else:
        package = importlib.util.find_spec(source.split("/")[0])
        path = os.path.join(os.path.dirname(package.origin), *source.split("/")[1:])
    assert message in read(path), f"{source} no longer says {message!r}"
    troubleshooting = " ".join(read(os.path.join(ROOT, "docs", "troubleshooting.md")).split())
    assert " ".join(message.split()) in troubleshooting, f"docs/troubleshooting.md does not explain {message!r}"
