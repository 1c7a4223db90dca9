"""fairseq's options that fairseq itself does not check, and that end inside its code, on any model, with an error
that names none of them or with no end: refused here by name (compat.py calls these), when a tool builds its
generator or its batches, before it generates or trains. Found by the option contract
(tests/properties/test_fairseq_options.py); docs/flags.md lists them."""


class OptionRefusal(ValueError):
    """An option value that fairseq's tools cannot run, named with why."""


def check_generation(cfg):
    """Refuses what fairseq's generators cannot run, naming the option (cfg: the generation options)."""
    beam = getattr(cfg, "beam", 1)
    if beam is not None and beam < 1:
        raise OptionRefusal(f"--beam {beam}: a search keeps at least one hypothesis (--beam 1 is greedy search)")
    nbest = getattr(cfg, "nbest", 1)
    if nbest is not None and nbest < 1:
        raise OptionRefusal(f"--nbest {nbest}: at least one hypothesis is printed")
    if getattr(cfg, "replace_unk", None) is not None and not getattr(cfg, "print_alignment", None):
        raise OptionRefusal("--replace-unk replaces each <unk> by the source word aligned to it, and only "
                            "--print-alignment's generator aligns: give --print-alignment too")


def check_batching(max_tokens, max_sentences, required_batch_size_multiple):
    """Refuses batch sizes that fairseq's batching cannot make (a multiple of 0 loops without end)."""
    for flag, value in (("--max-tokens", max_tokens), ("--batch-size", max_sentences),
                        ("--required-batch-size-multiple", required_batch_size_multiple)):
        if value is not None and value < 1:
            raise OptionRefusal(f"{flag} {value}: batches are made of at least one " +
                                ("token" if flag == "--max-tokens" else "sentence"))
