"""Pretrain a masked diffusion LM from scratch on packed text, on DeepSpeed ZeRO-3.

Embedded default (tiny LLaDA-family model with MDLMPE, a SentencePiece tokenizer trained on the
corpus, Shakespeare's works prepared offline, held-out works for validation; 2 CPU ranks; ~2 min)::

    deepspeed launch/pretrain.py --deepspeed ds_configs/zero3.json

The paper's 100M setting (Appendix B recipe: lr 1e-4, AdamW 0.9/0.999, wd 0.01, cosine, 2K warmup,
global batch 16, L 1024, 200K steps) on a GPU node, OpenWebText streamed from the hub into a token
store once (rank 0; the other ranks wait, then map it), its held-out slice for validation::

    deepspeed launch/pretrain.py --deepspeed ds_configs/zero3.json --preset llada-100m \\
        --dataset openwebtext --validation openwebtext --store_dir /scratch/token_stores \\
        --position_encoding mdlmpe --output_dir outputs/llada-100m-mdlmpe

(``--store_dir`` shared by the runs of a comparison tokenises OWT once; docs/results.md "Token stores"
gives its disk size, build time and memory per rank.)

Position encodings: ``--position_encoding rope|alibi|absolute|mdlmpe``; MDLMPE ablations through
``--mdlmpe '{"use_gaussian": false}'`` (pe/config.py keys). Corpora (``--dataset``, ``--validation``):
a named offline corpus (shakespeare, shakespeare-heldout, ptb, enwiki-excerpt, news-excerpt,
botchan), a named hub corpus of the paper (openwebtext, wikitext-2, wikitext-103, lm1b, text8;
``name@split`` picks a split), local .txt files or a directory, a .jsonl/.parquet file, or a hub
dataset (mdlmpe_ds/data/corpora.py). Every run of the same seed and data draws the same masks for the
same window, whatever the encoding. Other flags as launch/sft.py: ``--config``, ``--dry-run``,
``--resume auto|PATH``, any training-config key as ``--section.key VALUE`` / ``--key VALUE``.
"""

from __future__ import annotations

import sys

from mdlmpe_ds import launching  # light: no torch / DeepSpeed import at module level


def main(argv: list[str] | None = None, faults=None) -> int:
    """The command line of mdlmpe_ds/runs/pretrain.py (``faults``: test hooks, mdlmpe_ds/faults.py)."""
    from mdlmpe_ds.faults import NO_FAULTS
    from mdlmpe_ds.runs.pretrain import main as pretrain_main

    argv = sys.argv[1:] if argv is None else argv
    return pretrain_main(
        argv, script=__file__, description=__doc__.split("\n\n")[0], faults=faults or NO_FAULTS
    )


if __name__ == "__main__":
    launching.exit_process(main())
