"""The training command line and config files, parsed by jsonargparse from the typed config.

Every key of `RunConfig` (mdlmpe_ds/config/run.py) is one argument, typed by its annotation and
documented by its field's ``help`` metadata; `--help` is the library's, so it lists exactly the
fields there are, each with its own text and this launcher's default. Spellings: ``--section.key``,
the bare ``--key`` where one section owns it, ``--dataset_split`` (= ``--data.split``), ``--key=value``,
``--model.mdlmpe '{json}'`` / ``--model.mdlmpe.KEY``; the DeepSpeed launcher's own ``--local_rank``
and ``--deepspeed`` and the run flags (``--config``, ``--dry-run``, ``--resume``, ``--recipe``) are
arguments of the same parser. Precedence: the launcher's config (a recipe, a preset or the demo)
<- ``--config file.json|yaml`` <- the command line.

Why jsonargparse and not tyro: jsonargparse is argparse underneath, so several spellings of one key
are plain option strings of one argument and the launcher's flags sit in the same parser, and
dotted ``--section.key`` is its native nesting; it converts and checks values from the type
annotations on the command line and, through the same parser (``parse_object``), in config files.
tyro derives its own flag names from the dataclass tree, turns booleans into ``--flag/--no-flag``
pairs and has no config-file layer, so keeping today's spellings would need a marker per field and a
second, hand-written file merge.

This is the one module of the package that builds a parser; it never reads ``sys.argv``: the
scripts under launch/ pass their arguments in.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import re
import types
import typing
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentParser, DefaultHelpFormatter
from jsonargparse.typing import register_type

from mdlmpe_ds.config.run import KEY_ALIASES, SECTIONS, RunConfig
from mdlmpe_ds.hub.resolve import folded_dataset
from mdlmpe_ds.lora import spec as lora_spec
from mdlmpe_ds.pe.config import MDLMPEConfig

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]  # the checkout: mdlmpe_ds/config/cli.py -> repo root
MDLMPE_DEST = "mdlmpe_key"  # where --model.mdlmpe.KEY lands (model.mdlmpe itself is the JSON object)
# The run flags: not config keys, never saved in a checkpoint's config.
RUN_FLAGS = ("deepspeed", "local_rank", "config", "dry_run", "resume", "allow_config_change", "recipe")


class Number(float):
    """A float field on the command line: Python's spellings (``inf``, ``nan``, ``1e-5``), so a
    non-finite value reaches validate(), which names the key (YAML's reading would refuse ``inf``)."""


class Switch:
    """A bool field on the command line: true/false, yes/no, on/off, 1/0 (any case)."""


class Null:
    """None in an ``X | None`` field: ``null`` or ``none`` (any case)."""


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)


def _switch(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _null(value: Any) -> None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
        return None
    raise ValueError("expected null")


# jsonargparse's registry of types (dict entries): how the command line reads these three.
register_type(Number, float, _number)
register_type(Switch, bool, _switch)
register_type(Null, lambda value: None, _null)


def _cli_type(annotation: Any) -> Any:
    """A field's annotation as the command line reads it: ``float`` as ``Number``, ``bool`` as
    ``Switch``, the None of ``X | None`` as ``Null`` (inside tuples too)."""
    if annotation is float:
        return Number
    if annotation is bool:
        return Switch
    args = typing.get_args(annotation)
    if not args:
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        others = tuple(_cli_type(a) for a in args if a is not type(None))
        nullable = (Null,) if type(None) in args else ()
        return typing.Union[(*nullable, *others)]
    return typing.get_origin(annotation)[tuple(_cli_type(a) for a in args)]


def owners() -> dict[str, list[str]]:
    """Bare key -> the sections that have it (one: ``--key`` is a spelling of ``--section.key``)."""
    out: dict[str, list[str]] = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            out.setdefault(f.name, []).append(section)
    return out


def valid_keys() -> list[str]:
    return [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in fields(cls)]


def pretrain_only_keys(keys: Iterable[str]) -> list[str]:
    """The dotted ``keys`` that only launch/pretrain.py reads (``doc(pretrain_only=True)``), sorted:
    SFT accepts them and ignores them, so a launcher warns about the ones a user gave."""
    only = {
        f"{section}.{f.name}"
        for section, cls in SECTIONS.items()
        for f in fields(cls)
        if f.metadata.get("pretrain_only")
    }
    return sorted(set(keys) & only)


def canonical_key(key: str, source: str) -> str:
    """'optim.lr', 'lr' or 'dataset_split' -> the dotted key; unknown or ambiguous keys raise, listing
    the valid ones (config files and --allow_config_change name keys the way flags do)."""
    key = key.replace("-", "_")
    key = KEY_ALIASES.get(key, key)
    if key.startswith("model.mdlmpe.") or key in valid_keys():
        return key
    sections = owners().get(key, [])
    if len(sections) == 1:
        return f"{sections[0]}.{key}"
    if len(sections) > 1:
        raise ValueError(
            f"{source}: key {key!r} is ambiguous, write one of {[f'{s}.{key}' for s in sections]}"
        )
    raise ValueError(
        f"{source}: unknown key {key!r}{_unknown_hint(key)}; valid keys are {', '.join(valid_keys())}"
    )


def _unknown_hint(key: str) -> str:
    """What an unknown key most likely meant: a run flag written in a config file (``resume``), a
    key put in the wrong section (``train.lr`` -> ``optim.lr``), or a misspelling."""
    bare = key.split(".")[-1]
    if bare in RUN_FLAGS:
        return f" (--{bare} is a run flag, not a config key: give it on the command line)"
    sections = owners().get(bare, [])
    if "." in key and sections:
        return f" (did you mean {' or '.join(f'{s}.{bare}' for s in sections)}?)"
    close = difflib.get_close_matches(key, [*valid_keys(), *owners()], n=1, cutoff=0.8)
    return f" (did you mean {close[0]}?)" if close else ""


class _Formatter(DefaultHelpFormatter):
    """jsonargparse's help, with each key's default (this launcher's) beside its flags."""

    def _get_type_str(self, action: argparse.Action) -> str | None:
        text = super()._get_type_str(action)
        if text is None:
            return None
        text = text.replace("Number", "float").replace("Switch", "bool").replace("<class 'bool'>", "bool")
        optional = re.fullmatch(r"Union\[Null, (.*)\]", text)
        return f"{optional.group(1)} | null" if optional else text

    def _format_action_invocation(self, action: argparse.Action) -> str:
        text = super()._format_action_invocation(action)
        if hasattr(action, "shown_default"):
            text += f" (default {action.shown_default!r})"
        return text


def config_parser(
    description: str | None = None,
    defaults: RunConfig | None = None,
    launcher: str = "sft",
    recipes: list[str] | None = None,
    run_flags: bool = True,
) -> ArgumentParser:
    """The parser of a training launcher: its run flags (``run_flags``) and every config key, shown
    with ``defaults`` (the launcher's config). Keys only launch/pretrain.py reads are grouped apart
    in SFT's help. ``recipes``: the names ``--recipe`` takes."""
    defaults = defaults or RunConfig()
    parser = ArgumentParser(
        description=description,
        usage="%(prog)s [--deepspeed DS_CONFIG] [--config FILE] [--dry-run] [--resume auto|DIR] "
        "[--recipe NAME] [--key VALUE | --section.key VALUE ...]",
        exit_on_error=False,
        formatter_class=_Formatter,
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,  # a training key such as --seed must never be taken for a prefix
    )
    if run_flags:
        _add_run_flags(parser, recipes or [])
    owned = owners()
    for section, cls in SECTIONS.items():
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        group = parser.add_argument_group(f"{section}: {doc}")
        apart = None
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            target = group
            if f.metadata.get("pretrain_only") and launcher != "pretrain":
                if apart is None:
                    apart = parser.add_argument_group(
                        f"{section}, read by launch/pretrain.py only (SFT ignores these)"
                    )
                target = apart
            names = [f"--{f.name}"] if len(owned[f.name]) == 1 else []
            names.append(f"--{section}.{f.name}")
            names += [f"--{alias}" for alias, key in KEY_ALIASES.items() if key == f"{section}.{f.name}"]
            kind = _cli_type(hints[f.name])
            if f.name == "mdlmpe":
                kind = dict
            action = target.add_argument(
                *names, dest=f"{section}.{f.name}", type=kind, help=f.metadata["help"]
            )
            shown = getattr(getattr(defaults, section), f.name)
            action.shown_default = shown.to_dict() if f.name == "mdlmpe" else shown
    group = parser.add_argument_group("model.mdlmpe: one MDLMPE method key (pe/config.py)")
    hints = typing.get_type_hints(MDLMPEConfig)
    for f in fields(MDLMPEConfig):
        action = group.add_argument(
            f"--model.mdlmpe.{f.name}",
            dest=f"{MDLMPE_DEST}.{f.name}",
            type=_cli_type(hints[f.name]),
            help=f.metadata["help"],
        )
        action.shown_default = getattr(defaults.model.mdlmpe, f.name)
    return parser


def _add_run_flags(parser: ArgumentParser, recipes: list[str]) -> None:
    parser.add_argument(
        "--deepspeed", default=str(REPO / "ds_configs" / "zero3.json"), help="DeepSpeed JSON config"
    )
    parser.add_argument(
        "--local_rank",
        "--local-rank",
        type=int | None,
        default=None,
        help="set by launchers; ignored (the environment's LOCAL_RANK is the source of truth)",
    )
    parser.add_argument("--config", type=str | None, default=None, help="training config file (.json/.yaml)")
    parser.add_argument(
        "--dry-run",
        "--dry_run",
        action="store_true",
        dest="dry_run",
        default=False,
        help="validate the config and batch arithmetic, build on the meta device, print the plan",
    )
    parser.add_argument(
        "--resume",
        type=str | None,
        default=None,
        help="'auto' (newest complete checkpoint) or a checkpoint directory",
    )
    parser.add_argument(
        "--allow_config_change",
        "--allow-config-change",
        action="append",
        default=[],
        metavar="KEY[,KEY...]",
        help="on resume, continue although KEY differs from the checkpoint's run config where "
        "docs/resume.md refuses the change (repeatable); the keys it says cannot be forced "
        "(precision, micro_batch_size, seed, LoRA r/targets) stay refused",
    )
    parser.add_argument(
        "--recipe",
        type=str | None,
        default=None,
        metavar="NAME",
        help=f"the paper's values for one run, printed at start: {', '.join(recipes) or 'none here'}",
    )


def parse(parser: ArgumentParser, argv: list[str], source: str = "command line") -> tuple[dict, dict]:
    """(run flags, {dotted config key: typed value}) of ``argv``; only the keys given appear."""
    try:
        values = parser.parse_args(argv).as_dict()
    except argparse.ArgumentError as err:
        raise _readable(err, source, _given(parser, argv)) from None
    flags = {k: values.pop(k) for k in RUN_FLAGS if k in values}
    overrides = {
        f"{s}.{k}": v for s, section in values.items() if s != MDLMPE_DEST for k, v in section.items()
    }
    overrides.update({f"model.mdlmpe.{k}": v for k, v in values.get(MDLMPE_DEST, {}).items()})
    return flags, overrides


def _given(parser: ArgumentParser, argv: list[str]) -> dict[str, str]:
    """dest -> the last value ``argv`` gives it (for naming a bad value as the user wrote it)."""
    options = {o: a.dest for a in parser._actions for o in a.option_strings}
    given = {}
    for i, token in enumerate(argv):
        name, _, inline = token.partition("=")
        if name in options:
            value = inline if "=" in token else (argv[i + 1] if i + 1 < len(argv) else "")
            given[options[name]] = value
    return given


def _readable(err: Exception, source: str, given: dict[str, Any] | None = None) -> ValueError:
    """jsonargparse's error in the project's words: the key, the bad value, or the valid keys."""
    text = str(err)
    bad = re.match(r'Parser key "([^"]+)"', text)
    if bad:
        key = bad.group(1).replace(f"{MDLMPE_DEST}.", "model.mdlmpe.")
        found = re.search(r"(?:Given|Got) value: (.*)$", text, re.M)
        value = (given or {}).get(bad.group(1), found.group(1) if found else "?")
        expected = re.findall(r"Expected a <class '(\w+)'>|Not of type (\w+)", text)
        kinds = [a or b for a, b in expected if (a or b) != "NoneType"]
        names = {"Number": "a number", "Switch": "true or false", "Null": "null"}
        want = " or ".join(names.get(k, k) for k in kinds)
        why = f"expected {want}" if kinds else "wrong type"
        return ValueError(f"{source}: bad value {value!r} for {key}: {why}")
    unknown = re.match(r"unrecognized arguments: (\S+)", text, re.I)
    if unknown:
        token = unknown.group(1)
        if not token.startswith("--"):
            return ValueError(f"{source}: expected --key value, got {token!r}")
        key = token[2:].split("=", 1)[0]
        try:
            canonical_key(key, source)
        except ValueError as named:
            return named
        if "-" in key:  # a known key spelled with dashes (--max-steps)
            return ValueError(
                f"{source}: unknown flag --{key}; write --{key.replace('-', '_')} (flags use underscores)"
            )
    return ValueError(f"{source}: {text}")


def apply(config: RunConfig, overrides: dict[str, Any], source: str) -> RunConfig:
    """A new config: ``config`` with ``overrides`` (dotted keys, typed values) applied. A JSON object
    for model.mdlmpe merges into its keys before the single --model.mdlmpe.KEY values."""
    sections = {s: {} for s in SECTIONS}
    mdlmpe = dict(overrides.get("model.mdlmpe") or {})
    for key, value in overrides.items():
        if key.startswith("model.mdlmpe."):
            mdlmpe[key.removeprefix("model.mdlmpe.")] = value
        elif key != "model.mdlmpe":
            section, name = key.split(".", 1)
            sections[section][name] = value
    if "lora" in sections["model"] and sections["model"]["lora"] is not None:
        sections["model"]["lora"] = lora_spec.parse(sections["model"]["lora"], "model.lora").text()
    if mdlmpe or "model.mdlmpe" in overrides:
        sections["model"]["mdlmpe"] = _updated_mdlmpe(config.model.mdlmpe, mdlmpe, source)
    changed = {s: dataclasses.replace(getattr(config, s), **v) for s, v in sections.items() if v}
    return dataclasses.replace(config, **changed)


def _updated_mdlmpe(mdlmpe: MDLMPEConfig, changes: dict[str, Any], source: str) -> MDLMPEConfig:
    """``mdlmpe`` with ``changes``, each value checked against its field's type; a moved key
    (backend, block_size, ...) says where it went, an unknown one lists the known keys."""
    try:
        MDLMPEConfig.check_keys(changes)
    except ValueError as err:
        raise ValueError(f"{source}: model.mdlmpe: {err}") from err
    try:
        typed = config_parser(run_flags=False).parse_object({MDLMPE_DEST: changes}).as_dict()
    except argparse.ArgumentError as err:
        raise _readable(err, source) from None
    return dataclasses.replace(mdlmpe, **typed.get(MDLMPE_DEST, {}))


def load_config_file(path: str | Path) -> dict[str, Any]:
    """A JSON/YAML training config as {dotted key: value}: sections (``optim: {lr: ...}``), dotted
    or bare keys, ``model.lora`` as a mapping; values checked by the command line's parser."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"training config file not found: {path}")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml  # PyYAML comes with jsonargparse; only needed for YAML files

        class _UniqueKeys(yaml.SafeLoader):
            """PyYAML keeps the last of two equal keys (a second ``train:`` section) without a word."""

            def construct_mapping(self, node, deep=False):
                seen = set()
                for key_node, _ in node.value:
                    key = self.construct_object(key_node, deep=deep)
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"key {key!r} is given twice", key_node.start_mark
                        )
                    seen.add(key)
                return super().construct_mapping(node, deep=deep)

        try:
            data = yaml.load(text, Loader=_UniqueKeys)  # a SafeLoader subclass
        except yaml.YAMLError as err:  # its own text names "<unicode string>", not the file
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(f"{path}:{where}: not valid YAML: {problem}") from None
    else:

        def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            keys = [k for k, _ in pairs]
            twice = sorted({k for k in keys if keys.count(k) > 1})
            if twice:
                raise ValueError(f"{path}: key {twice[0]!r} is given twice in one object; keep one")
            return dict(pairs)

        try:
            data = json.loads(text, object_pairs_hook=unique)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON: {err}") from err
    return typed_mapping(data or {}, str(path))


def typed_mapping(data: dict[str, Any], source: str) -> dict[str, Any]:
    """{"optim": {"lr": 1}}, {"optim.lr": 1} or {"lr": 1} -> {"optim.lr": 1.0}, values checked and
    converted by the parser (a config file, a stored checkpoint config, a recipe)."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    flat: dict[str, Any] = {}
    spelled: dict[str, str] = {}  # canonical key -> how the source wrote it first

    def put(written: str, value: Any) -> None:
        key = canonical_key(written, source)
        if key in flat:  # "lr" and "optim.lr": one would silently win by its place in the file
            raise ValueError(
                f"{source}: {key} is given twice (as {spelled[key]!r} and {written!r}); keep one"
            )
        flat[key], spelled[key] = value, written

    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            for name, inner in value.items():
                put(f"{key}.{name}", inner)
        else:
            put(key, value)
    if isinstance(flat.get("model.lora"), dict):
        flat["model.lora"] = lora_spec.from_mapping(flat["model.lora"], f"{source}: model.lora").text()
    if isinstance(flat.get("model.mdlmpe"), MDLMPEConfig):
        flat["model.mdlmpe"] = flat["model.mdlmpe"].to_dict()
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith("model.mdlmpe."):
            nested.setdefault(MDLMPE_DEST, {})[key.removeprefix("model.mdlmpe.")] = value
        else:
            section, name = key.split(".", 1)
            nested.setdefault(section, {})[name] = list(value) if isinstance(value, tuple) else value
    mdlmpe = nested.get("model", {}).pop("mdlmpe", None)
    try:
        typed = config_parser(run_flags=False).parse_object(nested).as_dict()
    except argparse.ArgumentError as err:
        raise _readable(err, source) from None
    out = {f"{s}.{k}": v for s, section in typed.items() if s != MDLMPE_DEST for k, v in section.items()}
    out.update({f"model.mdlmpe.{k}": v for k, v in typed.get(MDLMPE_DEST, {}).items()})
    if mdlmpe is not None:
        if not isinstance(mdlmpe, dict):
            raise ValueError(
                f"{source}: bad value {mdlmpe!r} for model.mdlmpe: expected a mapping (JSON object)"
            )
        out["model.mdlmpe"] = mdlmpe
    return out


def from_mapping(data: dict[str, Any], source: str = "config", base: RunConfig | None = None) -> RunConfig:
    """``base`` (default: the dataclass defaults) with a config mapping applied (not validated)."""
    return apply(base or RunConfig(), typed_mapping(data, source), source)


def configure(
    base: RunConfig, config_file: str | None, overrides: dict[str, Any], launcher: str | None = None
) -> RunConfig:
    """``base`` (a launcher's complete config) <- config file <- command-line ``overrides`` (from
    ``parse``), validated; ``base`` itself is not changed. ``data.dataset_config`` is written into
    ``data.dataset`` as ``name:config``, the one form runs and checkpoints record. A
    ``train.epochs`` given (file or command line) without ``train.max_steps`` sets max_steps to
    None, so that the epochs decide the run's length. ``launcher`` "sft": each pretraining-only key
    given is warned about (SFT accepts and ignores it)."""
    config = base
    from_file = load_config_file(config_file) if config_file is not None else {}
    if config_file is not None:
        config = apply(config, from_file, str(config_file))
    config = apply(config, overrides, "command line")
    given = {**from_file, **overrides}
    if launcher == "sft":
        for key in pretrain_only_keys(given):
            log.warning(f"{key} is read by launch/pretrain.py only; SFT ignores it")
    if "train.epochs" in given and "train.max_steps" not in given and config.train.max_steps is not None:
        # train.max_steps has a default (40) and wins over epochs whenever it is set: an epochs
        # the user gave without max_steps would otherwise be ignored without a word.
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, max_steps=None))
    d = config.data
    if d.dataset_config:  # a hub dataset's config name is written into data.dataset as name:config
        folded = dataclasses.replace(
            d, dataset=folded_dataset(d.dataset, d.dataset_config), dataset_config=None
        )
        config = dataclasses.replace(config, data=folded)
    return config.validate()


def build_config(
    config_file: str | None, cli_tokens: list[str], defaults: RunConfig | dict[str, Any] | None = None
) -> RunConfig:
    """``configure`` for config-key tokens (no run flags): ``defaults`` is a launcher's complete
    config, or a mapping of keys over the dataclass defaults."""
    base = defaults if isinstance(defaults, RunConfig) else from_mapping(defaults or {}, "launcher defaults")
    _, overrides = parse(config_parser(run_flags=False), cli_tokens)
    return configure(base, config_file, overrides)
