"""Masked-diffusion maths: the forward corruption process (``corruption``), training losses
(``losses``) and the diffusion-ELBO perplexity bound for evaluation (``elbo``). This package imports
nothing; import the submodules."""
