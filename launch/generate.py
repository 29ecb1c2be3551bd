"""Generate text with a LLaDA / Dream (RoPE or MDLMPE) model: one prompt, several, or an interactive chat.

    python launch/generate.py --checkpoint outputs/sft-demo --prompt "What is 2+2?" --template \\
        --gen_length 32 --steps 32
    python launch/generate.py --checkpoint outputs/sft-demo --chat --gen_length 64 --block_length 32
    python launch/generate.py --checkpoint /models/Dream-v0-Instruct-7B --dtype bf16 --device cuda \\
        --algorithm entropy --temperature 0.2 --top_p 0.95 --prompt "Write a haiku." --template --show_steps

The prompt plus --gen_length must fit the model's positions (the demo model has 128).
--checkpoint: an exported / Hugging Face directory (config.json + safetensors, e.g. from
launch/export.py) or a training output (output_dir, a step directory, ``latest``): the newest
complete ZeRO-3 checkpoint is consolidated in-process. The tokenizer is the directory's own, the
run's recorded tokenizer, or --tokenizer. --template renders a prompt as one user turn of the model's
chat template; --chat keeps a multi-turn conversation (previous answers without their EOS), dropping
its oldest turns once it outgrows the model (a note on stderr says how many).
--show_steps prints the response after every denoising step (masks shown as the mask token).
Sampler options are ``diffusion.sampling.SamplerConfig``'s (docs/models.md §4).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import fields
from typing import Any

import torch

from mdlmpe_ds.diffusion.blocks import BLOCK_CONTEXTS
from mdlmpe_ds.diffusion.sampling import SamplerConfig, generate, trim_at_eos
from mdlmpe_ds.diffusion.sampling_rules import ALGORITHMS, SCHEDULES
from mdlmpe_ds.evaluation.loading import DTYPES, load_model, load_tokenizer

# Sampler fields with a fixed set of values: argparse refuses anything else before the model loads.
CHOICES = {"algorithm": ALGORITHMS, "schedule": ("auto", *SCHEDULES), "block_context": BLOCK_CONTEXTS}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with the sampler options already checked (``sampler_config``)."""
    p = build_parser()
    args = p.parse_args(argv)
    args.sampler = sampler_config(p, args)
    check_prompts(p, args)
    return args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the checkpoint's)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    mode.add_argument("--chat", action="store_true", help="interactive multi-turn chat on stdin")
    p.add_argument("--template", action="store_true", help="render each --prompt as a chat user turn")
    p.add_argument(
        "--add_bos",
        choices=("auto", "yes", "no"),
        default="auto",
        help="prepend BOS (auto: for a Dream model's raw text prompt, whose first position cannot be "
        "predicted; not with --template, whose chat rendering starts as in training)",
    )
    p.add_argument("--show_steps", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    defaults = SamplerConfig()
    for f in fields(SamplerConfig):
        value = getattr(defaults, f.name)
        if isinstance(value, bool):
            p.add_argument(f"--{f.name}", type=_bool, default=value, metavar="true|false")
        elif f.name in ("block_length", "top_k"):
            p.add_argument(f"--{f.name}", type=int, default=value)
        elif f.name == "top_p":
            p.add_argument(f"--{f.name}", type=float, default=value)
        else:
            p.add_argument(f"--{f.name}", type=type(value), default=value, choices=CHOICES.get(f.name))
    return p


def sampler_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SamplerConfig:
    """The validated sampler options, refused with the flags' names before anything loads: loading
    an 8B model takes minutes, and ``SamplerConfig.validate`` names its fields, not the flags (an
    unset --block_length reads as ``block_length=0`` when --gen_length is 0)."""
    gen, block, steps = args.gen_length, args.block_length, args.steps
    if gen < 1:
        parser.error(f"--gen_length {gen}: must be >= 1 (the number of tokens to generate)")
    if block is not None and (block < 1 or gen % block):
        fits = [b for b in range(1, gen + 1) if gen % b == 0]
        parser.error(
            f"--block_length {block} must divide --gen_length {gen}: use one of {fits}, or leave "
            "--block_length out for one block"
        )
    blocks = gen // (block or gen)
    if steps < 1 or steps % blocks:
        near = sorted({max(blocks, steps // blocks * blocks), max(blocks, steps // blocks * blocks + blocks)})
        parser.error(
            f"--steps {steps} must be a positive multiple of the {blocks} blocks (--gen_length {gen} / "
            f"--block_length {block}): e.g. --steps {' or '.join(map(str, near))}"
        )
    config = SamplerConfig(**{f.name: getattr(args, f.name) for f in fields(SamplerConfig)})
    try:
        return config.validate()
    except ValueError as err:
        parser.error(_as_flags(str(err)))


def _as_flags(message: str) -> str:
    """``SamplerConfig.validate``'s message in command-line words: each field name as its flag."""
    names = "|".join(sorted((f.name for f in fields(SamplerConfig)), key=len, reverse=True))
    return re.sub(rf"\b({names})\b", r"--\1", message.removeprefix("sampler: "))


def check_prompts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An empty --prompt with no BOS to stand for it gives the sampler nothing to condition on; with
    --add_bos no that is known before the model loads (with auto it depends on the family: Session.run)."""
    if args.add_bos == "no" and not args.template:
        for r, text in enumerate(args.prompt or []):
            if not text:
                parser.error(f"--prompt {r + 1} is empty: {EMPTY_PROMPT_FIX}")


EMPTY_PROMPT_FIX = "give some text, or pass --add_bos yes to start from the BOS token alone (or --template)"


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1", "yes")


def check_tokenizer(tokenizer: Any, given: str, vocab_size: int, recorded: str | None) -> None:
    """A ``--tokenizer`` other than the run's: refuse one with ids past the model's vocabulary (an
    IndexError deep in the embedding, naming nothing), and warn when its vocabulary differs from the
    recorded one (its ids mean other text: the output is fluent-looking garbage)."""
    size = len(tokenizer)
    if size > vocab_size:
        raise SystemExit(
            f"--tokenizer {given}: {size:,} tokens, but the model's vocabulary has {vocab_size:,}; "
            f"use the tokenizer it was trained with{f' ({recorded})' if recorded else ''}"
        )
    if recorded is None:
        return
    try:
        trained = load_tokenizer(recorded)
    except (OSError, ValueError):
        return  # the recorded one is gone: nothing to compare with
    if trained.get_vocab() != tokenizer.get_vocab():
        print(
            f"warning: --tokenizer {given} is not the tokenizer the model was trained with ({recorded}): "
            "its ids stand for other text",
            file=sys.stderr,
        )


class Session:
    """Model + tokenizer + sampler options; renders prompts and decodes responses."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.model, run_tokenizer = load_model(args.checkpoint, device=args.device, dtype=args.dtype)
        tokenizer_dir = args.tokenizer or run_tokenizer
        if tokenizer_dir is None:
            raise SystemExit(f"{args.checkpoint}: no tokenizer recorded; pass --tokenizer DIR")
        self.tokenizer = load_tokenizer(tokenizer_dir)
        if args.tokenizer is not None:
            check_tokenizer(self.tokenizer, args.tokenizer, self.model.config.vocab_size, run_tokenizer)
        self.config = getattr(args, "sampler", None) or sampler_config(build_parser(), args)
        cfg = self.model.config
        self.eos_id, self.mask_id = cfg.eos_token_id, cfg.mask_token_id
        bos = getattr(self.tokenizer, "bos_token_id", None)
        # auto: a chat turn is rendered as SFT rendered it (no BOS); raw text as Dream's evaluations do
        dream_text = cfg.family == "dream" and not args.template
        want_bos = dream_text if args.add_bos == "auto" else args.add_bos == "yes"
        self.bos_id = bos if want_bos else None
        if want_bos and bos is None:
            default = " (the default for a Dream model's raw text prompt)" if args.add_bos == "auto" else ""
            raise SystemExit(
                f"--add_bos {args.add_bos}{default}: the tokenizer has no BOS token; pass --add_bos no"
            )
        self.show_steps = args.show_steps
        self.check_room()

    def encode(self, text: str) -> list[int]:
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def render(self, messages: list[dict[str, str]]) -> str:
        from mdlmpe_ds.data.chat_templates import template_for

        return template_for(self.model.config.family, self.tokenizer).render(
            messages, add_generation_prompt=True
        )

    def decode(self, ids: Any) -> str:
        return self.tokenizer.decode(trim_at_eos(ids, self.eos_id), skip_special_tokens=True)

    @property
    def room(self) -> int:
        """Prompt tokens that fit before the response: max_seq_len - gen_length."""
        return self.model.config.max_seq_len - self.config.gen_length

    def check_room(self) -> None:
        """Refuse a --gen_length that leaves no position for a prompt (the default 128 on the demo
        model's 128 positions): "shorten the prompt" would be advice no prompt can follow."""
        if self.room < 1:
            limit = self.model.config.max_seq_len
            raise SystemExit(
                f"--gen_length {self.config.gen_length} leaves no room for a prompt: the model has {limit} "
                f"positions (max_seq_len in its config); pass --gen_length {limit - 1} or less "
                f"(e.g. --gen_length {limit // 2})"
            )

    def overflow(self, ids: list[int]) -> int:
        """How many tokens ``ids`` + ``gen_length`` exceed the model's ``max_seq_len`` by (<= 0: fits)."""
        return len(ids) + self.config.gen_length - self.model.config.max_seq_len

    def check_length(self, prompts: list[list[int]]) -> None:
        """Refuse a prompt + ``gen_length`` longer than the model's ``max_seq_len``: positions past it
        were never trained (absolute embeddings have no row for them, MDLMPE's L_ref is max_seq_len),
        so printing what comes out would pass off out-of-range text as an answer. Refuse an empty
        prompt here too (no BOS added): ``build_canvas`` would raise with no word of --add_bos."""
        limit, gen = self.model.config.max_seq_len, self.config.gen_length
        for r, ids in enumerate(prompts):
            which = f"prompt {r + 1}" if len(prompts) > 1 else "the prompt"
            if not ids:
                raise SystemExit(f"{which} is empty: {EMPTY_PROMPT_FIX}")
            if self.overflow(ids) > 0:
                raise SystemExit(
                    f"{which} has {len(ids)} tokens + --gen_length {gen} = {len(ids) + gen} tokens, more "
                    f"than the model's maximum length {limit} (max_seq_len in its config); shorten the "
                    "prompt or lower --gen_length"
                )

    def run(self, texts: list[str], out=sys.stdout) -> list[str]:
        def on_step(step: int, block: int, responses: torch.Tensor) -> None:
            for r, row in enumerate(responses):
                shown = self.tokenizer.decode(row.tolist(), skip_special_tokens=False)
                print(f"[step {step} block {block} row {r}] {shown}", file=out)

        prompts = [self.encode(t) for t in texts]
        self.check_length(prompts)
        result = generate(
            self.model,
            prompts,
            self.config,
            on_step=on_step if self.show_steps else None,
        )
        return [self.decode(row) for row in result.responses]


def main(argv: list[str] | None = None, out=sys.stdout, stdin=sys.stdin) -> int:
    args = parse_args(argv)
    from mdlmpe_ds.training.log_setup import configure

    configure(stream="stderr")  # stdout holds the completions
    from mdlmpe_ds.models.device import check_device

    try:
        check_device(args.device)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    session = Session(args)
    if args.prompt:
        texts = [
            session.render([{"role": "user", "content": t}]) if args.template else t for t in args.prompt
        ]
        for answer in session.run(texts, out):
            print(answer, file=out)
        return 0
    chat(session, stdin, out)
    return 0


def chat(session: Session, stdin, out) -> None:
    """The interactive conversation: one answer per line read, until an empty line or EOF. A turn
    that cannot fit is refused on stderr and the conversation goes on (see ``fit_conversation``)."""
    messages: list[dict[str, str]] = []
    print("chat: an empty line or EOF ends the conversation", file=out)
    for line in stdin:
        if not line.strip():
            break
        fitted = fit_conversation(session, [*messages, {"role": "user", "content": line.rstrip("\n")}])
        if fitted is None:
            continue
        messages = fitted
        (answer,) = session.run([session.render(messages)], out)  # answers carry no EOS (trimmed)
        messages.append({"role": "assistant", "content": answer})
        print(answer, file=out, flush=True)


def fit_conversation(session: Session, messages: list[dict[str, str]]) -> list[dict[str, str]] | None:
    """``messages`` (ending with the new user turn) trimmed to fit the model's positions with
    --gen_length: the oldest turns are dropped (a system prompt is kept), with a note on stderr,
    rather than ending a session whose conversation merely grew long. None, with a message on
    stderr, when the new user turn does not fit even alone: that turn is refused, the rest kept."""
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    turns = messages[len(system) :]
    dropped = 0
    while session.overflow(ids := session.encode(session.render([*system, *turns]))) > 0:
        if len(turns) == 1:
            print(
                f"this message was not sent: as a chat turn{' after the system prompt' if system else ''} "
                f"it is {len(ids)} tokens, and with --gen_length {session.config.gen_length} the model's "
                f"{session.model.config.max_seq_len} positions (max_seq_len) leave room for "
                f"{session.room}; write a shorter one (or restart with a lower --gen_length)",
                file=sys.stderr,
            )
            return None
        turns = turns[2:]  # the oldest user turn and its answer
        dropped += 2
    if dropped:
        print(
            f"note: the conversation outgrew the model's {session.model.config.max_seq_len} positions; "
            f"dropped its oldest {dropped} turns ({dropped // 2} questions and their answers)"
            + (", kept the system prompt" if system else ""),
            file=sys.stderr,
        )
    return [*system, *turns]


if __name__ == "__main__":
    sys.exit(main())
