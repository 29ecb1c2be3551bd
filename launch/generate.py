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
chat template; --chat keeps a multi-turn conversation (previous answers without their EOS).
--show_steps prints the response after every denoising step (masks shown as the mask token).
Sampler options are ``diffusion.sampling.SamplerConfig``'s (docs/models.md §4).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import Any

import torch

from mdlmpe_ds.diffusion.sampling import SamplerConfig, generate, trim_at_eos
from mdlmpe_ds.evaluation.loading import DTYPES, load_model, load_tokenizer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
        help="prepend BOS (auto: for Dream, whose first position cannot be predicted)",
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
            p.add_argument(f"--{f.name}", type=type(value), default=value)
    return p.parse_args(argv)


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
        self.config = SamplerConfig(
            **{f.name: getattr(args, f.name) for f in fields(SamplerConfig)}
        ).validate()
        cfg = self.model.config
        self.eos_id, self.mask_id = cfg.eos_token_id, cfg.mask_token_id
        bos = getattr(self.tokenizer, "bos_token_id", None)
        want_bos = cfg.family == "dream" if args.add_bos == "auto" else args.add_bos == "yes"
        self.bos_id = bos if want_bos else None
        if want_bos and bos is None:
            raise SystemExit("--add_bos: the tokenizer has no BOS token")
        self.show_steps = args.show_steps

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

    def check_length(self, prompts: list[list[int]]) -> None:
        """Refuse a prompt + ``gen_length`` longer than the model's ``max_seq_len``: positions past it
        were never trained (absolute embeddings have no row for them, MDLMPE's L_ref is max_seq_len),
        so printing what comes out would pass off out-of-range text as an answer."""
        limit, gen = self.model.config.max_seq_len, self.config.gen_length
        for r, ids in enumerate(prompts):
            if len(ids) + gen > limit:
                which = f"prompt {r + 1}" if len(prompts) > 1 else "the prompt"
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
    messages: list[dict[str, str]] = []
    print("chat: an empty line or EOF ends the conversation", file=out)
    for line in stdin:
        if not line.strip():
            break
        messages.append({"role": "user", "content": line.rstrip("\n")})
        (answer,) = session.run([session.render(messages)], out)  # answers carry no EOS (trimmed)
        messages.append({"role": "assistant", "content": answer})
        print(answer, file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
