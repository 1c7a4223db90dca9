"""What generating a token costs at each position, through fairseq's own SequenceGenerator.

A softmax decoder attends to every earlier token: its key/value cache, and
the time of a step, grow with the position. A fast-weight decoder reads and
writes one fixed-size memory per layer (W, Eqs. 17 and 23), so both stay
flat. ``generation_cost`` measures both for any model the plugin builds, step
by step, in a real ``SequenceGenerator.generate`` call; ``build_random_model``
builds models with random weights through fairseq's own argument parsing,
for benchmarks that need no training.
"""
import dataclasses
import time
import types
from typing import List

import torch

from fairseq_fwp.modules.state import buffer_tensors
from .commands import PLUGIN_DIR


def numbered_dictionary(size):
    """A fairseq Dictionary of `size` words w0, w1, ... (plus the special symbols)."""
    from fairseq.data import Dictionary

    dictionary = Dictionary()
    for i in range(size):
        dictionary.add_symbol(f"w{i}")
    return dictionary


def build_random_model(task, arch, flags, dictionary, seed=0):
    """A plugin model with random weights, in eval mode, built as fairseq-train would build it."""
    from fairseq import models, options

    argv = ["/nonexistent", "--task", task, "--arch", arch, "--user-dir", PLUGIN_DIR, *map(str, flags)]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    torch.manual_seed(seed)
    holder = types.SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    return models.ARCH_MODEL_REGISTRY[arch].build_model(args, holder).eval()


def state_bytes(incremental_state):
    """Bytes of what the decoder carries from step to step: every layer's key/value cache (softmax)
    or FastWeightState (fast weights), as the tensors' sizes (not their storages' spare room)."""
    return sum(x.numel() * x.element_size() for buffer in incremental_state.values() for x in buffer_tensors(buffer))


@dataclasses.dataclass
class GenerationCost:
    seconds: List[float]  # the decoder's time at each step (the generator's own work apart)
    state_bytes: List[int]  # the decoder's state after each step
    total_seconds: float  # the whole generate call

    def at(self, position, window=32):
        """(median seconds per step over `window` steps from `position`, state bytes at `position`)."""
        times = sorted(self.seconds[position:position + window])
        return times[len(times) // 2], self.state_bytes[position]


@torch.no_grad()
def generation_cost(model, dictionary, length, batch=1, prompt_length=4, seed=0):
    """Generate exactly `length` tokens after a random prompt of `prompt_length` with fairseq's
    SequenceGenerator (greedy, `batch` sequences), timing the decoder at every step."""
    from fairseq.sequence_generator import SequenceGenerator

    decoder, seconds, sizes = model.decoder, [], []
    forward = decoder.forward

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        sizes.append(state_bytes(kwargs["incremental_state"]))
        return out

    generator = SequenceGenerator([model], dictionary, beam_size=1, max_len_a=0, max_len_b=length, min_len=length)
    prompt = torch.randint(dictionary.nspecial, len(dictionary), (batch, prompt_length),
                           generator=torch.Generator().manual_seed(seed))
    sample = {"net_input": {"src_tokens": prompt, "src_lengths": torch.full((batch,), prompt_length)},
              "id": torch.arange(batch)}
    decoder.forward = timed_forward  # the generator calls decoder.forward itself (no module hooks run)
    try:
        start = time.perf_counter()
        generator.generate([model], sample, prefix_tokens=prompt, bos_token=dictionary.eos())
        total = time.perf_counter() - start
    finally:
        del decoder.forward
    return GenerationCost(seconds, sizes, total)

