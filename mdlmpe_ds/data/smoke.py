"""Tiny offline SFT inputs: a word-level tokenizer with the ChatML and Qwen special tokens (so the
family templates apply unchanged) and a `messages` JSONL file of short dialogues.

Real words, real template, real collator; only the vocabulary is tiny (~100 tokens), so a step takes
milliseconds instead of a 151k-way softmax. The GPU runbook's smoke run (launch/gpu_check.py, with
the vocabulary widened to LLaDA's) and the tests build their inputs here, so both work from an
installed package without the repository's tests/ folder.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "[UNK]"]
WORDS = [
    "you",
    "are",
    "a",
    "helpful",
    "assistant",
    ".",
    "system",
    "user",
    "what",
    "is",
    "the",
    "color",
    "of",
    "sky",
    "sea",
    "grass",
    "sun",
    "snow",
    "night",
    "it",
    "blue",
    "green",
    "yellow",
    "white",
    "black",
    "how",
    "many",
    "legs",
    "does",
    "dog",
    "cat",
    "bird",
    "spider",
    "have",
    "four",
    "two",
    "eight",
    "tell",
    "me",
    "about",
    "your",
    "name",
    "my",
    "i",
    "am",
    "called",
    "friend",
    "hello",
    "hi",
    "good",
    "morning",
    "evening",
    "thanks",
    "thank",
    "welcome",
    "?",
    ",",
    "!",
    "yes",
    "no",
    "maybe",
    "please",
    "say",
    "again",
    "number",
    "one",
    "three",
    "five",
    "six",
    "seven",
    "nine",
    "ten",
    "are",
]
QA = [
    (
        "what is the color of the {x} ?",
        {"sky": "blue", "sea": "blue", "grass": "green", "sun": "yellow", "snow": "white", "night": "black"},
    ),
    ("how many legs does a {x} have ?", {"dog": "four", "cat": "four", "bird": "two", "spider": "eight"}),
]

# ChatML as Qwen2.5 renders it (default system prompt when the dialogue has none).
CHATML = (
    "{% if messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nyou are a helpful assistant .<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(set(WORDS)) + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("\n", behavior="isolated"), pre_tokenizers.WhitespaceSplit()]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="[UNK]",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHATML
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(directory)
    return directory


def make_chat(path: Path, rows: int = 64, seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = []
    for i in range(rows):
        template, answers = QA[i % len(QA)]
        x = rng.choice(sorted(answers))
        messages = [
            {"role": "user", "content": template.format(x=x)},
            {"role": "assistant", "content": f"it is {answers[x]} ." if i % 2 else f"{answers[x]} ."},
        ]
        if i % 5 == 0:  # some multi-turn dialogues
            messages = [
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "hi ! how are you ?"},
                *messages,
            ]
        lines.append(json.dumps({"messages": messages}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
