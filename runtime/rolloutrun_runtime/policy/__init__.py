"""The policy: a character tokenizer, a tiny causal transformer and its generation service.

Everything here is sized for CPU runs of the examples (a run learns in minutes on 2 cores);
the same code runs on CUDA when ``policy.device`` picks it.
"""
