"""The training side of a run: the loop and its callbacks, the checkpoint format and the save and
resume protocol, and what a run logs, plans and does when it is told to stop.

Its modules sit on different layers (tests/unit/test_layering.py checks each on its own): the
callbacks over the loop, the loop over the checkpointer, the checkpointer over the format.
"""
