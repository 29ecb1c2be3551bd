"""Reading the kernel's own memory counters of this process (CPU benchmarks).

No torch import: the parent process of bench_sft_step uses it too."""

from __future__ import annotations


def status_kb(field: str) -> int:
    """A kB field of /proc/self/status (VmRSS: resident now, VmHWM: peak since the last reset)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (writing 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
