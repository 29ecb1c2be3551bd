"""Local directories laid out like hub dataset repositories, for the named hub corpora's tests
(``MDLMPE_DS_HUB_DATASETS`` points at their root)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_hub_dataset(
    root: Path, repo: str, configs: dict[str, dict[str, list[dict]]], shards: int = 3
) -> Path:
    """``root/repo`` laid out like a hub dataset repository: a README whose YAML ``configs`` map
    each config's splits to parquet shards ``<config>/<split>-0000i-of-0000n.parquet``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = root / repo
    lines = ["---", "configs:"]
    for config, splits in configs.items():
        lines += [f"- config_name: {config}", "  data_files:"]
        for split, rows in splits.items():
            (base / config).mkdir(parents=True, exist_ok=True)
            parts = np.array_split(np.arange(len(rows)), shards)
            for i, idx in enumerate(parts):
                table = pa.Table.from_pylist([rows[j] for j in idx]) if len(idx) else None
                if table is not None:
                    pq.write_table(table, base / config / f"{split}-{i:05d}-of-{shards:05d}.parquet")
            lines += [f"  - split: {split}", f"    path: {config}/{split}-*"]
    lines.append("---")
    (base / "README.md").write_text("\n".join(lines) + "\n")
    return base
