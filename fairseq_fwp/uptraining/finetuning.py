"""The fairseq-train command that finetunes a model folder that --pretrained wrote: the model's flags
(model.args) with the finetuning recipe of its task."""
import os
import shlex

# The plugin's folder in this process, which the printed command names as its --user-dir: model.args names
# none, so that the folder finetunes wherever the plugin lives.
PLUGIN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def finetune_command(out, data, model_args):
    """The fairseq-train command that finetunes a conversion of --pretrained at `out` with this process's plugin
    (PLUGIN_DIR), its model's flags (`model_args`, what model.args holds) inline, with the finetuning recipe of
    its task (FINETUNE_RECIPES); more flags may follow it."""
    task = model_args[model_args.index("--task") + 1]
    recipe = FINETUNE_RECIPES[task] + (ADAPTIVE_LOSS if "--adaptive-softmax-cutoff" in model_args else [])
    if task == "language_modeling" and "--max-target-positions" in model_args:  # segments within its positions
        positions = int(model_args[model_args.index("--max-target-positions") + 1])
        segment = recipe.index("--tokens-per-sample") + 1
        recipe[segment] = str(min(int(recipe[segment]), positions))
    return shlex.join(["fairseq-train", data or "DATA", "--user-dir", PLUGIN_DIR, *model_args, "--finetune-from-model",
                       os.path.join(out, "model.pt"), *recipe, "--save-dir", os.path.join(out, "finetuned")])


# Finetuning after --pretrained, with warmup anew. Translation as the published models were trained (Ott et
# al., 2018). A language model on fwp_stream_lm: 6 streams of 512-token segments (the 3,072 tokens per batch
# of Baevski and Auli's WikiText-103 model; shorter where its positions are fewer) with the fast weights
# carried from one segment to the next (the paper's Table 4), Adam at a tenth of a from-scratch rate.
FINETUNE_RECIPES = {
    "translation": ["--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--optimizer", "adam",
                    "--adam-betas", "(0.9,0.98)", "--lr", "0.0005", "--lr-scheduler", "inverse_sqrt",
                    "--warmup-updates", "1000", "--max-tokens", "3584"],
    "language_modeling": ["--task", "fwp_stream_lm", "--tokens-per-sample", "512", "--batch-size", "6",
                          "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--clip-norm", "0.1", "--lr", "0.0001",
                          "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "1000"],
}
# An adaptive softmax (the WikiText-103 model's) trains with its own loss, which needs fairseq's own DDP.
ADAPTIVE_LOSS = ["--criterion", "adaptive_loss", "--ddp-backend", "legacy_ddp"]
