"""`--task dual_form_language_modeling`: fairseq's language_modeling task that can record the dual form.

    fairseq-train DATA --user-dir fairseq_fwp --task dual_form_language_modeling \\
        --dual-form-record decoder.layers.1.fc1,decoder.layers.1.fc2 --dual-form-dir DIR \\
        --optimizer sgd --lr 1.0 ...

Without --dual-form-record it is exactly fwp_language_modeling. With it, the
named nn.Linear layers get hooks (recorder.py) and every update is written
to DIR (storage.py) just before the optimizer applies it. Settings under
which the record would not be exact are refused at startup (exactness.py).
"""
import os
from dataclasses import dataclass, field
from typing import Optional

from fairseq.data import TokenBlockDataset
from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from omegaconf import II

from ..tasks.language_modeling import FastWeightLanguageModelingConfig, FastWeightLanguageModelingTask
from .exactness import check_training_config
from .recorder import DualFormRecorder
from .storage import STORAGE_DTYPES


@dataclass
class DualFormLanguageModelingConfig(FastWeightLanguageModelingConfig):
    dual_form_record: str = field(default="", metadata={
        "help": "comma-separated nn.Linear modules whose training inputs and errors are recorded, "
                "e.g. decoder.layers.1.fc1,decoder.output_projection"})
    dual_form_dir: str = field(default="", metadata={"help": "directory of the record (must not hold one)"})
    dual_form_dtype: ChoiceEnum(STORAGE_DTYPES) = field(default="float32", metadata={
        "help": "storage type of x_t and g_t; float16 halves the size, and the identity becomes approximate"})
    # The run's global settings that decide exactness. Interpolated (no help,
    # so fairseq adds no flags); fairseq fills them from the same-named flags.
    optimizer: Optional[str] = II("optimizer._name")
    fp16: bool = II("common.fp16")
    bf16: bool = II("common.bf16")
    memory_efficient_fp16: bool = II("common.memory_efficient_fp16")
    amp: bool = II("common.amp")
    clip_norm: float = II("optimization.clip_norm")
    use_bmuf: bool = II("optimization.use_bmuf")
    distributed_world_size: int = II("distributed_training.distributed_world_size")


@register_task("dual_form_language_modeling", dataclass=DualFormLanguageModelingConfig)
class DualFormLanguageModelingTask(FastWeightLanguageModelingTask):
    recorder = None

    def build_model(self, args, from_checkpoint=False):
        model = super().build_model(args, from_checkpoint)
        if self.args.dual_form_record and not from_checkpoint:  # training, not loading for evaluation
            self.recorder = self._build_recorder(model)
        return model

    def _build_recorder(self, model):
        cfg = self.args
        if not cfg.dual_form_dir:
            raise ValueError("--dual-form-record needs --dual-form-dir")
        check_training_config(cfg)
        unsupported = {"--add-bos-token": cfg.add_bos_token, "--shorten-method": cfg.shorten_method != "none",
                       "--self-target/--past-target": self.targets != ["future"],
                       "several data directories": len(cfg.data.split(os.pathsep)) > 1}
        for option, used in unsupported.items():
            if used:
                raise ValueError(f"--dual-form-record: {option} is not supported (the record indexes one "
                                 "token stream of future-target blocks)")
        layers = [name.strip() for name in cfg.dual_form_record.split(",") if name.strip()]
        metadata = {"data": os.path.abspath(cfg.data), "tokens_per_sample": cfg.tokens_per_sample,
                    "sample_break_mode": str(cfg.sample_break_mode), "paper": "Irie, Csordas, Schmidhuber (2022), "
                    "The Dual Form of Neural Networks Revisited, Corollary 1"}
        return DualFormRecorder(model, layers, cfg.dual_form_dir, str(cfg.dual_form_dtype), self.dictionary.pad(),
                                self.dictionary.eos(), metadata)

    def _train_blocks(self):
        """[start, end) of every training sample in the token stream."""
        blocks = getattr(self.datasets["train"], "dataset", None)
        if not isinstance(blocks, TokenBlockDataset):
            raise TypeError("dual-form record: the train split is not a TokenBlockDataset")
        return blocks.slice_indices

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        step = super().train_step
        if self.recorder is None:
            return step(sample, model, criterion, optimizer, update_num, ignore_grad)
        return self.recorder.micro_batch(
            sample, self._train_blocks(), update_num, ignore_grad,
            lambda: step(sample, model, criterion, optimizer, update_num, ignore_grad))

    def optimizer_step(self, optimizer, model, update_num):
        if self.recorder is not None:
            self.recorder.before_step(optimizer, update_num)
        super().optimizer_step(optimizer, model, update_num)
