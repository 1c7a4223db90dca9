"""What the plugin's language-model tasks add to generation: fairseq-generate, fairseq-interactive and the hub's
sample() and generate() build the task's generator, which here is FastWeightSequenceGenerator (a prompt read
in one decoder call per layer; sequence_generator.py) wherever fairseq would build its SequenceGenerator; and
with --fwp-session, fairseq-interactive's lines are the turns of one conversation (session.py): each is read
from the state the lines before left, in order, whatever --buffer-size and --batch-size group; an empty line
starts a new session; a refused line is said so, and the session goes on as it was; --fwp-session-file resumes
a saved session when the tool starts and saves it after every line."""
import logging
import os
from dataclasses import field
from typing import Optional

import numpy as np
import torch
from fairseq.data import IdDataset, ListDataset, NestedDictionaryDataset, NumelDataset, PadDataset, \
    PrependTokenDataset
from fairseq.tasks.language_modeling import LanguageModelingTask

from ..sequence_generator import FastWeightSequenceGenerator
from ..session import History, SessionRefusal

logger = logging.getLogger("fairseq_fwp.session")

SESSION_TOOLS = "fairseq-interactive (and the hub's fairseq_fwp.session.Session)"


def session_option():
    """The --fwp-session field of a task's config."""
    return field(default=False, metadata={
        "help": "fairseq-interactive continues one session: each input line is read from the state the lines and "
                "kept replies before it left (the best hypothesis is kept), and generates what the whole history "
                "as one prompt generates; --max-len-a/b and --min-len bound each reply; an empty line starts a new "
                "session. For fairseq-interactive only"})


def session_file_option():
    """The --fwp-session-file field of a task's config."""
    return field(default=None, metadata={
        "help": "fairseq-interactive's session file (implies --fwp-session): resumed when the tool starts where it "
                "exists, and saved after every line"})


class PromptReading:
    """A mixin before a fairseq task class whose generation is language_modeling's."""

    _history = None

    def _session_on(self):
        return bool(getattr(self.args, "fwp_session", False) or getattr(self.args, "fwp_session_file", None))

    def refuse_a_session_on_a_data_set(self):
        """Tools that read a data set (fairseq-generate, -eval-lm, -validate, -train) take no session."""
        if self._session_on():
            raise ValueError(f"--fwp-session continues one conversation, input by input: it is for {SESSION_TOOLS}; "
                             "the tools that read a data set (fairseq-generate, fairseq-eval-lm, fairseq-validate, "
                             "fairseq-train) take none: leave --fwp-session and --fwp-session-file out")

    def load_dataset(self, split, *args, **kwargs):
        self.refuse_a_session_on_a_data_set()
        return super().load_dataset(split, *args, **kwargs)

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None):
        if getattr(args, "print_alignment", None):
            raise ValueError(f"--print-alignment {args.print_alignment}: a language model's output has no source "
                             "to align to (its prompt is its own past)")
        if seq_gen_cls is None:
            seq_gen_cls = FastWeightSequenceGenerator
        generator = super().build_generator(models, args, seq_gen_cls=seq_gen_cls,
                                            extra_gen_cls_kwargs=extra_gen_cls_kwargs,
                                            prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
        if self._session_on():
            self._start_session(models, generator)
        return generator

    def _start_session(self, models, generator):
        """fairseq-interactive's session: refused, at once, for models or options that cannot keep one; resumed
        from --fwp-session-file where it exists."""
        if not isinstance(generator, FastWeightSequenceGenerator) or not generator.model.reads_prompts():
            kinds = ", ".join(sorted({type(model).__name__ for model in models}))
            raise ValueError(f"--fwp-session needs fast-weight language models (the plugin's fwp_lm_* architectures, "
                             f"or a softmax LM converted by python -m fairseq_fwp.uptrain): {kinds} keeps no state of "
                             "fixed size for a session to continue from" + (
                                 "; and --print-alignment takes fairseq's generator, which keeps none"
                                 if getattr(generator, "print_alignment", None) else ""))
        generator.check_session_options()
        self._history = History(models, self.source_dictionary)
        path = self.args.fwp_session_file
        if path and os.path.exists(path):
            self._history.load(path)
            logger.info(f"session: resumed from {path} ({self._history.tokens_read} tokens read)")
        elif path:
            logger.info(f"session: a new session, saved to {path} after every line")

    def build_dataset_for_inference(self, src_tokens, src_lengths, **kwargs):
        """language_modeling's; in a session each line as typed (its </s> included), after the bos, in order."""
        if not self._session_on():
            return LanguageModelingTask.build_dataset_for_inference(self, src_tokens, src_lengths, **kwargs)
        lines = [tokens[:-1] for tokens in src_tokens]  # less the </s> that encoding appends
        bos = self.source_dictionary.bos() if getattr(self.args, "add_bos_token", False) else self.source_dictionary.eos()
        rows = PrependTokenDataset(ListDataset(lines, np.array([len(line) for line in lines])), bos)
        pad = self.source_dictionary.pad()
        return NestedDictionaryDataset({"id": IdDataset(), "net_input": {
            "src_tokens": PadDataset(rows, pad_idx=pad, left_pad=False), "src_lengths": NumelDataset(rows, reduce=False)}},
            sizes=[rows.sizes])

    def filter_indices_by_size(self, indices, dataset, max_positions=None, ignore_invalid_inputs=False):
        """In a session no line is filtered out: the generator refuses, naming the limit, a line past a model's
        positions (the history's tokens count)."""
        if self._session_on():
            return indices
        return super().filter_indices_by_size(indices, dataset, max_positions, ignore_invalid_inputs)

    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        if not self._session_on():  # language_modeling keeps its options as args
            return LanguageModelingTask.inference_step(self, generator, models, sample, prefix_tokens, constraints)
        if constraints is not None:
            return [self._refused(SessionRefusal("--constraints in a session: it constrains the turn only, where the "
                                                 "whole history as one prompt gives it every token before"))
                    for _ in range(sample["net_input"]["src_tokens"].size(0))]
        src_tokens, src_lengths = sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"]
        return [self._session_turn(generator, models, src_tokens[row, :int(src_lengths[row])])
                for row in range(src_tokens.size(0))]  # the lines in order (the dataset keeps them so)

    def _session_turn(self, generator, models, line):
        """A turn of the session: `line`, its bos and its tokens; its hypotheses, or none where it is refused or
        empty (a new session)."""
        if self._history is None or self._history.models != list(models):
            self._history = History(models, self.source_dictionary)
        tokens = line[1:]
        if tokens.numel() == 0:
            self._history.reset()
            self._save()
            logger.info("session: an empty line: a new session starts")
            return []
        sample = {"net_input": {"src_tokens": line.unsqueeze(0), "src_lengths": line.new_tensor([line.numel()])}}
        try:
            with torch.no_grad():
                hypotheses = generator.generate(models, sample, prefix_tokens=tokens.unsqueeze(0),
                                                bos_token=int(line[0]), history=self._history)[0]
        except SessionRefusal as refusal:
            return self._refused(refusal)
        self._save()
        logger.info(f"session: {tokens.numel()} tokens read; H- is the score of the whole history, its "
                    f"{self._history.length} tokens (the reply kept); P- scores this line and its reply")
        return hypotheses

    def _refused(self, refusal):
        logger.error(f"session: line refused, the session is as it was: {refusal}")
        return []

    def _save(self):
        if self.args.fwp_session_file:
            self._history.save(self.args.fwp_session_file)
