"""What both fast-weight models add to their fairseq model class, beside the layers."""
from ..modules.backend_log import share_backend_log
from ..modules.feature_maps import start_training_step


class FastWeightModel:
    """A mixin before the fairseq model class: random features advance once per training forward of the
    whole model (not per layer call: --checkpoint-activations runs a layer twice), and every fast-weight
    attention shares one log of auto's backend choices."""

    def forward(self, *args, **kwargs):
        if self.training:
            start_training_step(self)
        return super().forward(*args, **kwargs)

    @staticmethod
    def finish(model):
        """The built model, its layers sharing one backend log."""
        share_backend_log(model)
        return model
