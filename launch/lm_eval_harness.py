"""Benchmark a model with lm-evaluation-harness (``pip install -e '.[eval]'``): lm-eval's own
command line, with the ``mdlmpe`` model registered (mdlmpe_ds/evaluation/lm_eval_adapter.py)::

    python launch/lm_eval_harness.py run --model mdlmpe --device cuda \\
        --model_args pretrained=outputs/llada-sft/export,dtype=bf16,mc_num=128 \\
        --tasks mmlu,arc_challenge,hellaswag,gsm8k --batch_size 8 --output_path results/

Data parallel under torchrun (lm-eval shards the requests by rank, results gathered on rank 0)::

    torchrun --nproc_per_node 8 launch/lm_eval_harness.py run --model mdlmpe --device cuda \\
        --model_args pretrained=outputs/llada-sft/export,dtype=bf16 --tasks gsm8k --batch_size 8

Every argument is lm-eval's (``run --help``); the model's own options go in ``--model_args``. The
script is not named ``lm_eval.py``: this folder is first on ``sys.path`` and would hide the package.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from lm_eval.__main__ import cli_evaluate

import mdlmpe_ds.evaluation.lm_eval_adapter  # noqa: F401  (registers the "mdlmpe" model)
from mdlmpe_ds.distributed.process_group import exit_after_teardown


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's CLI (it reads ``sys.argv``; ``argv`` replaces the arguments when given)."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
    if "LOCAL_RANK" in os.environ:  # a torchrun worker: tear down the process group, then exit cleanly
        exit_after_teardown(0)
