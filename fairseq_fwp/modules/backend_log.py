"""What runs a model's fast-weight ops where --fwp-backend did not name it (auto's choice, a named backend's
decoding that falls back to the rule's own step), and why: logged once per model."""
import logging

logger = logging.getLogger("fairseq_fwp.backend")


class BackendLog:
    """Logs each distinct line of ops.backends.Choice.log once; a model shares one among its layers."""

    def __init__(self):
        self.seen = set()

    def note(self, choice):
        if choice.log is not None:
            self.say(choice.log)

    def say(self, line):
        if line not in self.seen:
            self.seen.add(line)
            logger.info(line)


def share_backend_log(model):
    """One BackendLog for every fast-weight attention of `model`."""
    log = BackendLog()
    for module in model.modules():
        if hasattr(module, "backend_log"):
            module.backend_log = log
