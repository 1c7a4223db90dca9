"""Inputs and outputs of one layer of a trained checkpoint, on held-out data or on a query text."""
import os

import numpy as np
import torch

from fairseq_fwp.dual_form.recorder import TIME_FIRST


def load_checkpoint(path, data=None):
    """(model in eval mode, task, number of updates the checkpoint has seen)."""
    import fairseq_fwp  # noqa: F401  registers the plugin's models and the dual_form task
    from fairseq import checkpoint_utils

    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    overrides = {"data": data} if data else None
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides=overrides)
    state = checkpoint_utils.load_checkpoint_to_cpu(path)
    num_updates = state["optimizer_history"][-1]["num_updates"]
    model = models[0].float().eval()
    return model, task, num_updates


def layer_rows(model, layer, layout, src_tokens, pad):
    """(inputs [n, d_in], outputs [n, d_out]) of `layer` at the non-padding positions, batch-major order."""
    captured = []
    handle = model.get_submodule(layer).register_forward_hook(
        lambda module, inputs, output: captured.append((inputs[0], output)))
    try:
        with torch.no_grad():
            model(src_tokens)
    finally:
        handle.remove()
    (x, y), = captured
    if layout == TIME_FIRST:
        x, y = x.transpose(0, 1), y.transpose(0, 1)
    mask = src_tokens.ne(pad)
    return x[mask].double().numpy(), y[mask].double().numpy()


def held_out_rows(model, task, layer, layout, subset, max_rows, max_tokens=2048):
    """Layer inputs and outputs on the first `max_rows` tokens of `subset`, in dataset order."""
    if subset not in task.datasets:
        task.load_dataset(subset)
    batches = task.get_batch_iterator(dataset=task.dataset(subset), max_tokens=max_tokens,
                                      ignore_invalid_inputs=True).next_epoch_itr(shuffle=False)
    inputs, outputs, n = [], [], 0
    for sample in batches:
        x, y = layer_rows(model, layer, layout, sample["net_input"]["src_tokens"], task.source_dictionary.pad())
        inputs.append(x)
        outputs.append(y)
        n += len(x)
        if n >= max_rows:
            break
    return np.concatenate(inputs)[:max_rows], np.concatenate(outputs)[:max_rows]


def query_input(model, task, layer, layout, words, max_positions):
    """Layer input at the last of `words`, read after fairseq's leading eos (as at the start of training)."""
    dictionary = task.source_dictionary
    words = words[-(max_positions - 1):]  # the model's context limit; the last word is the query position
    ids = [dictionary.index(w) for w in words]
    src_tokens = torch.tensor([[dictionary.eos()] + ids], dtype=torch.long)
    x, _ = layer_rows(model, layer, layout, src_tokens, dictionary.pad())
    unknown = [w for w, i in zip(words, ids) if i == dictionary.unk() and w != dictionary[dictionary.unk()]]
    return x[-1], words, unknown
