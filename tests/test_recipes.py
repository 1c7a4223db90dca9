"""The paper's recipes end to end on small local files: prepare -> train -> evaluate, as a user runs them."""
import json
import os
import random
import subprocess
import sys
import tarfile
import zipfile

import pytest

pytest.importorskip("fairseq")

from helpers import ROOT, parse_args  # noqa: E402
from examples.recipes import rows, text  # noqa: E402
from examples.recipes.commands import python  # noqa: E402
from examples.recipes.small_real_data import split_at_article_boundary  # noqa: E402
from examples.recipes.synthetic_data import lm_sentence, translation_pairs  # noqa: E402


def recipe(module, *args):
    """python -m examples.recipes.<module> ARGS; returns stdout, fails the test with the tail."""
    proc = python("-m", f"examples.recipes.{module}", *args, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def natural_pairs(n, rng):
    """Synthetic pairs dressed as text: capitals, hyphens and punctuation for the Moses tokeniser."""
    for src, tgt in translation_pairs(n, rng):
        yield f"{src.capitalize()}-{src.split()[-1]}, {src}.", f"{tgt.capitalize()}-{tgt.split()[-1]}, {tgt}."


def write_wmt14_layout(raw, rng):
    """The WMT14 file names, with newstest2014 as .sgm inside a .tgz, like the real downloads."""
    def write_pair(path_stem, n):
        pairs = list(natural_pairs(n, rng))
        os.makedirs(os.path.dirname(path_stem), exist_ok=True)
        text.write_lines(path_stem + ".en", [s for s, _ in pairs])
        text.write_lines(path_stem + ".de", [t for _, t in pairs])
        return pairs

    write_pair(str(raw / "training" / "europarl-v7.de-en"), 150)
    write_pair(str(raw / "commoncrawl.de-en"), 100)
    write_pair(str(raw / "training" / "news-commentary-v9.de-en"), 100)
    write_pair(str(raw / "dev" / "newstest2013"), 30)
    test = list(natural_pairs(21, rng))
    os.makedirs(raw / "test-full")
    for side, name in ((0, "newstest2014-deen-src.en.sgm"), (1, "newstest2014-deen-ref.de.sgm")):
        segs = "\n".join(f'<seg id="{i + 1}">{pair[side]}</seg>' for i, pair in enumerate(test))
        (raw / "test-full" / name).write_text(f'<srcset setid="newstest2014">\n<doc docid="x">\n{segs}\n</doc>\n</srcset>\n')
    with tarfile.open(raw / "test-full.tgz", "w:gz") as archive:
        archive.add(raw / "test-full", arcname="test-full")
    for name in os.listdir(raw / "test-full"):
        os.remove(raw / "test-full" / name)
    os.rmdir(raw / "test-full")
    return test


@pytest.mark.slow
def test_wmt14_recipe_prepares_trains_and_scores_every_test_sentence(tmp_path):
    test = write_wmt14_layout(tmp_path / "raw", random.Random(0))
    out = recipe("wmt14", "prepare", "--raw-dir", tmp_path / "raw", "--out", tmp_path / "data",
                 "--bpe-merges", 60, "--workers", 1)
    assert "fairseq-preprocess" in out and "--joined-dictionary" in out
    assert text.read_lines(tmp_path / "data" / "raw" / "test.de") == [t for _, t in test]  # raw refs kept
    assert "@-@" in text.read_lines(tmp_path / "data" / "tok" / "train.en")[0]  # aggressive hyphen splitting

    out = recipe("wmt14", "train", "--data", tmp_path / "data", "--row", "dpfp-256", "--save-dir", tmp_path / "ckpt",
                 "--arch", "fwp_transformer_tiny", "--gpus", 48, "--", "--max-update", 3, "--max-tokens", 1000)
    assert "--fwp-dpfp-nu 2" in out and "--update-freq 1" in out and "--label-smoothing 0.1" in out
    log = (tmp_path / "ckpt" / "train.log").read_text()
    assert "num_updates 3" in log and "| bleu " in log  # validation BLEU picks the best checkpoint

    scores = json.loads(recipe("wmt14", "evaluate", "--data", tmp_path / "data", "--row", "dpfp-256",
                               "--checkpoint", tmp_path / "ckpt" / "checkpoint_best.pt", "--", "--batch-size", 8,
                               "--max-len-b", 30)
                        .split("\n", 1)[1])
    assert scores["sentences"] == len(test)
    assert 0 <= scores["sacrebleu"] <= 100 and 0 <= scores["tokenized_bleu"] <= 100
    assert scores["sacrebleu_signature"].startswith("BLEU = ") and scores["paper_bleu"] == 26.9
    assert len(text.read_lines(tmp_path / "ckpt" / "checkpoint_best.test.hyp.detok")) == len(test)


def write_wikitext_zip(folder, rng):
    """wiki.{train,valid,test}.tokens in WikiText's layout (titles, blank lines), zipped as downloaded."""
    def article(n):
        return [" = Title = ", ""] + [" " + lm_sentence(rng) + " " for _ in range(n)] + [""]

    os.makedirs(folder)
    with zipfile.ZipFile(folder / "wikitext-103-v1.zip", "w") as archive:
        for split, n in (("train", 60), ("valid", 8), ("test", 8)):
            lines = [line for _ in range(4) for line in article(n)]
            archive.writestr(f"wikitext-103/wiki.{split}.tokens", "\n".join(lines) + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("table, row", [("table2", "delta"), ("table4", "delta-carry")])
def test_wikitext103_recipe_prepares_trains_and_evaluates(tmp_path, table, row):
    write_wikitext_zip(tmp_path / "raw", random.Random(1))
    recipe("wikitext103", "prepare", "--raw-dir", tmp_path / "raw", "--out", tmp_path / "data", "--workers", 1)
    tiny = ["--", "--arch", "fwp_lm_tiny", "--criterion", "cross_entropy", "--max-update", 2]
    size = "medium" if table == "table4" else "small"
    out = recipe("wikitext103", "train", "--data", tmp_path / "data", "--table", table, "--row", row, "--size", size,
                 "--save-dir", tmp_path / "ckpt", *tiny)
    task = "fwp_stream_lm" if table == "table4" else "language_modeling"
    assert f"--task {task}" in out and "--lr 0.00025" in out and "--warmup-updates 2000" in out

    result = json.loads(recipe("wikitext103", "evaluate", "--data", tmp_path / "data", "--table", table,
                               "--row", row, "--size", size, "--checkpoint", tmp_path / "ckpt" / "checkpoint_last.pt")
                        .split("\n", 1)[1])
    test_tokens = sum(len(line.split()) + 1 for line in text.read_lines(tmp_path / "raw" / "wikitext-103" /
                                                                          "wiki.test.tokens"))
    assert result["tokens"] == test_tokens  # every token once, in either protocol
    assert result["perplexity"] > 1 and result["paper_test_perplexity"] == rows.WIKITEXT103[table, row].paper[size]


@pytest.mark.slow
def test_the_context_recipe_uptrains_a_stand_in_and_scores_three_models_past_its_positions(tmp_path):
    """wikitext2_context at a tiny budget: the original (64 positions) scored only where it can read, the
    converted and the from-scratch fast-weight LMs at every context."""
    rng = random.Random(2)
    os.makedirs(tmp_path / "data" / "wikitext-2")
    for split, articles in (("valid", 12), ("test", 8)):
        lines = [line for _ in range(articles) for line in [" = Title = ", ""] + [
            " " + lm_sentence(rng) + " " for _ in range(8)] + [""]]
        text.write_lines(tmp_path / "data" / "wikitext-2" / f"{split}.txt", lines)
    from examples.recipes import wikitext2_context

    wikitext2_context.main([str(a) for a in (
        "--data-dir", tmp_path / "data", "--out", tmp_path / "out", "--positions", 64, "--cutoffs", "10,20",
        "--original-updates", 3, "--finetune-updates", 2, "--contexts", 64, 256, "--segment", 32, "--stride", 32)])
    results = json.loads((tmp_path / "out" / "context" / "context.json").read_text())["models"]
    assert [results["original"][p]["256"] for p in ("carried", "sliding")] == [None, None]
    assert all(results[model][p][c]["perplexity"] > 1 for model in ("original", "converted", "scratch")
               for p in ("carried", "sliding") for c in ("64", "256") if model != "original" or c == "64")
    logs = {name: (tmp_path / "out" / f"{name}.log").read_text() for name in ("finetuned", "scratch")}
    assert "num_updates 2 " in logs["finetuned"] or "num_updates=2" in logs["finetuned"]
    assert "finetune_from_model" in logs["finetuned"] and "'finetune_from_model': None" in logs["scratch"]


def test_the_wikitext103_training_flags_build_their_adaptive_loss(tmp_path):
    """The wiki103 archs' adaptive softmax trains with adaptive_loss, which fairseq builds only with its own DDP
    (legacy_ddp): the recipe's flags must say so, or fairseq-train stops before its first update."""
    from fairseq import tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from examples.recipes import wikitext103

    (tmp_path / "dict.txt").write_text("".join(f"w{i} 1\n" for i in range(100)))
    args = parse_args("language_modeling", "fwp_lm_wiki103_small", *map(str, wikitext103.HYPERPARAMETERS))
    args.data = str(tmp_path)
    cfg = convert_namespace_to_omegaconf(args)
    criterion = tasks.setup_task(cfg.task).build_criterion(cfg.criterion)
    assert type(criterion).__name__ == "AdaptiveLoss"


def test_every_lm_row_parses_with_its_arch():
    for (table, name), row in rows.WIKITEXT103.items():
        for size in row.paper:
            args = parse_args(row.task, f"fwp_lm_wiki103_{size}", *row.flags_for(size))
            if "performer" in name and table == "table2":
                assert args.fwp_performer_features == rows.PERFORMER_M[size]


def test_every_translation_row_parses_with_the_big_arch():
    for name, row in rows.WMT14.items():
        args = parse_args("translation", "fwp_transformer_wmt_en_de_big", *row.flags)
        feature_size = {"softmax": 64, "linear": 64, "performer": 2 * args.fwp_performer_features,
                        "dpfp": 2 * 64 * args.fwp_dpfp_nu}[args.fwp_feature_map]
        assert name == "standard" or name == "linear" or name.endswith(str(feature_size))


@pytest.mark.slow
def test_bad_rows_fail_clearly():
    with pytest.raises(ValueError, match="table3 is reported for medium"):
        rows.wikitext103_row("table3", "nopos-noattnnorm", "small")
    with pytest.raises(ValueError, match="table2 rows are transformer, linear-sum"):
        rows.wikitext103_row("table2", "dpfp", "small")
    proc = python("-m", "examples.recipes.wmt14", "train", "--data", "x", "--row", "dpfp-999", "--save-dir", "y",
                  cwd=ROOT)
    assert proc.returncode == 2 and "--row: invalid choice: 'dpfp-999'" in proc.stderr


def test_wikitext2_split_falls_on_an_article_boundary():
    lines = [" = A = ", " a ."] * 3 + [" = B = ", " b ."] * 3
    first, second = split_at_article_boundary(lines, 0.5)
    assert first + second == lines and second[0] == " = B = "


def test_training_progress_prints_updates_and_the_time_left(capsys, monkeypatch):
    from examples.recipes import commands

    clock = iter([0.0, 0.0, 10.0, 50.0, 60.0, 100.0])
    monkeypatch.setattr(commands.time, "time", lambda: next(clock))
    progress = commands.TrainingProgress.for_arguments(["fairseq-train", "data", "--max-update", "100"])
    for line in ["epoch 001: 1 / 9 loss=5.0, num_updates=1, lr=1e-4",   # t = 0: the first update seen
                 "epoch 001: 2 / 9 loss=4.9, num_updates=11, lr=1e-4",  # t = 10: too soon to print
                 "epoch 001 | loss 4.0 | num_updates 41",               # t = 50: 40 updates in 50 s
                 "no update here",
                 "epoch 002: 3 / 9 loss=3.9, num_updates=51",           # t = 60: too soon
                 "epoch 003 | loss 3.0 | num_updates 100"]:              # t = 100: the last one
        progress.see(line)
    assert capsys.readouterr().out.splitlines() == [
        "  update 41 / 100, 0:50 elapsed, ~1:13 left",
        "  update 100 / 100, 1:40 elapsed, ~0:00 left"]
    assert commands.TrainingProgress.for_arguments(["fairseq-train", "data"]) is None


def test_every_small_real_data_row_parses_and_uptrained_rows_name_a_trained_row():
    from examples.recipes import small_real_data as recipe

    for table, arch, model in ((rows.MULTI30K, "fwp_transformer_tiny", recipe.MULTI30K_MODEL),
                               (rows.WIKITEXT2, "fwp_lm_tiny", recipe.WIKITEXT2_MODEL)):
        for name, row in table.items():
            if row.uptraining is not None:
                source = row.uptraining.source
                assert source in table and table[source].uptraining is None
            parse_args(row.task, arch, *model, *row.flags)  # exits on a bad flag


def test_the_small_corpora_download_from_their_source_into_the_data_folder(tmp_path):
    """The download step, from a local copy (file://) as from the public source: every file the recipe
    reads, into --data-dir, and the recipe then finds them; without them it says how to get them."""
    from examples.recipes import small_real_data as recipe

    for corpus, (folder, _, names) in recipe.SOURCES.items():
        source = tmp_path / "mirror" / corpus
        source.mkdir(parents=True)
        for name in names:
            (source / name).write_bytes(name.encode())
        with pytest.raises(FileNotFoundError, match=f"lacks .*add --download"):
            recipe.corpus_folder(corpus, str(tmp_path / "data"))
        recipe.download(corpus, str(tmp_path / "data"), source.as_uri() + "/")
        found = recipe.corpus_folder(corpus, str(tmp_path / "data"))
        assert sorted(os.listdir(found)) == sorted(names)
        assert all((tmp_path / "data" / folder / name).read_bytes() == name.encode() for name in names)


def test_training_words_per_second_weights_each_epoch_by_its_time():
    from examples.recipes.pipeline import train_words_per_second

    log = "\n".join([
        "x | INFO | train | epoch 001 | loss 9 | wps 1000 | ups 1 | wpb 1000 | num_updates 100 | train_wall 100 | wall 101",
        "x | INFO | valid | epoch 001 | valid on 'valid' subset | loss 8 | wps 5000",
        "x | INFO | train | epoch 002 | loss 8 | wps 1200 | ups 1 | wpb 1000 | num_updates 200 | train_wall 100 | wall 202",
        "x | INFO | train | epoch 003 | loss 8 | wps 60 | ups 1 | wpb 1000 | num_updates 202 | train_wall 0 | wall 203"])
    assert train_words_per_second(log) == 1100  # the 2-update epoch of 0 s does not pull it down
    assert train_words_per_second("no summary line") is None


def test_results_of_runs_side_by_side_are_all_kept(tmp_path):
    from examples.recipes.small_real_data import save_result

    path = str(tmp_path / "results.json")
    save_result(path, "softmax", {"bleu": 28.9})
    save_result(path, "linear", {"bleu": 26.4})  # another run, which read the file before softmax was written
    save_result(path, "softmax", {"bleu": 29.0})  # a row evaluated again
    assert json.load(open(path)) == {"softmax": {"bleu": 29.0}, "linear": {"bleu": 26.4}}
    assert os.listdir(tmp_path) == ["results.json"]  # no temporary file left behind


def test_the_convergence_measure_reads_the_best_validation_loss_before_and_within_the_window():
    from examples.recipes.pipeline import improvement, validation_losses

    line = "x | INFO | valid | epoch 00{e} | valid on 'valid' subset | loss {loss} | ppl 2 | num_updates {u}{best}"
    losses = [(100, 3.0), (200, 2.0), (300, 2.5), (400, 1.9), (500, 1.95)]
    log = "\n".join(line.format(e=i, loss=loss, u=u, best=" | best_loss 1" if i else "")
                    for i, (u, loss) in enumerate(losses))
    log += "\nx | INFO | train | epoch 005 | loss 1.8 | wps 100 | num_updates 500 | train_wall 3"
    assert validation_losses(log) == losses
    assert improvement(log, 200) == pytest.approx((2.0 - 1.9) / 2.0)  # best up to update 300 against best overall
    assert improvement(log, 500) is None and improvement("no validation", 100) is None


def prepare_synthetic(out, delay=0.0):
    """The translation recipe's preparation of a small synthetic corpus into `out` (a child process's job)."""
    import time

    from examples.recipes import translation
    from test_raw_text import corpus_pairs

    time.sleep(delay)
    translation.prepare(corpus_pairs(out.parent / f"pairs-{os.getpid()}", 400), "src", "tgt", str(out), merges=40)


@pytest.mark.slow
def test_two_preparations_of_one_folder_started_together_give_one_whole_corpus(tmp_path):
    """Two recipe runs on one --out prepare at the same time: one prepares, the other waits and finds the
    corpus done; the corpus equals one prepared alone, and no staging folder is left."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    runs = [context.Process(target=prepare_synthetic, args=(tmp_path / "shared", delay)) for delay in (0.0, 0.5)]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    assert [run.exitcode for run in runs] == [0, 0]
    prepare_synthetic(tmp_path / "alone")
    for name in ("dict.src.txt", "train.src-tgt.src.bin", "test.src-tgt.tgt.idx"):
        assert (tmp_path / "shared" / "bin" / name).read_bytes() == (tmp_path / "alone" / "bin" / name).read_bytes()
    assert sorted(os.listdir(tmp_path / "shared")) == [".prepare.lock", "PREPARED", "bin", "bpe", "raw", "tok"]


PREPARE_AFTER_THE_LOCK = """
import sys
from examples.recipes import prepared
with prepared.preparing(sys.argv[1]) as staging:
    print("staging", staging, flush=True)
"""


def test_a_run_that_waits_for_another_preparation_says_so(tmp_path):
    import fcntl
    import subprocess

    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".prepare.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run prepares
        waiting = subprocess.Popen([sys.executable, "-c", PREPARE_AFTER_THE_LOCK, str(out)], cwd=ROOT,
                                   stdout=subprocess.PIPE, text=True)
        assert waiting.stdout.readline().startswith(f"waiting for another run that prepares {out}")
    # the other run has finished (its lock released): this one goes on
    assert waiting.stdout.readline().startswith("staging ") and waiting.wait(timeout=60) == 0


def test_a_preparation_stages_in_a_folder_of_its_own_and_clears_only_its_hosts_stale_ones(tmp_path):
    import socket

    from examples.recipes import prepared

    out = tmp_path / "out"
    other_host = out / ".staging-another-host-123"  # on a file system whose locks are local to each host
    (other_host / "bin").mkdir(parents=True)
    stale = out / f".staging-{socket.gethostname()}-999999999"  # this host's, its process gone
    stale.mkdir()
    with prepared.preparing(str(out)) as staging:
        assert staging == str(out / f".staging-{socket.gethostname()}-{os.getpid()}")
        (out.joinpath(staging) / "bin").mkdir()
    assert (other_host / "bin").is_dir() and not stale.exists() and (out / "bin").is_dir()


def test_a_corpus_bped_with_incomplete_codes_stops_the_preparation(tmp_path, monkeypatch):
    """Codes read while another run still wrote them split the text into characters: refused."""
    from examples.recipes import bpe

    apply = bpe.apply

    def apply_the_first_lines(tool, codes_path, lines):
        truncated = f"{codes_path}.partial"
        text.write_lines(truncated, text.read_lines(codes_path)[:3])
        return apply(tool, truncated, lines)

    monkeypatch.setattr(bpe, "apply", apply_the_first_lines)
    with pytest.raises(RuntimeError, match=r"holds \d+ subword types, but its codes make 40 merges"):
        prepare_synthetic(tmp_path / "out")
    assert not os.path.exists(tmp_path / "out" / "PREPARED")
