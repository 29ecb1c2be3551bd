"""Small, fast SFT inputs for the 2-process DeepSpeed tests: the library's offline smoke inputs
(mdlmpe_ds/data/smoke.py), re-exported under the name the tests import.

    python tests/dist/sft_fixtures.py DIR   # writes DIR/tokenizer and DIR/chat.jsonl
"""

from __future__ import annotations

import sys
from pathlib import Path

from mdlmpe_ds.data.smoke import CHATML, QA, SPECIALS, WORDS, make_chat, make_tokenizer

__all__ = ["CHATML", "QA", "SPECIALS", "WORDS", "make_chat", "make_tokenizer"]

if __name__ == "__main__":
    root = Path(sys.argv[1])
    make_tokenizer(root / "tokenizer")
    make_chat(root / "chat.jsonl")
    print(root)
