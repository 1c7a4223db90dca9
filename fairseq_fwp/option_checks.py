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
    for option, flag in (("print_step", "--print-step"), ("retain_iter_history", "--retain-iter-history")):
        if getattr(cfg, option, False):  # read from hypotheses that only fairseq's iterative refinement writes
            raise OptionRefusal(f"{flag} is for iterative refinement (fairseq's translation_lev models), whose "
                                "generator counts its steps: this generator decodes left to right")
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


def check_log_interval(log_interval):
    """Refuses a progress bar that would log every 0 updates (a modulo by zero in the tools' loops)."""
    if log_interval is not None and log_interval < 1:
        raise OptionRefusal(f"--log-interval {log_interval}: the tools log every N updates, N at least 1")


def check_length_multiple(pad_to_multiple):
    """Refuses padding a translation batch's lengths to a multiple of 0 (a modulo by zero in its collater)."""
    if pad_to_multiple is not None and pad_to_multiple < 1:
        raise OptionRefusal(f"--required-seq-len-multiple {pad_to_multiple}: lengths are padded to a multiple of "
                            "at least 1 (1 pads nothing)")
