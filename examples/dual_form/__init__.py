"""The analysis of a dual-form record (fairseq_fwp/dual_form writes it during training), one job each:

    dual.py        the dual-form computations (attention weights, outputs, weights)
    capture.py     inputs/outputs of a layer of a trained checkpoint on held-out text
    corpus.py      the training token stream, its documents and passages
    verify.py      primal vs dual output on held-out inputs
    explain.py     top-k training passages and per-document attention of a test position
    plot.py        PNG of the attention distribution
    __main__.py    python -m examples.dual_form {verify,explain}
    wikitext2_demo.py  the whole demonstration on WikiText-2
"""
