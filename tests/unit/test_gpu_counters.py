"""benchmarks/gpu_cost/counters.py: Nsight Compute's raw CSV -> the counters the record holds."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from gpu_cost import counters, measured

COLUMNS = {
    "gpu__time_duration.sum": ("nsecond", "{ms}"),
    "launch__registers_per_thread": ("register/thread", "250"),
    "smsp__warps_active.avg.per_cycle_active": ("warp", "2.004"),
    "smsp__issue_active.avg.pct_of_peak_sustained_active": ("%", "31.44"),
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": ("%", "21.06"),
    "l1tex__throughput.avg.pct_of_peak_sustained_active": ("%", "50.01"),
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": ("%", "42.04"),
    "lts__t_sectors.sum": ("sector", "2,535,000,000"),
    "dram__bytes_read.sum": ("byte", "3,000,000,000"),
    "dram__bytes_write.sum": ("byte", "1,000,000,000"),
    "smsp__inst_executed.sum": ("inst", "6,294,000,000"),
    "smsp__sass_inst_executed_op_local_ld.sum": ("inst", "0"),
    "smsp__sass_inst_executed_op_shared_ld.sum": ("inst", "42,100,000"),
    "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio": ("ratio", "1.0"),
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": ("ratio", "{long}"),
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": ("ratio", "0.5"),
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio": ("ratio", "0.7"),
    "smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio": ("ratio", "0.2"),
}


def _csv(kernels: list[tuple[str, str, str]]) -> str:
    head = ["ID", "Kernel Name", "Grid Size", "Block Size", *COLUMNS]
    lines = ["==PROF== Connected to process 1", "==WARNING== a note ncu prints first"]
    lines.append(",".join(f'"{h}"' for h in head))
    lines.append(",".join(['""'] * 4 + [f'"{unit}"' for unit, _ in COLUMNS.values()]))
    for i, (name, ms_ns, long) in enumerate(kernels):
        values = [v.format(ms=ms_ns, long=long) for _, v in COLUMNS.values()]
        lines.append(
            ",".join(
                f'"{x}"' for x in [str(i), f"{name}(float*, int)", "(32, 32, 1)", "(256, 1, 1)", *values]
            )
        )
    return "\n".join(lines) + "\n"


def test_counters_read_the_first_launch_of_each_kernel_in_its_units():
    text = _csv(
        [
            ("phase_fwd_kernel", "735,000", "0.92"),
            ("mdlmpe_bwd_kernel", "19,881,000", "2.32"),
            ("phase_fwd_kernel", "999,000,000", "9.0"),  # the backward's recompute: the same launch
            ("some_other_kernel", "1", "1"),
        ]
    )
    got = counters.kernel_counters(text)
    assert set(got) == {"phase_forward", "backward"}
    assert got["phase_forward"]["ms"] == 0.735 and got["backward"]["ms"] == 19.881
    back = got["backward"]
    assert back["l2_gb"] == 81.12 and back["dram_gb"] == 4.0 and back["instructions_g"] == 6.294
    assert back["warps_per_scheduler"] == 2.0 and back["registers"] == 250 and back["grid"] == "(32, 32, 1)"
    # 'selected' (the issuing warp) is not a stall; the largest stalls come first
    assert back["top_stalls"] == [["long_scoreboard", 2.32], ["wait", 0.7], ["barrier", 0.5]]


def test_the_record_has_every_kernel_of_both_backends():
    record = measured.load(measured.COUNTERS)
    for part in ("previous", "current"):
        assert set(record[part]) == set(counters.KERNEL_NAMES.values()), part
        assert set(record["metrics"]) <= set(next(iter(record[part].values()))), part
