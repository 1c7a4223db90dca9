"""Primal vs dual: does W0 x + sum_t e_t (x_t . x) reproduce the trained layer on held-out inputs?

For each recorded layer, the trained model (primal form, Eq. 13) is run on
the first tokens of a held-out split; the layer's actual outputs y are
compared with the dual form S2(x) of Eq. 14 computed from the record. The
relative error of a query is ||S2(x) - y|| / ||y||; the report gives its
maximum over the queries, and the relative Frobenius error of the rebuilt
weights (Eq. 12).
"""
import numpy as np

from .capture import held_out_rows, load_checkpoint
from .dual import dual_outputs, dual_weights


def verify_layer(record, model, task, layer, rows, subset, num_queries):
    record.check_layer(layer)
    queries, primal = held_out_rows(model, task, layer, record.manifest["layouts"][layer], subset, num_queries)
    dual = dual_outputs(record, layer, queries, rows)
    errors = np.linalg.norm(dual - primal, axis=1) / np.linalg.norm(primal, axis=1)
    module = model.get_submodule(layer)
    weight, bias = dual_weights(record, layer, rows)
    trained = module.weight.detach().double().numpy()
    report = {
        "queries": len(queries),
        "max_relative_error": float(errors.max()),
        "mean_relative_error": float(errors.mean()),
        "max_abs_error": float(np.abs(dual - primal).max()),
        "weight_relative_error": float(np.linalg.norm(weight - trained) / np.linalg.norm(trained)),
        "weight_change_relative": float(np.linalg.norm(trained - record.initial_weights(layer)[0])
                                        / np.linalg.norm(trained)),
    }
    if bias is not None:
        trained_bias = module.bias.detach().double().numpy()
        report["bias_relative_error"] = float(np.linalg.norm(bias - trained_bias) / np.linalg.norm(trained_bias))
    return report


def verify(record, checkpoint, layers=None, subset="valid", num_queries=256, data=None):
    model, task, num_updates = load_checkpoint(checkpoint, data)
    rows = record.rows_before(num_updates)
    layers = layers or record.layers
    return {
        "checkpoint": checkpoint,
        "num_updates": num_updates,
        "training_rows": rows,
        "subset": subset,
        "dtype": record.manifest["dtype"],
        "record_bytes": record.disk_bytes(),
        "bytes_per_token": record.manifest["bytes_per_token"],
        "layers": {layer: verify_layer(record, model, task, layer, rows, subset, num_queries) for layer in layers},
    }
