"""Attention transfer: before finetuning, each fast-weight attention of a converted model learns to
reproduce the softmax attention it replaces (the first stage of LoLCATs, Zhang et al. 2024, after
Hedgehog's attention distillation, Zhang et al. ICLR 2024).

The softmax model (the teacher) reads training batches unchanged, in eval mode. A hook on each of its
attention modules hands that module's inputs to the fast-weight attention of the same name in the
converted model (the student), and the student's loss is its squared error against the teacher's output
relative to the teacher output's mean square, over unpadded query positions, summed over the layers.
Only the students' attention parameters train, each layer on the teacher's own inputs: the layers learn
independently, and no gradient passes through the rest of either model (a step costs a teacher forward
and the attentions' backward: about half a training update on Multi30k). The student model's own forward
never runs, so FAVOR+ features stay as drawn throughout.
"""
import itertools
import logging

import torch
from fairseq.modules import MultiheadAttention

from ..modules.fast_weight_attention import FastWeightAttention

logger = logging.getLogger(__name__)
DEFAULT_LR = 3e-3  # Adam's; on Multi30k, 100 steps at 3e-3 left a lower error than at 1e-3 (docs/results.md)


def attention_pairs(teacher, student):
    """[(name, softmax attention, fast-weight attention)] for every attention the student replaced."""
    students = dict(student.named_modules())
    pairs = [(name, module, students[name]) for name, module in teacher.named_modules()
             if isinstance(module, MultiheadAttention) and isinstance(students.get(name), FastWeightAttention)]
    carried = [name for name, _, attention in pairs if attention.streams is not None]
    if carried:
        raise ValueError(f"attention transfer trains on independent segments, but {carried[0]} carries its state "
                         "across them: convert with --task language_modeling, finetune with fwp_stream_lm")
    return pairs


def relative_error(student_out, teacher_out, keep):
    """sum |s - t|^2 / sum |t|^2 over the positions where keep ``[T, B, 1]`` is 1."""
    return ((student_out - teacher_out).pow(2) * keep).sum() / ((teacher_out.pow(2) * keep).sum() + 1e-12)


def query_padding(name, net_input, padding_idx):
    """[T, B, 1] weights of the query positions an attention named `name` sees: 0 at padding."""
    if name.startswith("encoder."):
        tokens = net_input["src_tokens"]
    else:  # a translation decoder reads prev_output_tokens, a language model src_tokens
        tokens = net_input.get("prev_output_tokens", net_input["src_tokens"])
    return tokens.ne(padding_idx).t().unsqueeze(-1).float()


class AttentionTransfer:
    """Trains the fast-weight attentions of `student` on the softmax attentions of `teacher`."""

    def __init__(self, teacher, student, padding_idx, lr=DEFAULT_LR):
        self.teacher, self.student, self.padding_idx = teacher, student, padding_idx
        self.pairs = attention_pairs(teacher, student)
        if not self.pairs:
            raise ValueError("the converted model has no fast-weight attention in place of a softmax one")
        self.parameters = [p for _, _, attention in self.pairs for p in attention.parameters()]
        self.optimizer = torch.optim.Adam(self.parameters, lr=lr, betas=(0.9, 0.98))

    def step(self, net_input):
        """One update on one batch; returns {attention name: its relative error before the update}."""
        errors = {}

        def compare(name, student_attention):
            def hook(_module, args, kwargs, output):
                with torch.enable_grad():
                    student_out, _ = student_attention(*args, **kwargs)
                    errors[name] = relative_error(student_out, output[0],
                                                  query_padding(name, net_input, self.padding_idx))
            return hook

        handles = [teacher_attention.register_forward_hook(compare(name, attention), with_kwargs=True)
                   for name, teacher_attention, attention in self.pairs]
        try:
            with torch.no_grad():
                self.teacher(**net_input)
        finally:
            for handle in handles:
                handle.remove()
        self.optimizer.zero_grad(set_to_none=True)
        sum(errors.values()).backward()
        self.optimizer.step()
        return {name: error.item() for name, error in errors.items()}

    def run(self, batches, steps, log_interval=50):
        """`steps` updates, one batch each; returns the relative error of every attention on the first
        batch (before any update) and its mean over the last `log_interval` steps."""
        self.teacher.eval()
        self.student.train()
        history = []
        for number, sample in enumerate(itertools.islice(batches, steps), 1):
            history.append(self.step(sample["net_input"]))
            if number % log_interval == 0 or number == steps:
                recent = mean_errors(history[-log_interval:])
                logger.info(f"attention transfer {number}/{steps}: relative error {overall(recent):.3f} ("
                            + ", ".join(f"{name} {error:.3f}" for name, error in recent.items()) + ")")
        first, last = history[0], mean_errors(history[-log_interval:])
        logger.info(f"attention transfer: relative error {overall(first):.3f} before, {overall(last):.3f} at the end")
        return first, last


def mean_errors(history):
    """{attention name: its mean error} over a list of steps' errors."""
    return {name: sum(step[name] for step in history) / len(history) for name in history[0]}


def overall(errors):
    """The mean over the attentions."""
    return sum(errors.values()) / len(errors)


def transfer_attention(teacher, model, task, cfg, steps, lr):
    """AttentionTransfer of `teacher` to `model` for `steps` steps, on the training batches fairseq-train would read
    with `cfg` (a conversion's: conversion.py)."""
    from fairseq import utils

    if cfg.dataset.max_tokens is None and cfg.dataset.batch_size is None:
        raise ValueError("attention transfer reads training batches: give --max-tokens or --batch-size after --")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    teacher.to(device), model.to(device)
    split = cfg.dataset.train_subset
    task.load_dataset(split, combine=False, epoch=1)

    def batches():
        for epoch in itertools.count(1):  # as many epochs as the steps need, reshuffled each time
            yield from task.get_batch_iterator(
                dataset=task.dataset(split), max_tokens=cfg.dataset.max_tokens, max_sentences=cfg.dataset.batch_size,
                max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
                ignore_invalid_inputs=True, required_batch_size_multiple=cfg.dataset.required_batch_size_multiple,
                seed=cfg.common.seed, epoch=epoch, num_workers=0).next_epoch_itr(shuffle=True)

    moved = (utils.move_to_cuda(sample) if device == "cuda" else sample for sample in batches())
    AttentionTransfer(teacher, model, task.target_dictionary.pad(), lr).run(moved, steps)
    model.cpu()

