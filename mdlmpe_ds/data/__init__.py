"""Data: offline assets (``assets``: ``ensure_assets``, ``python -m mdlmpe_ds.data.assets prepare``),
tokenizers (``tokenizers``), packed pretraining sequences (``pretrain``) and the SFT pipeline
(``sft``, ``sampler``). Submodules are imported explicitly; this package imports nothing."""
