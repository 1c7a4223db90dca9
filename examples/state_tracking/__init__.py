"""State tracking: the ability that separates the delta rule's forms, as the retrieval benchmark cannot.

Grazzi et al. (2024): a linear RNN whose transitions have eigenvalues in [0, 1] cannot solve parity; with
beta in (0, 2) the delta rule's eigenvalues reach [-1, 1] and it can. Siems et al. (2025, DeltaProduct): a
product of N = 2 Householder transitions per token lets one layer track the non-commutative group S3.

    tasks.py    parity, counting mod 3, the S3 word problem: sequences and the state after every token
    model.py    a one-layer model: embedding, one attention (fast-weight, or causal softmax), MLP, readout
    rows.py     the rows compared: softmax, the sum rule, delta and gated delta in [0, 1] and [-1, 1],
                DeltaProduct N = 2 and 3 in [-1, 1]
    __main__.py python -m examples.state_tracking --out DIR: trains every row on short sequences, tests it on
                longer ones, writes results.json, a table and state_tracking.png
"""
