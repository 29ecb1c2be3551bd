"""What turns a saved checkpoint directory into one the ecosystem can load.

``finish_export`` adds, next to config.json and the safetensors written by ``hf_io.save_pretrained``:
1. ``modeling_mdlmpe.py`` and ``auto_map`` (``AutoModel`` / ``AutoModelForMaskedLM`` with
   ``trust_remote_code=True`` load it, MDLMPE included);
2. the run's tokenizer files;
3. the chat template training used, in ``tokenizer_config.json`` and ``chat_template.jinja``.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from mdlmpe_ds.hub.remote_code import install_remote_code
from mdlmpe_ds.hub.templates import training_chat_template, write_chat_template

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "added_tokens.json",
)


def finish_export(out: str | Path, family: str, tokenizer_dir: str | Path | None) -> dict[str, object]:
    """Remote code + tokenizer + training chat template into ``out``; returns what was done."""
    out = Path(out)
    install_remote_code(out, family)
    copied: list[str] = []
    template = None
    if tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file():
                shutil.copy2(src, out / name)
                copied.append(name)
        from transformers import AutoTokenizer

        from mdlmpe_ds.models.hf_config import tokenizer_load_options

        tokenizer = AutoTokenizer.from_pretrained(
            str(tokenizer_dir), trust_remote_code=False, **tokenizer_load_options(tokenizer_dir)
        )
        try:
            template, jinja = training_chat_template(family, tokenizer)
        except ValueError as err:  # a pretraining tokenizer may have no chat template at all
            logger.info("export: no chat template (%s)", err)
            jinja = None
        if jinja is not None:
            write_chat_template(out, jinja)
    return {"tokenizer_files": copied, "chat_template": template}


def push_to_hub(
    out: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
) -> str:
    """Upload the export directory through ``huggingface_hub``; the repo is created if missing.
    Token and endpoint come from the standard places (HF_TOKEN, ``hf auth login``, HF_ENDPOINT)."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    commit = api.upload_folder(folder_path=str(out), repo_id=repo_id, revision=revision)
    return str(getattr(commit, "commit_url", commit))
