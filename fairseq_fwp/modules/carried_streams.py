"""The state a causal fast-weight layer carries from one segment of a stream to the next (Table 4).

One ``CarriedStreams`` per layer keeps a training and an evaluation stream
apart (a validation pass in the middle of an epoch must not disturb the
training streams). Each holds the state (state.FastWeightState) a segment
starts from and the state it ended with, detached (truncated
backpropagation).

Whoever feeds the segments announces each one with ``start_segment``; its
position decides where the segment starts (see there). Every forward within
one segment starts from the same state, which keeps fairseq's
``--checkpoint-activations`` (a second forward per layer in the backward
pass) exact.

The training stream is part of the model's state dict (as the module's extra
state), so a checkpoint written in the middle of an epoch resumes its
streams where they were. A checkpoint without it (written without carry-over)
loads too: its streams start from zero.
"""
import dataclasses

import torch.nn as nn

from .state import FastWeightState


@dataclasses.dataclass
class Stream:
    position: int  # of the current segment in its streams
    start: FastWeightState  # where it starts
    end: FastWeightState  # where it ended (its start while it runs)


class CarriedStreams(nn.Module):
    def __init__(self):
        super().__init__()
        self._streams = {}  # training (bool) -> Stream

    def start_segment(self, position, training):
        """Before the segment at `position` (0, 1, ...) of the training or evaluation streams.

        Position 0 starts from zero; the position after the previous one
        starts from the state the previous one ended with; the previous
        position again (a retried update) starts where it started before; any
        other position starts from zero.
        """
        stream = self._streams.get(training)
        if stream is not None and position == stream.position:
            start = stream.start
        elif stream is not None and position == stream.position + 1 and position > 0:
            start = stream.end
        else:
            start = FastWeightState()
        self._streams[training] = Stream(position, start, start)

    def start(self, training, batch_size, device):
        """A copy of the state the current segment starts from (empty for zeros), on `device`."""
        stream = self._streams.get(training)
        if stream is None:
            return FastWeightState()
        state = stream.start.to(device)
        W = state.memory.fast_weight
        if W is not None and W.shape[0] != batch_size:
            raise RuntimeError(
                f"the carried fast weight holds {W.shape[0]} streams, but this segment has {batch_size} rows: "
                "every batch of a carry-over task must keep the same streams in the same rows")
        return state

    def last(self, training):
        """The state the latest segment ended with (empty before any)."""
        stream = self._streams.get(training)
        return FastWeightState() if stream is None else stream.end

    def end(self, training, state):
        """The state the current segment ended with; the next segment starts from it."""
        stream = self._streams.get(training)
        if stream is not None:
            stream.end = state.detached()

    # -- checkpoints: the training stream ------------------------------------------------

    def get_extra_state(self):
        stream = self._streams.get(True)
        if stream is None:
            return {}
        return {"position": stream.position, "start": stream.start.as_dict(), "end": stream.end.as_dict()}

    def set_extra_state(self, saved):
        if saved:
            self._streams[True] = Stream(saved["position"], FastWeightState.from_dict(saved["start"]),
                                         FastWeightState.from_dict(saved["end"]))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A checkpoint written without carry-over has no streams: they start from zero.
        saved = state_dict.get(prefix + "_extra_state")
        if saved is not None:
            self.set_extra_state(saved)
