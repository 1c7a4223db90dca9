"""Criterion `fwp_distillation`: label-smoothed cross-entropy plus the divergence from a teacher's
predictions (word-level knowledge distillation, Kim and Rush 2016), for uptraining a converted
fast-weight model next to the softmax model it came from (fairseq_fwp/uptraining/).

    loss = (1 - w) * label-smoothed cross-entropy + w * KL(p_teacher || p_student)

both summed over the target tokens, w = --distillation-weight. The teacher (a checkpoint with the
task's vocabulary, usually the softmax model that was converted) reads every training batch as it
is, in eval mode and without gradient. It is kept out of the criterion's modules, so it is neither
trained nor saved. Validation scores the plain label-smoothed cross-entropy, so checkpoint_best.pt
is chosen by the same loss as in a run without a teacher.

Why: a model converted from softmax attention has to relearn every output distribution from the
one-hot targets alone; the teacher gives the whole distribution at every position (how sure to be,
when to end the sentence) at the cost of one teacher forward per batch.
"""
import argparse
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from fairseq import checkpoint_utils, utils
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
    label_smoothed_nll_loss,
)
from fairseq.logging import metrics


@dataclass
class DistillationConfig(LabelSmoothedCrossEntropyCriterionConfig):
    teacher_checkpoint: Optional[str] = field(
        default=None, metadata={"help": "the teacher's fairseq checkpoint (required), e.g. the softmax model "
                                        "a fast-weight model was converted from"})
    distillation_weight: float = field(
        default=0.5, metadata={"help": "w in (1 - w) * cross-entropy + w * KL(teacher || student), in [0, 1]"})


def weight_in_unit_interval(text):
    """--distillation-weight's type: a float in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


def teacher_divergence(teacher_lprobs, student_lprobs, keep):
    """sum over the kept positions of KL(teacher || student); lprobs ``[N, V]``, keep ``[N]`` bool."""
    teacher_lprobs, student_lprobs = teacher_lprobs[keep], student_lprobs[keep]
    return (teacher_lprobs.exp() * (teacher_lprobs - student_lprobs)).sum()


@register_criterion("fwp_distillation", dataclass=DistillationConfig)
class DistillationCriterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, teacher_checkpoint, distillation_weight,
                 ignore_prefix_size=0, report_accuracy=False):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        if not teacher_checkpoint:
            raise ValueError("--criterion fwp_distillation needs --teacher-checkpoint")
        (teacher,), _ = checkpoint_utils.load_model_ensemble([teacher_checkpoint], task=task)
        self._teacher = [teacher.eval()]  # a list, so that it is no submodule: not trained, not saved
        self.weight = distillation_weight

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        for action in parser._actions:
            if action.dest == "distillation_weight":
                action.type = weight_in_unit_interval

    def teacher_lprobs(self, sample, student):
        """The teacher's log-probabilities on the sample, the teacher on the student's device and dtype."""
        teacher = self._teacher[0]
        mine, theirs = next(teacher.parameters()), next(student.parameters())
        if (mine.device, mine.dtype) != (theirs.device, theirs.dtype):
            teacher.to(device=theirs.device, dtype=theirs.dtype)
        with torch.no_grad():
            output = teacher(**sample["net_input"])
            return self.get_lprobs_and_target(teacher, output, sample)[0]

    def forward(self, model, sample, reduce=True):
        if not model.training or self.weight == 0:  # validation: the plain loss (see the module's docstring)
            return super().forward(model, sample, reduce)
        net_output = model(**sample["net_input"])
        student_lprobs, target = self.get_lprobs_and_target(model, net_output, sample)
        smoothed, nll_loss = label_smoothed_nll_loss(student_lprobs, target, self.eps, ignore_index=self.padding_idx,
                                                     reduce=reduce)
        divergence = teacher_divergence(self.teacher_lprobs(sample, model), student_lprobs,
                                        target.ne(self.padding_idx))
        loss = (1 - self.weight) * smoothed + self.weight * divergence
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output = {"loss": loss.data, "nll_loss": nll_loss.data, "distillation_loss": divergence.data,
                          "ntokens": sample["ntokens"], "nsentences": sample["target"].size(0),
                          "sample_size": sample_size}
        return loss, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        if any("distillation_loss" in log for log in logging_outputs):
            divergence = sum(log.get("distillation_loss", 0) for log in logging_outputs)
            ntokens = sum(log.get("ntokens", 0) for log in logging_outputs)
            metrics.log_scalar("distillation_loss", utils.item(divergence) / ntokens / math.log(2), ntokens,
                               round=3)
