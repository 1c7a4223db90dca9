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

    @classmethod
    def settle_options(cls, cfg):
        """Set the fairseq options that --fwp-* flags decide, in `cfg` (the model's arguments), as the model's
        builder does: fairseq builds a model whose arch is its model's name from a copy of its config, which
        then says otherwise (uptrain compares the config against the softmax checkpoint's)."""

    @staticmethod
    def finish(model):
        """The built model, its layers sharing one backend log."""
        share_backend_log(model)
        return model
