"""The fused Triton MDLMPE attention: ``backend`` (autograd.Function and launcher), ``kernels``
(the @triton.jit code, imported lazily), ``launch`` (launch settings per GPU), ``aot`` (ahead-of-time
compiles for a GPU target on a CPU-only machine). Importing this package imports no triton."""
