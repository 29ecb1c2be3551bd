"""Evaluation: model loading for inference, the conditional diffusion ELBO, and the lm-eval adapter.

``lm_eval_adapter`` imports lm-evaluation-harness (the ``eval`` extra); nothing here imports it
until that module is imported.
"""
