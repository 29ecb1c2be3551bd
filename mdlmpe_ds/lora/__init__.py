"""LoRA: the spec (``spec``, which the run config validates), the frozen base (``base``), the
adapters (``adapters``: injection through peft, names, counts), a run's model made ready
(``attach``), LoRA checkpoints (``checkpoints``) and export (``export``: merge, adapter directories).
"""
