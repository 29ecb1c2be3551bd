"""Token-store benchmark: build throughput and a rank's memory against corpus size (1x vs 10x).

The corpus is Shakespeare's complete works (offline assets), one document per paragraph; the 10x
corpus is the same text ten times over (as more documents). For each size:

1. build: tokenise the corpus into a token store (data/token_store.py) with a real tokenizer,
   timed end to end (reading, tokenising, writing, fingerprinting): tokens/s and bytes per token;
2. a rank's memory: in a fresh process, the windows a training rank reads (every window, in a
   shuffled order, in micro-batches of 4 x 1024 tokens, collated): its peak RSS (VmHWM, reset
   after start-up) and what the data added to it (peak minus the RSS before the dataset was made).
   Three ways of holding the data:
   ``store``: the store as training reads it (``pread`` of each window);
   ``memmap``: slices of the read-only memory map (touched pages count as resident until evicted);
   ``in-memory``: the int64 stream the pipeline held before the store (what every rank held).

Prints one table; ratios compare the 10x and 1x corpus measured in the same run.

    python benchmarks/bench_data.py [--tokenizer gpt2|qwen] [--repeat 10] [--seq_len 1024] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

MODES = ("store", "memmap", "in-memory")


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    from mdlmpe_ds.data.assets import ensure_assets

    part = {"gpt2": "gpt2_tokenizer", "qwen": "qwen_tokenizer"}[name]
    paths = ensure_assets(parts=(part,))
    return AutoTokenizer.from_pretrained(str(getattr(paths, f"{part}_dir")))


def build(corpus: Path, tok_name: str, stores: Path, seq_len: int, workers: int) -> dict:
    from mdlmpe_ds.data.corpora import load_packed_corpus

    tok = _tokenizer(tok_name)
    start = time.perf_counter()
    ds = load_packed_corpus(
        str(corpus), tok, seq_len, split="paragraph", cache_dir=stores, role="train", workers=workers
    )
    seconds = time.perf_counter() - start
    path = ds.store.path
    disk = sum(f.stat().st_size for f in path.iterdir())
    return {
        "store": str(path),
        "tokens": int(ds.store.manifest["num_tokens"]),
        "documents": int(ds.store.manifest["num_documents"]),
        "dtype": ds.store.manifest["dtype"],
        "seconds": seconds,
        "tokens_per_s": ds.store.manifest["num_tokens"] / seconds,
        "disk_bytes": disk,
        "bytes_per_token": disk / ds.store.manifest["num_tokens"],
        "corpus_bytes": corpus.stat().st_size,
    }


def iterate(store_path: str, mode: str, seq_len: int, micro_batch: int) -> dict:
    """One rank's pass over every window (shuffled), in micro-batches; peak RSS added by it."""
    import numpy as np
    from proc_memory import reset_peak, status_kb

    from mdlmpe_ds.data.packing import PackedTokenDataset, packed_collate
    from mdlmpe_ds.data.token_store import TokenStore

    store = TokenStore.open(store_path)
    base = status_kb("VmRSS")
    reset_peak()
    if mode == "store":
        ds = PackedTokenDataset.from_store(store, seq_len)
    elif mode == "memmap":
        ds = PackedTokenDataset(store.tokens, store.doc_ends, seq_len, store.separator_id)
    else:
        stream = np.asarray(store.tokens, dtype=np.int64)  # the pre-store pipeline's int64 stream
        ds = PackedTokenDataset(stream, np.asarray(store.doc_ends), seq_len, store.separator_id)
    order = np.random.default_rng(0).permutation(len(ds))
    start = time.perf_counter()
    checksum = 0
    for i in range(0, len(order), micro_batch):
        batch = packed_collate([ds[int(j)] for j in order[i : i + micro_batch]])
        checksum += int(batch["input_ids"][:, 0].sum())
    seconds = time.perf_counter() - start
    return {
        "peak_rss_mb": status_kb("VmHWM") / 1024,
        "added_mb": (status_kb("VmHWM") - base) / 1024,
        "windows": len(ds),
        "windows_per_s": len(ds) / seconds,
        "checksum": checksum,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", default="gpt2", choices=("gpt2", "qwen"))
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1, help="tokenising processes of the build")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--_iterate", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._iterate:
        print(json.dumps(iterate(args._iterate[0], args._iterate[1], args.seq_len, args.micro_batch)))
        return 0

    from mdlmpe_ds.data.assets import ensure_assets

    text = ensure_assets(parts=("shakespeare",)).shakespeare("all").read_text(encoding="utf-8")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_data-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for scale in (1, args.repeat):
            corpus = work / f"shakespeare_x{scale}.txt"
            corpus.write_text("\n\n".join([text] * scale), encoding="utf-8")
            built = build(corpus, args.tokenizer, work / f"stores_x{scale}", args.seq_len, args.workers)
            for mode in MODES:
                cmd = [sys.executable, __file__, "--seq_len", str(args.seq_len), "--micro_batch",
                       str(args.micro_batch), "--_iterate", built["store"], mode]  # fmt: skip
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
                measured = json.loads(out.stdout.splitlines()[-1])
                rows.append({"scale": scale, "mode": mode, **built, **measured})
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)

    print(
        f"tokenizer {args.tokenizer}, windows of {args.seq_len}, micro-batches of {args.micro_batch}, "
        f"{args.workers} tokenising process(es), {os.cpu_count()} CPUs"
    )
    print(
        f"{'corpus':>7} {'mode':>9} {'tokens':>12} {'build s':>8} {'tok/s':>10} {'B/token':>8} "
        f"{'disk MB':>8} {'peak RSS MB':>12} {'added MB':>9} {'windows/s':>10}"
    )
    for r in rows:
        print(
            f"{r['scale']:>6}x {r['mode']:>9} {r['tokens']:>12,} {r['seconds']:>8.1f} "
            f"{r['tokens_per_s']:>10,.0f} {r['bytes_per_token']:>8.3f} {r['disk_bytes'] / 2**20:>8.1f} "
            f"{r['peak_rss_mb']:>12.1f} {r['added_mb']:>9.1f} {r['windows_per_s']:>10,.0f}"
        )
    by = {(r["scale"], r["mode"]): r for r in rows}
    big = args.repeat
    for mode in MODES:
        a, b = by[(1, mode)], by[(big, mode)]
        print(
            f"{mode:>9}: peak RSS {big}x / 1x = {b['peak_rss_mb'] / a['peak_rss_mb']:.2f} "
            f"(data's share: {a['added_mb']:.1f} MB -> {b['added_mb']:.1f} MB)"
        )
    a, b = by[(1, "store")], by[(big, "store")]
    print(f"build: {big}x / 1x tokens/s = {b['tokens_per_s'] / a['tokens_per_s']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
