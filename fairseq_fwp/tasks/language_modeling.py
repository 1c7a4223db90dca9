"""Task `fwp_language_modeling`: fairseq's `language_modeling` (the same options, data and scores), whose
generation reads a prompt in one decoder call per layer (prompt_reading.py), and can continue a session
(--fwp-session, --fwp-session-file). fairseq's own task forces a prompt one token per step; give this one to fairseq-generate and
fairseq-interactive instead."""
from dataclasses import dataclass
from typing import Optional

from fairseq.tasks import register_task
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

from .prompt_reading import PromptReading, session_file_option, session_option


@dataclass
class FastWeightLanguageModelingConfig(LanguageModelingConfig):
    fwp_session: bool = session_option()
    fwp_session_file: Optional[str] = session_file_option()


@register_task("fwp_language_modeling", dataclass=FastWeightLanguageModelingConfig)
class FastWeightLanguageModelingTask(PromptReading, LanguageModelingTask):
    pass
