"""GPU runbook (`make gpu-check`): what to run the day a CUDA GPU is lent, in order.

  [1/4] the memory plan of the smoke run below (meta device, runs anywhere): the per-GPU figures
        the smoke run's measured peak is compared with;
  --- no CUDA device: print "no GPU: stopping" and exit 0 (nothing above needed one) ---
  [2/4] tests/gpu (the compiled Triton kernel against the reference, bf16, L = 4096);
  [3/4] benchmarks/bench_attention_gpu.py (Triton vs blocked vs flash RoPE, one LLaDA-8B layer;
        each Triton kernel's time, the layer and the step ratio beside the cost model's estimate);
  [4/4] a 3-update ZeRO-3 SFT smoke run on 1 GPU: LLaDA-8B widths cut to 2 layers
        (preset llada-8b-2layers), random init, bf16, MDLMPE with the Triton backend, LLaDA's
        126,464-token vocabulary, every batch padded to L; then tokens/s and the peak GPU memory
        of each update next to the plan.

Offline on purpose: the smoke run uses the word-level tokenizer and chat file of
mdlmpe_ds/data/smoke.py (the dist tests' inputs) with the vocabulary widened to LLaDA's, so the LM
head has its real shape without downloading anything.

    python launch/gpu_check.py                       # all steps (exit 0 after step 1 without a GPU)
    python launch/gpu_check.py --length 4096 --micro-batch 1 --skip-bench
Exit status: 0 all steps passed (or no GPU), 1 a step failed (named in the summary).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NO_GPU_MESSAGE = "no GPU: stopping (steps 2-4 need a CUDA device; the plan above is what they check)"


def smoke_flags(data_dir: Path, length: int, micro_batch: int, output_dir: Path) -> list[str]:
    """launch/sft.py flags of the smoke run (also used for its dry-run plan)."""
    from mdlmpe_ds.data.smoke import make_chat, make_tokenizer

    tokenizer = data_dir / "tokenizer"
    chat = data_dir / "chat.jsonl"
    if not tokenizer.is_dir():
        make_tokenizer(tokenizer)
    if not chat.is_file():
        make_chat(chat, rows=64)
    return [
        "--tokenizer", str(tokenizer), "--dataset", str(chat),
        "--preset", "llada-8b-2layers", "--vocab_size", "126464",
        "--position_encoding", "mdlmpe", "--attention.backend", "triton",
        "--precision", "bf16", "--max_len", str(length), "--pad_to_multiple_of", str(length),
        "--micro_batch_size", str(micro_batch), "--grad_accum", "1", "--max_steps", "3",
        "--save_every", "1000", "--log_every", "1", "--output_dir", str(output_dir),
    ]  # fmt: skip


def plan(flags: list[str], deepspeed_config: Path) -> float:
    """[1/4]: the dry run of the smoke run (prints model, batch and memory plan); returns the
    plan's total GiB per GPU."""
    from mdlmpe_ds.config.cli import build_config
    from mdlmpe_ds.runs.sft_run import run_sft

    os.environ.setdefault("WORLD_SIZE", "1")
    run = build_config(None, flags)
    return float(run_sft(run, str(deepspeed_config), dry_run=True)["memory_gib"])


def _step(name: str, command: list[str], env: dict[str, str] | None = None) -> bool:
    print(f"\n$ {' '.join(command)}", flush=True)
    proc = subprocess.run(command, cwd=REPO, env={**os.environ, **(env or {})}, check=False)
    if proc.returncode:
        print(f"{name}: FAILED (exit {proc.returncode})", flush=True)
    return proc.returncode == 0


def smoke_report(output_dir: Path, planned_gib: float) -> None:
    """Tokens/s and peak memory per update from the run's metrics.jsonl, next to the plan."""
    from mdlmpe_ds.training.memory_plan import CUDA_OVERHEAD_BYTES, GIB

    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    allocated_plan = planned_gib - CUDA_OVERHEAD_BYTES / GIB  # max_memory_allocated has no context
    for line in lines:
        row = json.loads(line)
        peak = row.get("memory/peak_gb", float("nan"))
        print(
            f"update {row.get('step')}: {row.get('train/tokens_per_s', float('nan')):,.0f} tokens/s, "
            f"peak allocated {peak:.2f} GiB vs plan {allocated_plan:.2f} GiB without the context allowance "
            f"({peak / allocated_plan:.2f}x)",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--length", type=int, default=2048, help="L of the smoke run (every batch padded to it)"
    )
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--deepspeed", type=Path, default=REPO / "ds_configs" / "zero3.json")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    args = parser.parse_args(argv)
    from mdlmpe_ds.training.log_setup import configure

    configure()

    import torch

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = args.workdir or Path(tmp)
        output_dir = work / "smoke"
        flags = smoke_flags(work / "data", args.length, args.micro_batch, output_dir)
        print(f"[1/4] memory plan of the smoke run (1 GPU, micro-batch {args.micro_batch} x L {args.length})")
        planned = plan(flags, args.deepspeed)
        if not torch.cuda.is_available():
            print(NO_GPU_MESSAGE, flush=True)
            return 0
        print(f"GPU: {torch.cuda.get_device_name()}", flush=True)
        failed = []
        if not args.skip_tests and not _step(
            "tests/gpu", [sys.executable, "-m", "pytest", "-q", "tests/gpu"]
        ):
            failed.append("tests/gpu")
        bench = [sys.executable, "benchmarks/bench_attention_gpu.py", "--json", str(work / "bench_gpu.json")]
        if not args.skip_bench and not _step("benchmark", bench):
            failed.append("benchmarks/bench_attention_gpu.py")
        print(f"\n[4/4] smoke run: {args.micro_batch} x {args.length} tokens, 3 updates", flush=True)
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
        command = [*launch, "launch/sft.py", "--deepspeed", str(args.deepspeed), *flags]
        if _step("smoke run", command, {"PYTHONPATH": str(REPO)}):
            smoke_report(output_dir, planned)
        else:
            failed.append("smoke run")
        print(
            "\nsummary: " + ("all steps passed" if not failed else "FAILED: " + ", ".join(failed)), flush=True
        )
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
