"""Deterministic mechanism figures (paper Appendix F) and checkpoint diagnostics for MDLMPE.

``python launch/analyze.py --help`` lists the commands; ``mechanism`` holds the numbers,
``figures`` each figure's geometry and output, ``plots`` the drawings, ``diagnostics`` the
checkpoint part.
"""
