"""Dual form of linear layers trained by gradient descent (Irie, Csordas, Schmidhuber 2022).

A linear layer trained by plain SGD equals its initial weights plus
unnormalised attention over every (input, error) pair it saw (Corollary 1):

    W x = W_0 x + sum_t e_t (x_t . x),    e_t = -lr_t * dL/dy_t      (Eqs. 12-14)

The plugin keeps what a training run imports, one job each:
    exactness.py   when the identity is exact; refusals of other settings
    recorder.py    hooks that collect x_t and dL/dy_t per token during fairseq-train
    task.py        --task dual_form_language_modeling (--dual-form-record, --dual-form-dir)
    storage.py     the on-disk record (growing memory-mapped .npy files + manifest)

The analysis of a record lives beside the plugin, in examples/dual_form/ (python -m examples.dual_form
{verify,explain}, run from the repository root).

The package imports no fairseq at this level; fairseq_fwp/__init__.py
imports task.py to register the task.
"""
