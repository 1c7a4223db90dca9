"""Build tiny fwp models in-process through fairseq's own argument parsing."""
import types

import torch
from fairseq import options
from fairseq.data import Dictionary
from pipeline import PLUGIN_DIR


def parse_args(task, arch, *flags):
    parser = options.get_training_parser()
    argv = ["/nonexistent-data", "--task", task, "--arch", arch, "--user-dir", PLUGIN_DIR, *flags]
    return options.parse_args_and_arch(parser, argv)


def toy_dictionary(n_words=30):
    d = Dictionary()
    for i in range(n_words):
        d.add_symbol(f"w{i}")
    return d


def build_translation_model(*flags, seed=0):
    from fairseq_fwp.models.fwp_transformer import FastWeightTransformerModel

    args = parse_args("translation", "fwp_transformer_tiny", "--dropout", "0", *flags)
    d = toy_dictionary()
    torch.manual_seed(seed)
    model = FastWeightTransformerModel.build_model(args, types.SimpleNamespace(source_dictionary=d, target_dictionary=d))
    return model.eval(), d


def build_lm_model(*flags, seed=0):
    from fairseq_fwp.models.fwp_transformer_lm import FastWeightTransformerLanguageModel

    args = parse_args("language_modeling", "fwp_lm_tiny", "--dropout", "0", *flags)
    d = toy_dictionary()
    torch.manual_seed(seed)
    model = FastWeightTransformerLanguageModel.build_model(
        args, types.SimpleNamespace(source_dictionary=d, target_dictionary=d))
    return model.eval(), d


def random_tokens(d, lengths, seed=0, left_pad=True):
    """[B, max_len] tokens of the given lengths, padded left (sources) or right."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    tokens = torch.full((len(lengths), T), d.pad(), dtype=torch.long)
    for i, n in enumerate(lengths):
        row = torch.randint(d.nspecial, len(d), (n,), generator=g)
        row[-1] = d.eos()
        if left_pad:
            tokens[i, T - n:] = row
        else:
            tokens[i, :n] = row
    return tokens
