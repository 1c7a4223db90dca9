"""Which backend --fwp-backend auto chose for a model's fast-weight ops, and why: logged once per model."""
import logging

logger = logging.getLogger("fairseq_fwp.backend")


class BackendLog:
    """Logs each distinct choice of "auto" once (ops.backends.Choice); a model shares one among its layers."""

    def __init__(self):
        self.seen = set()

    def note(self, choice):
        if choice.reason != "named" and (choice.name, choice.reason) not in self.seen:
            self.seen.add((choice.name, choice.reason))
            logger.info(f"--fwp-backend auto runs {choice.name} ({choice.reason})")


def share_backend_log(model):
    """One BackendLog for every fast-weight attention of `model`."""
    log = BackendLog()
    for module in model.modules():
        if hasattr(module, "backend_log"):
            module.backend_log = log
