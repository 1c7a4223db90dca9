"""Synthetic associative retrieval (paper Sec. 6.1, Figures 2, 3 and 5). See README.md."""
