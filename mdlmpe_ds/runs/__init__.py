"""Run assembly: from a RunConfig to a trained model. ``common`` holds what every run builds (model
config, output directory and resume point, model and engine, plan); ``sft`` and ``pretrain`` add
their data and task (their command lines are launch/sft.py and launch/pretrain.py).
"""
