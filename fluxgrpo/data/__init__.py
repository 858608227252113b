"""Prompts and their precomputed text embeddings: the prompt-file reader (``prompts``), the bundled prompt list
(``prompts.txt``), and DanceGRPO's embedding layout, written by ``preprocess`` and read by training (``embeddings``).
"""
