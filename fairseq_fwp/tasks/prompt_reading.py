"""What the plugin's language-model tasks add to generation: fairseq-generate, fairseq-interactive and the hub's
sample() and generate() build the task's generator, which here is FastWeightSequenceGenerator (a prompt read
in one decoder call per layer; sequence_generator.py) wherever fairseq would build its SequenceGenerator."""
from ..sequence_generator import FastWeightSequenceGenerator


class PromptReading:
    """A mixin before a fairseq task class."""

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None):
        if seq_gen_cls is None and not getattr(args, "print_alignment", False):
            seq_gen_cls = FastWeightSequenceGenerator
        return super().build_generator(models, args, seq_gen_cls=seq_gen_cls, extra_gen_cls_kwargs=extra_gen_cls_kwargs,
                                       prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
