"""LoRA: the spec (``spec``, which the run config validates), the frozen base (``base``) and the
adapters themselves (``adapters``: injection through peft, checkpoints, merge, export).
"""
