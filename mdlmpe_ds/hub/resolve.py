"""Hub ids in: a model or tokenizer named ``org/name`` is read through ``snapshot_download``.

A local path always wins (an existing file or directory is never treated as an id). Otherwise the
name must look like a hub repo id and is fetched with ``huggingface_hub.snapshot_download``:
``revision`` (branch, tag or commit), only the files a model or tokenizer needs
(``allow_patterns``), the standard cache (``HF_HOME`` / ``HF_HUB_CACHE``) and token, and
``HF_HUB_OFFLINE=1`` honoured (then only the local cache is read). Under ``torch.distributed``
rank 0 downloads first and the other ranks then read the cache (``local_files_only``).

A run's config keeps the names the user gave (hub ids and ``model.revision``), never the snapshot
directories they resolve to: those are machine-local cache paths, and a checkpoint's config must
reproduce the run on another machine. ``local_run`` returns a copy with the local directories to
build from; ``recorded_tokenizer`` is the tokenizer name a checkpoint records; ``resolution`` is
what the names resolved to on this machine, which a checkpoint records beside the config as written.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mdlmpe_ds.distributed import collectives

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
# A snapshot folder of the Hugging Face cache is named by its commit: .../snapshots/<40 hex>.
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
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
            f"online (hf download {repo_id}{f' --revision {revision}' if revision else ''}) or pass a "
            "local directory"
        ) from err
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as err:
        raise HubResolveError(f"{what} {repo_id!r}: {type(err).__name__}: {err}") from err


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve(
    name: str,
    revision: str | None = None,
    what: str = "model",
    tokenizer: bool = False,
    patterns: list[str] | None = None,
) -> Path:
    """A local directory for ``name``: the path itself, or the snapshot of hub id ``name`` (only the
    files ``patterns`` match; default: what a model or a tokenizer needs)."""
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
    patterns = patterns or (TOKENIZER_PATTERNS if tokenizer else MODEL_PATTERNS)
    import torch.distributed as dist

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


def cached_config(name: str, revision: str | None = None) -> Path | None:
    """``name``'s config.json without any download: in the local directory, or in the hub cache for
    a hub id (``org/name[@rev]``); None when it is not there (e.g. a hub id not fetched yet)."""
    path = Path(name).expanduser()
    if not path.exists():
        if not looks_like_hub_id(name):
            return None
        repo, _, pinned = name.partition("@")
        try:
            path = _download(repo, revision or pinned or None, ["config.json"], True, "model")
        except HubResolveError:
            return None
    file = path / "config.json"
    return file if file.is_file() else None


def resolve_model(name: str, revision: str | None = None) -> Path:
    return resolve(name, revision, "model")


def resolve_tokenizer(name: str, revision: str | None = None) -> Path:
    return resolve(name, revision, "tokenizer", tokenizer=True)


def resolve_config(name: str, revision: str | None = None) -> Path:
    """A directory holding ``name``'s config.json: the local directory, or a snapshot with only
    ``config.json`` fetched (a dry run plans from it; no weights, no tokenizer)."""
    return resolve(name, revision, "model", patterns=["config.json"])


def split_dataset_name(source: str, config: str | None = None) -> tuple[str, str | None]:
    """'HuggingFaceTB/smoltalk:all' -> ('HuggingFaceTB/smoltalk', 'all'); an explicit ``config`` wins
    over none in the name, and two different ones are an error. Local paths are left whole."""
    name, named = source, None
    if ":" in source and not Path(source).exists():
        name, named = source.rsplit(":", 1)
    if config and named and config != named:
        raise ValueError(f"dataset {source!r} names config {named!r} but dataset_config is {config!r}")
    return name, config or named or None


def folded_dataset(source: str, config: str | None) -> str:
    """``source`` with its config name: 'org/x' + 'all' -> 'org/x:all' (unchanged without one)."""
    name, named = split_dataset_name(source, config)
    return f"{name}:{named}" if named and config else source


def _tokenizer_revision(run) -> str | None:
    """``model.revision`` pins the tokenizer too when it comes from the model's own repo."""
    m, d = run.model, run.data
    if d.tokenizer is None or m.model_name_or_path is None:
        return m.revision
    same_repo = d.tokenizer.split("@", 1)[0] == m.model_name_or_path.split("@", 1)[0]
    return m.revision if same_repo else None


def local_run(run, config_only: bool = False):
    """A copy of ``run`` whose model and tokenizer hub ids are replaced by local snapshot directories
    (rank 0 downloads first), ``data.dataset_config`` folded into ``data.dataset`` as ``name:config``
    (the form the data loaders read; the command line builds it so already); ``run`` itself is never
    changed. ``config_only``: fetch the model's config.json alone and leave the tokenizer unresolved."""
    import copy

    local = copy.deepcopy(run)
    m, ld = local.model, local.data
    if ld.dataset_config:
        ld.dataset, ld.dataset_config = folded_dataset(ld.dataset, ld.dataset_config), None
    if m.model_name_or_path is not None and not Path(m.model_name_or_path).exists():
        fetch = resolve_config if config_only else resolve_model
        m.model_name_or_path = str(fetch(m.model_name_or_path, m.revision))
    if not config_only and ld.tokenizer is not None and not Path(ld.tokenizer).exists():
        ld.tokenizer = str(resolve_tokenizer(ld.tokenizer, _tokenizer_revision(run)))
    return local


def recorded_tokenizer(run, tokenizer_dir: str | Path) -> str:
    """The tokenizer name a checkpoint records: the hub id the run names (``id@revision`` when a
    revision pins it), else the local directory actually read (a user's folder or the demo's)."""
    name = run.data.tokenizer if run.data.tokenizer is not None else run.model.model_name_or_path
    if name is None or Path(name).exists() or not looks_like_hub_id(name):
        return str(tokenizer_dir)
    revision = _tokenizer_revision(run)
    return f"{name}@{revision}" if revision and "@" not in name else name


def snapshot_commit(path: str | Path) -> str | None:
    """The commit of a hub cache snapshot folder (``.../snapshots/<sha>``); None for other paths."""
    path = Path(path)
    return path.name if path.parent.name == "snapshots" and _COMMIT.match(path.name) else None


def resolution(
    run, local, tokenizer_dir: str | Path | None = None, data_source: str | None = None
) -> dict[str, dict[str, str | None]]:
    """What ``run``'s names resolved to here: ``{"section.key": {"value": ..., "commit": ...}}`` for
    every key ``local`` (``local_run(run)``) holds differently, plus ``"tokenizer"`` (the directory
    read, when it is not the name the checkpoint records) and ``"data.dataset"`` (the source read,
    when it is not the key's value, e.g. the demo's chat file). ``commit``: the snapshot's commit
    when the value is a hub cache snapshot, else None. A checkpoint keeps this beside the config
    as written, so it says both what was asked for and which files were used."""
    written, resolved = run.flat(), local.flat()
    out = {
        key: {"value": value, "commit": snapshot_commit(value) if isinstance(value, str) else None}
        for key, value in resolved.items()
        if value != written.get(key)
    }
    if tokenizer_dir is not None and str(tokenizer_dir) != recorded_tokenizer(run, tokenizer_dir):
        out["tokenizer"] = {"value": str(tokenizer_dir), "commit": snapshot_commit(tokenizer_dir)}
    if data_source is not None and str(data_source) != resolved.get("data.dataset"):
        out["data.dataset"] = {"value": str(data_source), "commit": None}
    return out
