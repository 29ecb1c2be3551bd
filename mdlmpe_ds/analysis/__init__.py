"""Deterministic mechanism figures (paper Appendix F) and checkpoint diagnostics for MDLMPE.

``python -m mdlmpe_ds.analysis --help`` lists the commands; ``mechanism`` holds the numbers,
``plots`` the drawings, ``diagnostics`` the checkpoint part.
"""
