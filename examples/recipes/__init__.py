"""The paper's experiments as commands: data preparation, the row table, training and evaluation.

    python -m examples.recipes.wmt14 {prepare,train,evaluate} ...       # Table 1
    python -m examples.recipes.wikitext103 {prepare,train,evaluate} ... # Tables 2-5
    python -m examples.recipes.small_real_data {multi30k,wikitext2} ... # runs on a CPU

Each step runs the real fairseq-* commands and prints them first, so every
result can be reproduced by hand. examples/ has a README per recipe.
"""
