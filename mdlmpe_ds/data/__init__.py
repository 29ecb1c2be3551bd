"""Data: offline assets (``assets``: ``ensure_assets``; ``python launch/prepare_data.py assets``),
tokenizers (``tokenizers``), packed pretraining sequences (``pretrain``) and the SFT pipeline
(``sft``, ``sampler``). Submodules are imported explicitly; this package imports nothing."""
