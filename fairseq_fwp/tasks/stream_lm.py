"""Task `fwp_stream_lm`: language modelling over continuous streams, with the
fast weights carried from one segment to the next (paper Sec. 6.3, Table 4).

The split's tokens (every line ends with </s>) are one text. It is cut into
as many streams as the batch has rows (`--batch-size`; `--batch-size-valid`
for validation, `fairseq-eval-lm --batch-size 1` for one stream through the
whole split), and batch i holds segment i of every stream: row r of batch
i + 1 continues row r of batch i. With `--fwp-carry-over on` every causal
fast-weight layer starts a segment from the state (W, and z where used) that
ended the previous segment of the same stream, detached (truncated
backpropagation). With several data-parallel ranks each reads its own
streams. Before every batch (train_step, valid_step, and each batch
of fairseq-eval-lm) the task tells the layers the segment's position, and
the position decides (FastWeightAttention.start_segment): segment 0 starts
from zero, so every epoch, every validation subset and every evaluation
starts its streams from zero; a segment seen again (a retried update, or
the second forward of --checkpoint-activations) starts where it started
before. Every rank's training streams are part of the model's checkpoint (gathered
before fairseq saves one: prepare_checkpoint; modules/carried_streams.py), and
the features are a function of the epoch, so a run resumed in the middle of an
epoch by as many processes continues exactly as the run that never stopped.

`--fwp-stream-offset random` moves the streams from epoch to epoch: each
training epoch reads the text from a random offset (wrapping around from the
end of the split to its start, between two articles), so segment borders and
the age of the carried state differ at every text position from one epoch to
the next. Validation and evaluation always read from the start.

FAVOR+ with carry-over: the carried W is only meaningful in the feature
space it was written in, so while streams are carried the random features
stay fixed; training epoch e uses draw number e - 1 (FeatureMap.fix_features),
taken when the epoch begins, where the training streams start from zero.

Every token of a split is a target exactly once: stream inputs are the tokens
shifted right behind one </s>, so the first token of a stream is predicted
from </s> as in `language_modeling`, and no token is skipped at segment
borders (fairseq's example truncated_bptt_lm task scores neither the first
token of a segment nor is exact about ntokens).

Position embeddings, if on, restart at every segment, in training and
evaluation alike, so a segment (--tokens-per-sample) may not be longer than
the model's positions (--max-target-positions): building the model refuses
it. The fwp_lm_* archs have none, and take segments of any length.
"""
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from fairseq import utils
from fairseq.data import Dictionary, FairseqDataset, data_utils, iterators
from fairseq.data.indexed_dataset import MMapIndexedDataset
from fairseq.distributed import utils as distributed_utils
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.tasks import FairseqTask, register_task
from omegaconf import II

from ..models.fwp_config import ON_OFF, writable
from ..modules.fast_weight_attention import FastWeightAttention
from ..modules.transformer_layers import FastWeightTransformerDecoder
from .prompt_reading import PromptReading, session_file_option, session_option

logger = logging.getLogger(__name__)


STREAM_OFFSETS = ("none", "random")


@dataclass
class StreamLanguageModelingConfig(FairseqDataclass):
    data: Optional[str] = field(default=None, metadata={"help": "path to data directory (fairseq-preprocess --only-source)"})
    tokens_per_sample: int = field(default=256, metadata={"help": "segment length: tokens per stream per batch"})
    fwp_carry_over: ChoiceEnum(ON_OFF) = field(
        default="on", metadata={"help": "carry each layer's fast weights into the next segment of the stream "
                                         "(off: every segment starts from zero, the Table 4 baseline)"})
    fwp_stream_offset: ChoiceEnum(STREAM_OFFSETS) = field(
        default="none", metadata={"help": "random: every training epoch reads the text from a random offset "
                                           "(wrapping around), so stream and segment borders move from epoch to "
                                           "epoch; none: the same streams every epoch"})
    max_target_positions: Optional[int] = field(
        default=None, metadata={"help": "the model's positions (a learned positional embedding has as many rows): "
                                         "those of the model finetuned, which may be more than a segment's tokens; "
                                         "default: --tokens-per-sample"})
    add_bos_token: bool = field(default=False, metadata={"help": "unused; read by the LM model config"})
    fwp_session: bool = session_option()
    fwp_session_file: Optional[str] = session_file_option()
    batch_size: Optional[int] = II("dataset.batch_size")
    train_subset: str = II("dataset.train_subset")
    seed: int = II("common.seed")


class TokenStream(FairseqDataset):
    """A binarised split as one text: ``tokens`` is a 1-D LongTensor in file order."""

    def __init__(self, path, dictionary):
        dataset = data_utils.load_indexed_dataset(path, dictionary)
        if dataset is None:
            raise FileNotFoundError(f"dataset not found: {path}")
        if isinstance(dataset, MMapIndexedDataset):  # the default: its .bin file is the token stream
            self.tokens = torch.from_numpy(np.frombuffer(dataset._bin_buffer, dtype=dataset._index.dtype)
                                           .astype(np.int64))
        else:
            self.tokens = torch.cat([dataset[i] for i in range(len(dataset))] or [torch.zeros(0, dtype=torch.long)])

    def __len__(self):
        return len(self.tokens)


class StreamSegments(FairseqDataset):
    """Item i is batch i: segment i of each of this shard's streams.

    The text is cut into num_streams * num_shards equal streams (the last
    padded); shard s gets streams [s * num_streams, (s + 1) * num_streams).
    """

    def __init__(self, tokens, dictionary, num_streams, segment_length, shard_id=0, num_shards=1):
        total = num_streams * num_shards
        if len(tokens) < total:
            raise ValueError(f"{len(tokens)} tokens cannot fill {total} streams: lower --batch-size")
        self.pad, self.segment_length = dictionary.pad(), segment_length
        stream_length = math.ceil(len(tokens) / total)
        padded = torch.full((total * stream_length,), self.pad, dtype=torch.long)
        padded[: len(tokens)] = tokens
        streams = padded.view(total, stream_length)[shard_id * num_streams:(shard_id + 1) * num_streams]
        self.targets = streams
        self.inputs = torch.cat([torch.full((num_streams, 1), dictionary.eos()), streams[:, :-1]], dim=1)
        self.num_streams = num_streams

    def __len__(self):
        return math.ceil(self.targets.shape[1] / self.segment_length)

    def __getitem__(self, index):
        return index

    def collater(self, indices):
        (index,) = indices  # the batch sampler yields one segment index per batch
        window = slice(index * self.segment_length, (index + 1) * self.segment_length)
        inputs, targets = self.inputs[:, window].contiguous(), self.targets[:, window].contiguous()
        return {
            "id": torch.arange(self.num_streams) + index * self.num_streams,
            "net_input": {"src_tokens": inputs, "src_lengths": inputs.ne(self.pad).sum(1)},
            "target": targets,
            "nsentences": self.num_streams,
            "ntokens": int(targets.ne(self.pad).sum()),
            "segment": index,  # its position in the streams: see FastWeightAttention.start_segment
        }


def data_parallel_place():
    """(this process's data-parallel rank, the number of ranks); (0, 1) in a process of its own."""
    if not torch.distributed.is_initialized():
        return 0, 1
    return distributed_utils.get_data_parallel_rank(), distributed_utils.get_data_parallel_world_size()


class SegmentStarts:
    """fairseq-eval-lm's batches, each announced to the carrying layers before it is scored
    (eval-lm has no per-batch hook of the task)."""

    def __init__(self, batches, start):
        self.batches, self.start = batches, start

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for sample in self.batches:
            self.start(sample)
            yield sample


@register_task("fwp_stream_lm", dataclass=StreamLanguageModelingConfig)
class StreamLanguageModelingTask(PromptReading, FairseqTask):
    # Generation reads a prompt as language_modeling does (prompt_reading.py: its functions, which read the
    # options as args)

    @property
    def args(self):
        return self.cfg

    def __init__(self, cfg, dictionary):
        super().__init__(cfg)
        self.dictionary = dictionary
        self._carrying_layers = []

    @classmethod
    def setup_task(cls, cfg, **kwargs):
        paths = utils.split_paths(cfg.data)
        dictionary = Dictionary.load(os.path.join(paths[0], "dict.txt"))
        logger.info(f"dictionary: {len(dictionary)} types")
        return cls(cfg, dictionary)

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        self.refuse_a_session_on_a_data_set()
        paths = utils.split_paths(self.cfg.data)
        self.datasets[split] = TokenStream(os.path.join(paths[(epoch - 1) % len(paths)], split), self.dictionary)
        logger.info(f"{split}: {len(self.datasets[split])} tokens")

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        self._check_segments_fit(model)
        self._restart_positions_every_segment(cfg, model)
        layers = [m for m in model.modules() if isinstance(m, FastWeightAttention) and m.causal]
        if self.cfg.fwp_carry_over == "on":
            if not layers:
                logger.warning("--fwp-carry-over on: the model has no causal fast-weight layer; nothing is carried")
            rank, ranks = data_parallel_place()
            for layer in layers:
                layer.enable_carry_over(rank, ranks)  # random features: one draw per epoch (begin_epoch)
            self._carrying_layers.extend(layers)  # eval-lm may build an ensemble: every model's layers
        return model

    def _check_segments_fit(self, model):
        """Positions restart in every segment, so a model with position embeddings must have one for each of
        a segment's tokens: past them a learned embedding has no row, and sinusoidal ones go on unchecked."""
        decoder = getattr(model, "decoder", None)
        if getattr(decoder, "embed_positions", None) is None or getattr(decoder, "position_period", None):
            return  # no positions (the fwp_lm_* archs' default), or positions that restart: segments of any length
        positions = decoder.max_positions()
        if self.cfg.tokens_per_sample > positions:
            raise ValueError(f"--tokens-per-sample {self.cfg.tokens_per_sample} is longer than the model's {positions} "
                             "positions, which restart in every segment: lower --tokens-per-sample to at most "
                             f"{positions}, or give the model more positions (--max-target-positions)")

    def _restart_positions_every_segment(self, cfg, model):
        """A model with positions restarts them every segment here: its decoder, in every later use too (the
        model's --fwp-position-period, which its checkpoint keeps), reads and generates past its positions as
        it was trained, its fast weights carried."""
        decoder = getattr(model, "decoder", None)
        if not isinstance(decoder, FastWeightTransformerDecoder) or decoder.embed_positions is None \
                or decoder.position_period is not None:
            return
        decoder.position_period = self.cfg.tokens_per_sample
        with writable(cfg):
            cfg.fwp_position_period = self.cfg.tokens_per_sample

    def prepare_checkpoint(self, trainer):
        """Before fairseq saves a checkpoint, on every rank (compat.py calls it): every rank's training
        streams are gathered into the carrying layers, so that rank 0, which writes the checkpoint, saves
        them all."""
        layers = self._carrying_layers
        ranks = data_parallel_place()[1]
        if not layers or ranks == 1:
            return
        streams = [None] * ranks
        torch.distributed.all_gather_object(streams, [layer.streams.training_stream() for layer in layers],
                                            group=trainer.data_parallel_process_group)
        for i, layer in enumerate(layers):
            layer.streams.hold_every_rank([per_rank[i] for per_rank in streams])

    def _start_segment(self, sample, training):
        for layer in self._carrying_layers:
            layer.start_segment(sample["segment"], training)

    def begin_epoch(self, epoch, model):
        for layer in self._carrying_layers:
            # The training streams start from zero here: a new feature space is safe. A function of the
            # epoch, so that a run resumed in the middle of one keeps the features its state was written in.
            layer.feature_map.fix_features(epoch - 1)

    def train_step(self, sample, model, *args, **kwargs):
        self._start_segment(sample, training=True)
        return super().train_step(sample, model, *args, **kwargs)

    def valid_step(self, sample, model, criterion):
        self._start_segment(sample, training=False)
        return super().valid_step(sample, model, criterion)

    def get_batch_iterator(self, dataset, max_sentences=None, num_shards=1, shard_id=0, num_workers=0, epoch=1,
                           data_buffer_size=0, **kwargs):
        if not isinstance(dataset, TokenStream):  # fairseq-interactive's lines (build_dataset_for_inference)
            return super().get_batch_iterator(dataset, max_sentences=max_sentences, num_shards=num_shards,
                                              shard_id=shard_id, num_workers=num_workers, epoch=epoch,
                                              data_buffer_size=data_buffer_size, **kwargs)
        if not max_sentences:
            raise ValueError("fwp_stream_lm needs --batch-size (and --batch-size-valid, or eval-lm's --batch-size): "
                             "the number of parallel streams")
        tokens = dataset.tokens
        if self.cfg.fwp_stream_offset == "random" and dataset is self.datasets.get(self.cfg.train_subset):
            # the same offset on every rank: drawn from (seed, epoch)
            offset = int(torch.randint(len(tokens), (), generator=torch.Generator().manual_seed(
                self.cfg.seed * 1_000_003 + epoch)))
            tokens = torch.cat([tokens[offset:], tokens[:offset]])
        segments = StreamSegments(tokens, self.dictionary, max_sentences, self.cfg.tokens_per_sample,
                                  shard_id, num_shards)
        return iterators.EpochBatchIterator(
            dataset=segments, collate_fn=segments.collater, batch_sampler=[[i] for i in range(len(segments))],
            num_workers=num_workers, epoch=epoch, buffer_size=data_buffer_size,
            disable_shuffling=True,  # the streams must be read in order
        )

    def eval_lm_dataloader(self, dataset, batch_size=None, num_shards=1, shard_id=0, num_workers=1,
                           data_buffer_size=10, context_window=0, **kwargs):
        if context_window > 0:
            raise ValueError("fwp_stream_lm carries the state through the split instead of a context window; "
                             "use --task language_modeling for --context-window")
        batches = self.get_batch_iterator(dataset, max_sentences=batch_size or 1, num_shards=num_shards,
                                          shard_id=shard_id, num_workers=num_workers,
                                          data_buffer_size=data_buffer_size).next_epoch_itr(shuffle=False)
        return SegmentStarts(batches, lambda sample: self._start_segment(sample, training=False))

    @property
    def source_dictionary(self):
        return self.dictionary

    @property
    def target_dictionary(self):
        return self.dictionary
