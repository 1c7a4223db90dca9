"""Writes old_checkpoints.tar.xz: tiny models saved by older checkouts of the plugin, each with the outputs
it computed on fixed inputs, for tests/test_old_checkpoints.py.

    git worktree add /tmp/sum-norm-era 1debf95   # the last commit where --fwp-sum-norm was a flag of its own
    git worktree add /tmp/qk-norm-era 0c5e9c0    # --fwp-qk-norm none, and the delta rules' keys normalised under it
    .venv/bin/python tests/data/write_old_checkpoints.py sum-norm=/tmp/sum-norm-era qk-norm=/tmp/qk-norm-era

Each era runs in a process of its own (both checkouts are the package fairseq_fwp). Every combination the
flags' meanings touch is tried: --fwp-sum-norm on/off (the first era) x --fwp-qk-norm sum/l2 (none in the
second era) x the four update rules x linear and silu features, for translation (every site) and, for a
subset, the language model; and, in the second era, an LM given NormFormer's --scale-* options, for which
fairseq-train then built no modules. What an era's code refused is recorded as refused, with its message.
"""
import argparse
import itertools
import json
import os
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
RULES = ("sum", "delta", "gated-sum", "gated-delta")
TRANSLATION = ["--task", "translation", "--arch", "fwp_transformer_tiny", "--source-lang", "en", "--target-lang",
               "de", "--share-all-embeddings", "--encoder-layers", "1", "--decoder-layers", "1",
               "--encoder-embed-dim", "8", "--decoder-embed-dim", "8", "--encoder-ffn-embed-dim", "16",
               "--decoder-ffn-embed-dim", "16", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
LM = ["--task", "language_modeling", "--arch", "fwp_lm_tiny", "--decoder-layers", "1", "--decoder-embed-dim", "8",
      "--decoder-ffn-embed-dim", "16", "--decoder-attention-heads", "2", "--tokens-per-sample", "16"]
WORDS = 10


def combinations(era):
    """(name, model flags, --fwp-* flags) of every combination an era is asked for."""
    sum_norms = ("on", "off") if era == "sum-norm" else (None,)
    qk_norms = ("sum", "l2") if era == "sum-norm" else ("sum", "l2", "none")
    for model, base in (("mt", TRANSLATION), ("lm", LM)):
        for sum_norm, qk, rule, fm in itertools.product(sum_norms, qk_norms, RULES, ("linear", "silu")):
            if model == "lm" and (fm == "silu" or rule == "gated-sum"):
                continue  # the LM's one site is the decoder's, which the translation models cover too
            flags = ["--fwp-qk-norm", qk, "--fwp-update-rule", rule, "--fwp-feature-map", fm]
            flags += ["--fwp-sum-norm", sum_norm] if sum_norm else []
            flags += ["--fwp-attn-norm", "off"] if fm == "silu" else []  # signed features: never on
            name = "-".join([era, model, f"sumnorm{sum_norm}" if sum_norm else "", f"qk{qk}", rule, fm]).replace("--", "-")
            yield name, base, flags
    if era == "qk-norm":  # NormFormer's options, which fairseq-train then dropped (no modules were built)
        yield f"{era}-lm-normformer", LM, ["--scale-attn", "--scale-fc", "--scale-heads", "--scale-resids"]


def write_era(era, checkout, folder):
    """In this process: the plugin of `checkout`; writes folder/NAME.pt and returns the manifest's entries."""
    sys.path.insert(0, checkout)
    import torch
    from fairseq import options, tasks
    from fairseq.data import Dictionary
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    d = Dictionary()
    for i in range(WORDS):
        d.add_symbol(f"w{i}")
    for name in ("dict.en.txt", "dict.de.txt", "dict.txt"):
        d.save(os.path.join(folder, name))
    src = torch.tensor([[4, 5, 6, 7, 2], [1, 1, 8, 9, 2]])  # left-padded sources, as fairseq batches them
    prev = torch.tensor([[2, 10, 11, 12, 13, 4], [2, 7, 6, 5, 4, 12]])
    entries = []
    for index, (name, base, flags) in enumerate(combinations(era)):
        argv = [folder, "--user-dir", os.path.join(checkout, "fairseq_fwp"), "--dropout", "0", *base, *flags]
        entry = {"name": name, "era": era, "flags": flags, "arch": base[base.index("--arch") + 1]}
        try:
            args = options.parse_args_and_arch(options.get_training_parser(), argv)
            cfg = convert_namespace_to_omegaconf(args)
            task = tasks.setup_task(cfg.task)
            torch.manual_seed(index)
            model = task.build_model(cfg.model).eval()
        except Exception as err:  # what the era's code refused
            entry["refused"] = f"{type(err).__name__}: {err}"
            entries.append(entry)
            continue
        import fairseq_fwp
        assert fairseq_fwp.__file__.startswith(checkout), fairseq_fwp.__file__
        with torch.no_grad():
            if entry["arch"] == "fwp_lm_tiny":
                out = model(prev)[0]
            else:
                out = model(src, torch.tensor([5, 3]), prev)[0]
        config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        config["common"]["user_dir"] = None  # where the old checkout was: whoever loads it gives --user-dir
        torch.save({"args": None, "cfg": config,
                    "model": model.state_dict(), "criterion": None,
                    "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "FairseqAdam",
                                           "lr_scheduler_state": {}, "num_updates": 0}],
                    "task_state": {}, "extra_state": {"previous_training_time": 0},
                    "outputs": {"src_tokens": src, "src_lengths": torch.tensor([5, 3]), "prev_output_tokens": prev,
                                "logits": out}},
                   os.path.join(folder, f"{name}.pt"))
        entries.append(entry)
    return entries


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("eras", nargs="+", help="ERA=CHECKOUT, ERA one of sum-norm, qk-norm")
    parser.add_argument("--out", default=os.path.join(HERE, "old_checkpoints.tar.xz"))
    parser.add_argument("--one-era", nargs=3, metavar=("ERA", "CHECKOUT", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_era:
        era, checkout, folder = args.one_era
        with open(os.path.join(folder, f"{era}.json"), "w") as f:
            json.dump(write_era(era, os.path.abspath(checkout), folder), f, indent=1)
        return
    with tempfile.TemporaryDirectory() as folder:
        manifest = []
        for spec in args.eras:
            era, checkout = spec.split("=", 1)
            # not from the repository's folder: the child must import the old checkout's plugin
            subprocess.run([sys.executable, os.path.abspath(__file__), "x", "--one-era", era, checkout, folder],
                           check=True, cwd=tempfile.gettempdir())
            manifest += json.load(open(os.path.join(folder, f"{era}.json")))
            os.remove(os.path.join(folder, f"{era}.json"))
        with open(os.path.join(folder, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
        with tarfile.open(args.out, "w:xz", preset=9) as tar:
            for name in sorted(os.listdir(folder)):
                tar.add(os.path.join(folder, name), arcname=name)
    kept = [e for e in manifest if "refused" not in e]
    print(f"{args.out}: {len(kept)} checkpoints, {len(manifest) - len(kept)} combinations refused by their era, "
          f"{os.path.getsize(args.out) // 1024} KiB")


if __name__ == "__main__":
    main()
