"""Nsight Compute's raw CSV (``ncu --csv --page raw``, the command in
``benchmarks/profile_kernels_gpu.py``) -> the per-kernel counters ``counters_h100.json`` records:
the quantities the cost model's terms stand for (time, warps per scheduler, issue and FMA-pipe
activity, L1 and L2 throughput, L2 and DRAM bytes, spill reloads, the largest stalls).

    python -m gpu_cost.counters ncu.csv > kernels.json      # from benchmarks/
"""

from __future__ import annotations

import csv
import io
import json
import sys

#: Triton kernel names -> the cost model's kernel names.
KERNEL_NAMES = {
    "pair_bias_fwd_kernel": "pair_forward",
    "pair_bias_bwd_q_kernel": "pair_backward_q",
    "pair_bias_bwd_k_kernel": "pair_backward_k",
    "phase_fwd_kernel": "phase_forward",
    "mdlmpe_fwd_kernel": "forward",
    "mdlmpe_bwd_kernel": "backward",
    "phase_bwd_kernel": "phase_backward",
}
STALL_PREFIX = "smsp__average_warps_issue_stalled_"


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def rows(csv_text: str) -> list[dict[str, str]]:
    """The kernel rows of a raw-page CSV (ncu prints its own notes before the header; the line
    after the header holds the units)."""
    start = csv_text.index('"ID"')
    table = list(csv.reader(io.StringIO(csv_text[start:])))
    return [dict(zip(table[0], row)) for row in table[2:] if row]


def kernel_counters(csv_text: str) -> dict[str, dict]:
    """{model kernel name: counters} of the first launch of each kernel (the phase forward runs twice
    in one fwd + bwd, the same launch both times)."""
    out: dict[str, dict] = {}
    for row in rows(csv_text):
        name = KERNEL_NAMES.get(row["Kernel Name"].split("(")[0].strip())
        if name is None or name in out:
            continue
        stalls = {
            key[len(STALL_PREFIX) :].split("_per_")[0]: _number(value)
            for key, value in row.items()
            if key.startswith(STALL_PREFIX)
        }
        stalls.pop("selected", None)  # the issuing warp, not a stall
        top = sorted(stalls.items(), key=lambda item: -item[1])[:3]
        out[name] = {
            "ms": round(_number(row["gpu__time_duration.sum"]) / 1e6, 3),
            "grid": row["Grid Size"],
            "block": row["Block Size"],
            "registers": int(_number(row["launch__registers_per_thread"])),
            "warps_per_scheduler": round(_number(row["smsp__warps_active.avg.per_cycle_active"]), 2),
            "issue_active_pct": round(_number(row["smsp__issue_active.avg.pct_of_peak_sustained_active"]), 1),
            "fma_pipe_pct": round(
                _number(row["sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"]), 1
            ),
            "l1tex_pct": round(_number(row["l1tex__throughput.avg.pct_of_peak_sustained_active"]), 1),
            "l2_pct": round(_number(row["lts__throughput.avg.pct_of_peak_sustained_elapsed"]), 1),
            "l2_gb": round(_number(row["lts__t_sectors.sum"]) * 32 / 1e9, 2),
            "dram_gb": round(
                (_number(row["dram__bytes_read.sum"]) + _number(row["dram__bytes_write.sum"])) / 1e9, 2
            ),
            "instructions_g": round(_number(row["smsp__inst_executed.sum"]) / 1e9, 3),
            "local_loads_m": round(_number(row["smsp__sass_inst_executed_op_local_ld.sum"]) / 1e6, 1),
            "shared_loads_m": round(_number(row["smsp__sass_inst_executed_op_shared_ld.sum"]) / 1e6, 1),
            "top_stalls": [[reason, round(value, 2)] for reason, value in top],
        }
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        print(json.dumps(kernel_counters(fh.read()), indent=1))
