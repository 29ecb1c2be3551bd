"""Hub ids in: a model or tokenizer named ``org/name`` is read through ``snapshot_download``.

A local path always wins (an existing file or directory is never treated as an id). Otherwise the
name must look like a hub repo id and is fetched with ``huggingface_hub.snapshot_download``:
``revision`` (branch, tag or commit), only the files a model or tokenizer needs
(``allow_patterns``), the standard cache (``HF_HOME`` / ``HF_HUB_CACHE``) and token, and
``HF_HUB_OFFLINE=1`` honoured (then only the local cache is read). Under ``torch.distributed``
rank 0 downloads first and the other ranks then read the cache (``local_files_only``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What a model directory needs (config, weights, the modeling code of a remote-code checkpoint,
# the tokenizer files next to it); what a tokenizer needs.
MODEL_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.py",
    "*.model",
    "*.txt",
    "*.jinja",
    "*.tiktoken",
]
TOKENIZER_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]

# org/name, optionally @revision (a branch, tag or commit) for the tools without a --revision flag.
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(@[A-Za-z0-9_./-]+)?$")


class HubResolveError(ValueError):
    """A name that is neither a local path nor a hub id that could be resolved; says why."""


def looks_like_hub_id(name: str) -> bool:
    """``org/name[@rev]`` that is not an existing local path (``./x``, ``/abs``, ``a/b/c`` are paths)."""
    return bool(_REPO_ID.match(name)) and not Path(name).exists() and ".." not in name


def is_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "true", "yes", "on")


def _download(repo_id: str, revision: str | None, patterns: list[str], local_only: bool, what: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=patterns,
                local_files_only=local_only or is_offline(),
            )
        )
    except LocalEntryNotFoundError as err:
        where = "HF_HUB_OFFLINE is set" if is_offline() else "the hub could not be reached"
        raise HubResolveError(
            f"{what} {repo_id!r}{f' (revision {revision})' if revision else ''}: not a local directory, and "
            f"{where} and it is not in the local Hugging Face cache ({_cache_dir()}); download it once "
            f"online (huggingface-cli download {repo_id}) or pass a local directory"
        ) from err
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as err:
        raise HubResolveError(f"{what} {repo_id!r}: {type(err).__name__}: {err}") from err


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve(name: str, revision: str | None = None, what: str = "model", tokenizer: bool = False) -> Path:
    """A local directory for ``name``: the path itself, or the snapshot of hub id ``name``."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    if not looks_like_hub_id(name):
        raise HubResolveError(
            f"{what} {name!r}: no such local file or directory, and not a hub id of the form 'org/name'"
        )
    if "@" in name:
        name, at = name.split("@", 1)
        if revision and revision != at:
            raise HubResolveError(f"{what} {name!r}: revision {at!r} in the name but {revision!r} given")
        revision = at
    patterns = TOKENIZER_PATTERNS if tokenizer else MODEL_PATTERNS
    import torch.distributed as dist

    from mdlmpe_ds import collectives

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # Each node's first rank downloads into its (possibly node-local) cache; the others wait on
        # the setup group (train.setup_timeout_min: a download of 16 GB outlasts a training
        # collective's timeout), then only read the cache. A failure anywhere reaches every rank, so
        # none waits for a download that never comes.
        status = None
        if collectives.local_rank() == 0:
            try:
                _download(name, revision, patterns, False, what)
            except Exception as err:  # every rank raises it below
                status = f"{type(err).__name__}: {err}"
        failed = [s for s in collectives.all_gather_object(status, setup=True) if s is not None]
        if failed:
            raise HubResolveError(f"{what} {name!r}: rank 0 could not fetch it: {failed[0]}")
        return _download(name, revision, patterns, True, what)
    return _download(name, revision, patterns, False, what)


def resolve_model(name: str, revision: str | None = None) -> Path:
    return resolve(name, revision, "model")


def resolve_tokenizer(name: str, revision: str | None = None) -> Path:
    return resolve(name, revision, "tokenizer", tokenizer=True)


def split_dataset_name(source: str, config: str | None = None) -> tuple[str, str | None]:
    """'HuggingFaceTB/smoltalk:all' -> ('HuggingFaceTB/smoltalk', 'all'); an explicit ``config`` wins
    over none in the name, and two different ones are an error. Local paths are left whole."""
    name, named = source, None
    if ":" in source and not Path(source).exists():
        name, named = source.rsplit(":", 1)
    if config and named and config != named:
        raise ValueError(f"dataset {source!r} names config {named!r} but dataset_config is {config!r}")
    return name, config or named or None


def resolve_run_names(run) -> None:
    """Rewrite a run config's hub ids to local snapshot directories, in place (model, tokenizer,
    with ``model.revision``), and fold ``data.dataset_config`` into ``data.dataset`` as
    ``name:config`` (the form the data loaders read)."""
    m, d = run.model, run.data
    original_model = m.model_name_or_path
    if m.model_name_or_path is not None and not Path(m.model_name_or_path).exists():
        m.model_name_or_path = str(resolve_model(m.model_name_or_path, m.revision))
    if d.tokenizer is not None and not Path(d.tokenizer).exists():
        model_id = original_model.split("@", 1)[0] if original_model else None
        same_repo = model_id is not None and d.tokenizer.split("@", 1)[0] == model_id
        # model.revision pins the tokenizer too when it comes from the model's own repo
        d.tokenizer = str(resolve_tokenizer(d.tokenizer, m.revision if same_repo else None))
    if d.dataset_config:
        name, config = split_dataset_name(d.dataset, d.dataset_config)
        d.dataset, d.dataset_config = f"{name}:{config}", None
