"""Prepare data ahead of a run: the offline assets, or the token stores of a pretraining corpus.

The pinned assets (tokenizers, chat data, evaluation corpora: docs/data.md §1.1) into the cache
(``$MDLMPE_DS_CACHE`` or ``.cache/mdlmpe_ds``), or the list of parts and their files::

    python launch/prepare_data.py assets                              # every default part
    python launch/prepare_data.py assets --only qwen_tokenizer,chat
    python launch/prepare_data.py list

The token stores a pretraining run with these settings maps (training and held-out roles), built
once so that the run's ranks do not wait for the build on the setup barrier::

    python launch/prepare_data.py corpus openwebtext --tokenizer GSAI-ML/LLaDA-8B-Base \\
        --store_dir /data/stores --workers 32
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mdlmpe_ds.data.assets import CACHE_ENV, DEFAULT_PARTS, PARTS, ensure_assets
from mdlmpe_ds.data.corpora import prepare_stores


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python launch/prepare_data.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    assets = sub.add_parser("assets", help="download, verify and build asset parts")
    assets.add_argument(
        "--only", default=None, help=f"comma-separated parts (default: all of {','.join(DEFAULT_PARTS)})"
    )
    assets.add_argument(
        "--cache-dir", default=None, help=f"cache root (default: ${CACHE_ENV} or .cache/mdlmpe_ds)"
    )
    sub.add_parser("list", help="list the asset parts and their files")
    corpus = sub.add_parser("corpus", help="build the token stores of a pretraining corpus")
    corpus.add_argument("spec", help="a corpus as --dataset / --validation take it (e.g. openwebtext)")
    corpus.add_argument(
        "--tokenizer", required=True, help="tokenizer directory or hub id (the run's data.tokenizer)"
    )
    corpus.add_argument("--store_dir", required=True, help="the run's data.store_dir")
    corpus.add_argument("--role", choices=("train", "eval", "both"), default="both")
    corpus.add_argument("--workers", type=int, default=None, help="tokenising processes (data.build_workers)")
    corpus.add_argument("--text_split", default=None)
    corpus.add_argument("--text_column", default="text")
    corpus.add_argument("--max_documents", type=int, default=None, help="training role only, as in a run")
    return parser


def check_corpus_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what a run would refuse (config/run.py validates data.max_documents >= 1): a store
    built with --max_documents 0 sits under a key no run ever maps."""
    if args.max_documents is not None and args.max_documents < 1:
        parser.error(
            f"--max_documents {args.max_documents}: must be >= 1, as a run's data.max_documents; "
            "leave it out for the whole corpus"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "corpus":
        check_corpus_args(parser, args)
    if args.command == "list":
        for name, part in PARTS.items():
            print(f"{name}: {', '.join(part.files)}")
    elif args.command == "assets":
        names = [p.strip() for p in args.only.split(",") if p.strip()] if args.only else list(DEFAULT_PARTS)
        paths = ensure_assets(names, args.cache_dir)
        print(f"prepared {', '.join(names)} under {paths.root}")
    else:
        roles = ("train", "eval") if args.role == "both" else (args.role,)
        stores = prepare_stores(
            args.spec, args.tokenizer, args.store_dir, roles, workers=args.workers,
            text_split=args.text_split, text_column=args.text_column, max_documents=args.max_documents,
        )  # fmt: skip
        for role, ds in stores.items():
            m = ds.store.manifest
            sizes = f"{m['num_tokens']:,} tokens, {m['num_documents']:,} docs"
            print(f"{args.spec} ({role}): {ds.store.path}: {sizes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
