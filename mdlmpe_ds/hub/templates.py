"""The chat template training used, as the Jinja string an export's tokenizer carries.

SFT renders conversations with ``mdlmpe_ds.data.chat_templates`` (LLaDA's Llama-3 style or Dream's
ChatML, both honouring ``add_generation_prompt``), not with the upstream tokenizer's template (the
upstream LLaDA template always appends an assistant header). An export that kept the upstream
``tokenizer_config.json`` would make ``apply_chat_template`` render prompts differently from
training; ``write_chat_template`` puts the training renderer's Jinja equivalent in its place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mdlmpe_ds.data.chat_templates import template_for

# Same output as chat_templates.render_llada (content stripped like str.strip()).
LLADA_JINJA = (
    "{{ '<|startoftext|>' }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + (message['content'] | trim)"
    " + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# Same output as chat_templates.render_chatml (default system turn, content not stripped).
CHATML_JINJA = (
    "{% if not messages or messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
JINJA_BY_RENDERER = {"llada": LLADA_JINJA, "chatml": CHATML_JINJA}


def training_chat_template(family: str, tokenizer: Any) -> tuple[str, str | None]:
    """(renderer name, Jinja string) of the template SFT uses for ``family`` with ``tokenizer``;
    the Jinja is None when training used the tokenizer's own template (nothing to change)."""

    template = template_for(family, tokenizer)
    return template.name, JINJA_BY_RENDERER.get(template.name)


def write_chat_template(directory: str | Path, jinja: str) -> None:
    """Set ``chat_template`` in ``tokenizer_config.json`` and write ``chat_template.jinja``
    (transformers reads either; both say the same, so no reader can pick a stale one)."""
    directory = Path(directory)
    config_file = directory / "tokenizer_config.json"
    raw = {}
    if config_file.is_file():
        with open(config_file, encoding="utf-8") as fh:
            raw = json.load(fh)
    raw["chat_template"] = jinja
    with open(config_file, "w", encoding="utf-8") as fh:
        json.dump(raw, fh, indent=2, ensure_ascii=False)
    (directory / "chat_template.jinja").write_text(jinja, encoding="utf-8")
