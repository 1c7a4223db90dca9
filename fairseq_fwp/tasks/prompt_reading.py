"""What the plugin's language-model tasks add to generation: fairseq-generate, fairseq-interactive and the hub's
sample() and generate() build the task's generator, which here is FastWeightSequenceGenerator (a prompt read
in one decoder call per layer; sequence_generator.py) wherever fairseq would build its SequenceGenerator; and
with --fwp-session, each input continues one session (session.py): fairseq-interactive's lines are the turns
of a conversation, and an empty line starts a new one."""
from dataclasses import field

from fairseq.tasks.language_modeling import LanguageModelingTask

from ..sequence_generator import FastWeightSequenceGenerator
from ..session import History


def session_option():
    """The --fwp-session field of a task's config."""
    return field(default=False, metadata={
        "help": "generation continues one session: each input (fairseq-interactive's line) is read from the state "
                "the inputs and kept replies before it left (the best hypothesis is kept), and generates what the "
                "whole history as one prompt generates; an empty line starts a new session. One input at a time "
                "(--buffer-size 1 --batch-size 1, fairseq-interactive's defaults)"})


class PromptReading:
    """A mixin before a fairseq task class whose generation is language_modeling's."""

    _history = None

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None):
        if seq_gen_cls is None and not getattr(args, "print_alignment", False):
            seq_gen_cls = FastWeightSequenceGenerator
        return super().build_generator(models, args, seq_gen_cls=seq_gen_cls, extra_gen_cls_kwargs=extra_gen_cls_kwargs,
                                       prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)

    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        if not getattr(self.args, "fwp_session", False):  # language_modeling keeps its options as args
            return LanguageModelingTask.inference_step(self, generator, models, sample, prefix_tokens, constraints)
        return self._session_turn(generator, models, sample)

    def get_interactive_tokens_and_lengths(self, lines, encode_fn):
        if getattr(self.args, "fwp_session", False) and len(lines) > 1:
            raise ValueError(f"--fwp-session reads one input at a time, in order, and fairseq-interactive gave {len(lines)}"
                             " at once: give --buffer-size 1 (its default; a buffer's inputs are read by length)")
        return super().get_interactive_tokens_and_lengths(lines, encode_fn)

    def _session_turn(self, generator, models, sample):
        """A turn of the session (fairseq-interactive's line: sample's one input, after its bos)."""
        src_tokens = sample["net_input"]["src_tokens"]
        if src_tokens.size(0) != 1:
            raise ValueError(f"--fwp-session reads one input at a time, not {src_tokens.size(0)}")
        if not isinstance(generator, FastWeightSequenceGenerator):
            raise ValueError("--fwp-session needs the task's own generator (FastWeightSequenceGenerator)")
        if self._history is None or self._history.models != list(models):
            self._history = History(models, self.source_dictionary)
        tokens = src_tokens[0, 1:][src_tokens[0, 1:].ne(self.source_dictionary.pad())]
        if tokens.numel() == 0:  # an empty line: a new session
            self._history.reset()
            return [[]]
        return generator.generate(models, sample, prefix_tokens=tokens.unsqueeze(0), bos_token=int(src_tokens[0, 0]),
                                  history=self._history)
