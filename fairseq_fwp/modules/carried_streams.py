"""The state a causal fast-weight layer carries from one segment of a stream to the next (Table 4).

One ``CarriedStreams`` per layer keeps the training and the evaluation streams
apart (a validation pass in the middle of an epoch must not disturb the
training streams). Each holds the state (state.FastWeightState) a segment
starts from and the state it ended with, detached (truncated
backpropagation).

Whoever feeds the segments announces each one with ``start_segment``; its
position decides where the segment starts (see there). Every forward within
one segment starts from the same state, which keeps fairseq's
``--checkpoint-activations`` (a second forward per layer in the backward
pass) exact.

The training streams are part of the model's state dict (as the module's extra state), so a
checkpoint written in the middle of an epoch resumes them where they were. With several data-parallel
ranks, each reads its own streams (its shard of the text): whoever saves a checkpoint first gathers
every rank's training stream into rank 0's modules (``hold_every_rank``, on every rank at once; the task
fwp_stream_lm does it before fairseq saves), and on loading each rank takes its own. A checkpoint of
another number of ranks cannot continue: its streams were cut otherwise, so a training segment that
would continue from it stops the run, saying what to do; starting the streams from zero (position 0,
as after ``--reset-dataloader``) is always fine, and evaluation never reads training streams. A
checkpoint without streams (written without carry-over) loads too: its streams start from zero.
"""
import dataclasses
from typing import Optional

import torch.nn as nn

from .state import FastWeightState


@dataclasses.dataclass
class Stream:
    position: int  # of the current segment in its streams
    start: FastWeightState  # where it starts
    end: FastWeightState  # where it ended (its start while it runs)

    def as_dict(self):
        """Plain tensors and numbers, on the CPU (to gather across ranks and to save)."""
        return {"position": self.position, "start": self.start.to("cpu").as_dict(),
                "end": self.end.to("cpu").as_dict()}

    @classmethod
    def from_dict(cls, saved):
        return cls(saved["position"], FastWeightState.from_dict(saved["start"]), FastWeightState.from_dict(saved["end"]))


@dataclasses.dataclass
class OtherRanks:
    """Training streams of a checkpoint that this run cannot continue: another number of ranks wrote them
    (or state_dict() was called outside a checkpoint save of several ranks, without the others)."""

    position: int
    reason: str


class CarriedStreams(nn.Module):
    def __init__(self, rank=0, world_size=1):
        """rank, world_size: this process's place among the data-parallel ranks."""
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self._streams = {}  # training (bool) -> Stream
        self._every_rank = None  # (this rank's Stream, its end, [every rank's as_dict()]) of the last gather
        self._other_ranks: Optional[OtherRanks] = None

    def start_segment(self, position, training):
        """Before the segment at `position` (0, 1, ...) of the training or evaluation streams.

        Position 0 starts from zero; the position after the previous one
        starts from the state the previous one ended with; the previous
        position again (a retried update) starts where it started before; any
        other position starts from zero.
        """
        if training and self._other_ranks is not None:
            if position == self._other_ranks.position + 1 and position > 0:
                raise RuntimeError(f"{self._other_ranks.reason}: its carried fast weights cannot continue here. "
                                   "Resume with the number of processes that wrote it, or start the streams (and "
                                   "the epochs) from zero with --reset-dataloader")
            self._other_ranks = None
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
        rows = state.memory.rows
        if rows is not None and rows != batch_size:
            raise RuntimeError(
                f"the carried fast weight holds {rows} streams, but this segment has {batch_size} rows: "
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

    # -- checkpoints: the training streams of every rank ----------------------------------

    def training_stream(self):
        """This rank's training stream as saved (None before any), for the gather before a checkpoint."""
        stream = self._streams.get(True)
        return None if stream is None else stream.as_dict()

    def hold_every_rank(self, streams):
        """Every rank's training_stream(), in rank order, gathered before a checkpoint is saved: what
        get_extra_state saves while this rank's stream has not moved on."""
        stream = self._streams.get(True)
        self._every_rank = None if stream is None else (stream, stream.end, list(streams))

    def get_extra_state(self):
        stream = self._streams.get(True)
        if stream is None:
            return {}
        if self.world_size == 1:
            ranks = [stream.as_dict()]
        elif self._every_rank is not None and self._every_rank[0] is stream and self._every_rank[1] is stream.end:
            ranks = self._every_rank[2]  # gathered since this stream last moved (identity: states hold tensors)
        else:
            ranks = None  # the other ranks' streams are not here
        return {"world_size": self.world_size, "position": stream.position, "ranks": ranks}

    def set_extra_state(self, saved):
        self._streams.pop(True, None)
        self._other_ranks = None
        if not saved:
            return
        if "ranks" not in saved:  # written when one process's stream was saved alone
            saved = {"world_size": 1, "position": saved["position"], "ranks": [saved]}
        if saved["ranks"] is None:
            self._other_ranks = OtherRanks(saved["position"], f"the checkpoint holds the streams of only one of "
                                                              f"its {saved['world_size']} data-parallel ranks")
        elif saved["world_size"] != self.world_size:
            self._other_ranks = OtherRanks(saved["position"], f"the checkpoint carries the streams of "
                                                              f"{saved['world_size']} data-parallel ranks, this run "
                                                              f"has {self.world_size}")
        else:
            self._streams[True] = Stream.from_dict(saved["ranks"][self.rank])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A checkpoint written without carry-over has no streams: they start from zero.
        saved = state_dict.get(prefix + "_extra_state")
        if saved is not None:
            self.set_extra_state(saved)
