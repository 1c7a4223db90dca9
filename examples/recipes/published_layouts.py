"""Stand-ins for fairseq's published translation archives, saved as the 2018-2019 fairseq that wrote them saved.

The published models (transformer.wmt14.en-fr, transformer.wmt16.en-de, transformer.wmt19.*) are checkpoints
whose config is an argparse Namespace (``args``, no ``cfg``), some in older state-dict layouts that today's
fairseq upgrades when it loads them (``upgrade_state_dict_named``):

- ``in-proj``: every attention's query, key and value projections fused into ``in_proj_weight`` and
  ``in_proj_bias``;
- ``layer-norms``: an encoder layer's norms as ``layer_norms.0`` and ``layer_norms.1``;
- ``no-output-projection``: no ``decoder.output_projection.weight`` (the decoder reads its embeddings, or its
  own ``decoder.embed_out`` where they are not shared);
- ``args``: today's keys, the config as ``args`` only.

``write_archive`` builds a softmax Transformer of any fairseq architecture with random weights, through
``TransformerModel.build_model(args, task)`` as old fairseq did, saves it in one layout and packs it as
fairseq packs its archives: a folder with model.pt, dict.SRC.txt, dict.TGT.txt and bpecodes. model.pt is a
pickle, not a zip file: torch saved so before 1.6.

``write_lm_archive`` does the same for fairseq's published language models (transformer_lm.wiki103.adaptive:
arch transformer_lm_wiki103, adaptive input and softmax, tied; transformer_lm.wmt19.*: moses and fastBPE),
with random weights or with weights trained here (``train_lm_archive``: a few updates of fairseq-train), in
the ``args`` or ``in-proj`` layout, beside ``dict.txt`` (and ``bpecodes``); ``pack`` makes the .tar.bz2 of a
folder, one top folder inside, as fairseq's archives are.
"""
import argparse
import os
import shutil
import tarfile

import torch

LAYOUTS = ("args", "in-proj", "layer-norms", "no-output-projection")
LM_LAYOUTS = ("args", "in-proj")  # a language model has no encoder, and its output projection is today's


def write_dictionary(path, words):
    with open(path, "w") as f:
        f.writelines(f"{word} 1\n" for word in words)


def write_archive(folder, arch, layout="args", model_flags=(), source="en", target="de", words=None, seed=0,
                  record_languages=True, target_words=None):
    """A softmax model of `arch` (with `model_flags`, e.g. widths) in `layout`, packed in `folder`; the
    dictionaries hold `words` (default: w0 ... w99) on both sides, or `target_words` on the target side.
    Without `record_languages` the config says no language pair, as fairseq-train saved it when the pair
    was found from the data's file names. Returns the model's arguments (the Namespace saved as its config)."""
    from fairseq import options, tasks

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    os.makedirs(folder, exist_ok=True)
    words = words or [f"w{i}" for i in range(100)]
    write_dictionary(os.path.join(folder, f"dict.{source}.txt"), words)
    write_dictionary(os.path.join(folder, f"dict.{target}.txt"), target_words or words)
    with open(os.path.join(folder, "bpecodes"), "w") as f:
        f.write("#version: 0.2\n")
    args = options.parse_args_and_arch(options.get_training_parser(), [
        folder, "--task", "translation", "--source-lang", source, "--target-lang", target, "--arch", arch,
        *map(str, model_flags)])
    torch.manual_seed(seed)
    from fairseq.models.transformer import TransformerModel

    model = TransformerModel.build_model(args, tasks.setup_task(args))
    state = legacy_state_dict(model.state_dict(), layout, shared=model.decoder.share_input_output_embed)
    if not record_languages:
        args.source_lang = args.target_lang = None
    torch.save({"args": args, "model": state, "optimizer_history": [
        {"criterion_name": "LabelSmoothedCrossEntropyCriterion", "optimizer_name": "FairseqAdam",
         "lr_scheduler_state": {"best": None}, "num_updates": 1000}],
        "extra_state": {"train_iterator": {"epoch": 1}, "val_loss": None}, "last_optimizer_state": None},
        os.path.join(folder, "model.pt"), _use_new_zipfile_serialization=False)
    return args


def write_lm_archive(folder, arch="transformer_lm_wiki103", layout="args", model_flags=(), dictionary=None,
                     words=None, state=None, codes=None, seed=0):
    """A softmax language model of `arch` (with `model_flags`, e.g. widths, cutoffs, --tokens-per-sample) in
    `layout`, packed in `folder` beside dict.txt (a copy of `dictionary`, or `words`: default w0 ... w99) and
    bpecodes (a copy of `codes`, if given). Its weights are `state` (a trained model's state dict, which must
    fit) or random ones. Returns the model's arguments (the Namespace saved as its config)."""
    from fairseq import options, tasks
    from fairseq.models.transformer_lm import TransformerLanguageModel

    if layout not in LM_LAYOUTS:
        raise ValueError(f"a language model's layout must be one of {', '.join(LM_LAYOUTS)}; got {layout!r}")
    os.makedirs(folder, exist_ok=True)
    if dictionary:
        shutil.copy(dictionary, os.path.join(folder, "dict.txt"))
    else:
        write_dictionary(os.path.join(folder, "dict.txt"), words or [f"w{i}" for i in range(100)])
    if codes:
        shutil.copy(codes, os.path.join(folder, "bpecodes"))
    args = options.parse_args_and_arch(options.get_training_parser(), [
        folder, "--task", "language_modeling", "--arch", arch, *map(str, model_flags)])
    torch.manual_seed(seed)
    model = TransformerLanguageModel.build_model(args, tasks.setup_task(args))  # sets args.max_target_positions
    if state is not None:
        model.load_state_dict(state, strict=True)
    torch.save({"args": args, "model": legacy_state_dict(model.state_dict(), layout, shared=True),
                "optimizer_history": [{"criterion_name": "AdaptiveLoss", "optimizer_name": "FairseqNAG",
                                       "lr_scheduler_state": {"best": None}, "num_updates": 1000}],
                "extra_state": {"train_iterator": {"epoch": 1}, "val_loss": None}, "last_optimizer_state": None},
               os.path.join(folder, "model.pt.part"), _use_new_zipfile_serialization=False)
    os.replace(os.path.join(folder, "model.pt.part"), os.path.join(folder, "model.pt"))  # written whole or not at all
    return args


def train_lm_archive(folder, data_bin, save_dir, model_flags, updates=10, arch="transformer_lm_wiki103",
                     layout="args", codes=None, extra=()):
    """write_lm_archive of a model that fairseq-train trained for `updates` updates on `data_bin` (binarised
    with fairseq-preprocess --only-source) first: the weights a published model has, at a tiny size."""
    from .commands import fairseq
    from .pipeline import COMMON_TRAIN

    adaptive = "--adaptive-softmax-cutoff" in map(str, model_flags) or arch in ADAPTIVE_ARCHS
    fairseq("train", data_bin, *COMMON_TRAIN, "--task", "language_modeling", "--arch", arch, *model_flags,
            "--sample-break-mode", "none", "--max-tokens", 1024, "--lr", 0.003, "--warmup-updates", 5,
            "--max-update", updates, "--save-dir", save_dir, "--no-save-optimizer-state",
            *(["--criterion", "adaptive_loss", "--ddp-backend", "legacy_ddp"] if adaptive else []), *extra)
    state = torch.load(os.path.join(save_dir, "checkpoint_last.pt"), map_location="cpu", weights_only=False)["model"]
    return write_lm_archive(folder, arch, layout, model_flags, dictionary=os.path.join(data_bin, "dict.txt"),
                            state=state, codes=codes)


ADAPTIVE_ARCHS = ("transformer_lm_wiki103", "transformer_lm_baevski_wiki103")  # adaptive softmax by default


def pack(folder, archive, top=None):
    """`archive` (.tar.bz2, .tar.gz or .tar) of `folder`, inside one top folder (`top`, default the folder's
    name), as fairseq packs its archives; written beside it first, so that it exists only whole."""
    mode = {".bz2": "w:bz2", ".gz": "w:gz"}.get(os.path.splitext(str(archive))[1], "w")
    with tarfile.open(f"{archive}.part", mode) as tar:
        tar.add(folder, arcname=top or os.path.basename(os.path.normpath(folder)))
    os.replace(f"{archive}.part", archive)
    return archive


def legacy_state_dict(state, layout, shared):
    """Today's state dict of a fairseq Transformer in one of the older layouts."""
    state = dict(state)
    if layout == "in-proj":
        prefixes = {name[:-len("q_proj.weight")] for name in state if name.endswith("q_proj.weight")}
        for prefix in prefixes:
            for kind in ("weight", "bias"):
                parts = [state.pop(f"{prefix}{p}_proj.{kind}") for p in "qkv"]
                state[f"{prefix}in_proj_{kind}"] = torch.cat(parts)
    elif layout == "layer-norms":
        for name in [n for n in state if n.startswith("encoder.layers.")]:
            for index, norm in enumerate(("self_attn_layer_norm", "final_layer_norm")):
                if f".{norm}." in name:
                    state[name.replace(f".{norm}.", f".layer_norms.{index}.")] = state.pop(name)
    elif layout == "no-output-projection":
        projection = state.pop("decoder.output_projection.weight")
        if not shared:
            state["decoder.embed_out"] = projection
    return state


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write a stand-in of a published fairseq translation archive.")
    parser.add_argument("folder")
    parser.add_argument("--arch", default="transformer_vaswani_wmt_en_de_big")
    parser.add_argument("--layout", choices=LAYOUTS, default="args")
    parser.add_argument("model_flags", nargs=argparse.REMAINDER, help="-- then model flags (widths, layers)")
    args = parser.parse_args(argv)
    write_archive(args.folder, args.arch, args.layout, [a for a in args.model_flags if a != "--"])


if __name__ == "__main__":
    main()
