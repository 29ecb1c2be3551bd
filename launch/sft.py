"""Supervised fine-tuning of LLaDA / Dream with MDLMPE on DeepSpeed ZeRO-3.

Embedded default (tiny LLaDA-family model + MDLMPE, the real Qwen2.5 tokenizer, real chat data
prepared offline; 2 CPU ranks; a few minutes)::

    deepspeed launch/sft.py --deepspeed ds_configs/zero3.json

On a CPU-only machine the `deepspeed` launcher starts one rank (one "device"); this script then
re-launches itself with 2 ranks under torchrun (set MDLMPE_DS_CPU_RANKS=1 to keep one). It runs
under `torchrun --nproc_per_node N launch/sft.py ...` as well.

A real model on a GPU node (bf16; batch sizes must agree with the ds config, or set them "auto")::

    deepspeed launch/sft.py --deepspeed ds_configs/zero3.json \\
        --model_name_or_path /models/LLaDA-8B-Instruct --dataset allenai/tulu-3-sft-mixture \\
        --max_len 2048 --lr 1e-5 --max_steps 2000 --output_dir outputs/llada-sft
    # multi-node: deepspeed --hostfile hostfile launch/sft.py --deepspeed ds_configs/zero3.json ...

Other flags: `--config run.json|yaml` (training config file; command-line keys override it),
`--dry-run` (validate config + batch arithmetic, build on the meta device, print the plan),
`--resume auto|PATH` (auto: the newest complete checkpoint in output_dir). Any training-config key
is `--section.key VALUE` or `--key VALUE` (see mdlmpe_ds/config.py).
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CPU_RANKS_ENV = "MDLMPE_DS_CPU_RANKS"
_LAUNCHER_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_SIZE",
    "CROSS_RANK",
    "CROSS_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "CUDA_VISIBLE_DEVICES",
)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=True)
    parser.add_argument(
        "--deepspeed", default=str(REPO / "ds_configs" / "zero3.json"), help="DeepSpeed JSON config"
    )
    parser.add_argument(
        "--local_rank",
        "--local-rank",
        type=int,
        default=None,
        help="set by launchers; ignored (the environment's LOCAL_RANK is the source of truth)",
    )
    parser.add_argument("--config", default=None, help="training config file (.json/.yaml)")
    parser.add_argument("--dry-run", "--dry_run", action="store_true", dest="dry_run")
    parser.add_argument("--resume", default=None, help="'auto' or a checkpoint directory")
    return parser.parse_known_args(argv)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _should_relaunch(args: argparse.Namespace) -> int:
    """Ranks to re-launch with (0 = run here): CPU-only, a single rank, not a dry run."""
    import torch

    if args.dry_run or torch.cuda.is_available():
        return 0
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        return 0
    ranks = int(os.environ.get(CPU_RANKS_ENV, "2"))
    return ranks if ranks > 1 else 0


def relaunch(ranks: int, argv: list[str]) -> int:
    """Run this script again under torchrun with `ranks` CPU processes; returns their exit code."""
    forwarded = [a for a in argv if not a.startswith("--local_rank") and not a.startswith("--local-rank")]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env.setdefault("OMP_NUM_THREADS", "1")
    env[CPU_RANKS_ENV] = "1"  # the children must not relaunch again
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        f"--master_port={_free_port()}",
        str(Path(__file__).resolve()),
        *forwarded,
    ]
    print(
        f"[launch/sft.py] CPU-only machine and 1 rank: re-launching with {ranks} ranks:\n  {shlex.join(cmd)}",
        flush=True,
    )
    return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, rest = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ranks = _should_relaunch(args)
    if ranks:
        return relaunch(ranks, argv)

    # DeepSpeed 0.19 calls torch.distributed APIs that torch 2.13 marks deprecated, once per step.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    from mdlmpe_ds import engine
    from mdlmpe_ds.config import build_config
    from mdlmpe_ds.trainer import NonFiniteError, run_sft

    run = build_config(args.config, rest)
    if args.dry_run:
        run_sft(run, args.deepspeed, resume=args.resume, dry_run=True)
        return 0
    with engine.distributed_session(run.train.dist_timeout_min):
        try:
            summary = run_sft(run, args.deepspeed, resume=args.resume)
        except NonFiniteError as err:
            print(f"[rank {engine.rank()}] stopping: {err}", file=sys.stderr, flush=True)
            return 3
        if engine.rank() == 0:
            out = Path(run.train.output_dir).resolve()
            print(
                f"\ndone: {summary['total_updates']} updates, final loss {summary['history'][-1]['loss']:.4f}"
                if summary["history"]
                else "\ndone: nothing left to train",
                f"\nTensorBoard logs: {out / 'tensorboard'}   (tensorboard --logdir {out / 'tensorboard'})"
                f"\ncheckpoints:      {out / 'checkpoints'} (last: {summary['last_checkpoint']})"
                f"\nresume with:      deepspeed launch/sft.py --deepspeed {args.deepspeed} "
                f"{' '.join(shlex.quote(a) for a in rest)} --resume auto".rstrip()
                + f"\nexport with:      python launch/export.py {out / 'checkpoints' / 'latest'} "
                f"{out / 'export'}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    exit_code = main()
    if "LOCAL_RANK" in os.environ:  # a worker under torchrun / the deepspeed launcher
        from mdlmpe_ds.engine import exit_after_teardown

        exit_after_teardown(exit_code)  # everything is written; skip gloo's racy C++ teardown
    sys.exit(exit_code)
