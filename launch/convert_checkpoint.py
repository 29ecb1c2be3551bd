"""Convert a checkpoint for a resume on another data-parallel world size.

ZeRO-3 shards are tied to the world size that wrote them. A resume on another world size stops
with this command in its message; run it once on the step directory, then resume again (the
universal copy, ``ds_universal/`` beside ``ds/``, is picked up automatically)::

    python launch/convert_checkpoint.py to-universal outputs/sft-demo/checkpoints/step_000002

The conversion is DeepSpeed's ds_to_universal in this one process (no GPU, no process group;
mdlmpe_ds/distributed/engine.py), written like a checkpoint (mdlmpe_ds/training/checkpointer.py,
``write_universal``): into ``ds_universal.converting/``, sealed with its own manifest and COMPLETE,
then renamed into place. A killed conversion leaves no copy; run the command again (it removes what
the killed one left). It sits beside launch/export.py, not inside it: an export writes a
transformers directory for inference elsewhere, while this writes a training-side copy inside the
checkpoint, for the same trainer.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from mdlmpe_ds.training.checkpoint import resolve_checkpoint
from mdlmpe_ds.training.checkpointer import write_universal


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python launch/convert_checkpoint.py", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    universal = sub.add_parser("to-universal", help="DeepSpeed's universal copy of a ZeRO-3 checkpoint")
    universal.add_argument("checkpoint", type=Path, help="a step directory (checkpoints/step_NNNNNN)")
    args = parser.parse_args(argv)
    try:
        step = resolve_checkpoint(args.checkpoint)
    except (FileNotFoundError, ValueError) as err:  # no such checkpoint, or a damaged one
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"universal checkpoint written to {write_universal(step)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
