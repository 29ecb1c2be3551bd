"""launch/generate.py refuses what cannot work before the model loads, in the flags' words, and a
chat that outgrows the model drops its oldest turns instead of ending (probe round: sampler options
raised tracebacks only after minutes of loading; --gen_length 0 blamed block_length=0; a long chat
exited with code 1 and lost the conversation)."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path
from types import SimpleNamespace

import pytest
from byte_model_fixtures import byte_model_dir

REPO = Path(__file__).resolve().parents[2]


def _launcher():
    spec = importlib.util.spec_from_file_location("launch_generate_refusals", REPO / "launch" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 64-position LLaDA-family export with a byte-level tokenizer (one token per byte, no BOS) and a
    plain chat template, so prompt lengths are known exactly."""
    return byte_model_dir(tmp_path_factory.mktemp("model64"))


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--gen_length", "10", "--block_length", "3"], "--block_length 3 must divide --gen_length 10"),
        (
            ["--gen_length", "8", "--block_length", "4", "--steps", "3"],
            "--steps 3 must be a positive multiple of the 2 blocks",
        ),
        (["--gen_length", "0"], "--gen_length 0: must be >= 1"),
        (["--algorithm", "beam"], "argument --algorithm: invalid choice: 'beam'"),
        (["--schedule", "cosine"], "argument --schedule: invalid choice: 'cosine'"),
        (["--block_context", "sideways"], "argument --block_context: invalid choice"),
        (["--top_p", "0.9"], "--top_p/--top_k/--alg_temp are Dream options; --algorithm 'low_confidence'"),
        (["--prompt", "", "--add_bos", "no"], "--prompt 2 is empty: give some text, or pass --add_bos yes"),
    ],
)
def test_bad_sampler_options_are_refused_before_the_model_loads(flags, expected, monkeypatch, capsys):
    launcher = _launcher()

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(launcher, "load_model", no_loading)
    with pytest.raises(SystemExit) as exc:
        launcher.main(["--checkpoint", "unused", "--prompt", "Hi", *flags], out=io.StringIO())
    assert exc.value.code == 2  # argparse's usage error: one line, no traceback
    err = capsys.readouterr().err
    assert expected in err
    assert "block_length=0" not in err and "Traceback" not in err


def test_empty_prompt_without_bos_names_add_bos(model_dir):
    """--add_bos auto on LLaDA adds no BOS: an empty prompt said 'give at least a BOS token' from
    build_canvas, a ValueError naming no flag."""
    with pytest.raises(SystemExit) as exc:
        _launcher().main(
            ["--checkpoint", str(model_dir), "--gen_length", "8", "--prompt", ""], out=io.StringIO()
        )
    assert str(exc.value) == (
        "the prompt is empty: give some text, or pass --add_bos yes to start from the BOS token alone "
        "(or --template)"
    )


def test_gen_length_that_leaves_no_room_for_a_prompt_says_which_flag_to_lower(model_dir):
    """The default --gen_length 128 on a model of 64 (the demo has 128) positions: 'shorten the prompt'
    could not help; the message gives the largest --gen_length that can."""
    out = io.StringIO()
    with pytest.raises(SystemExit) as exc:
        _launcher().main(["--checkpoint", str(model_dir), "--prompt", "Hi"], out=out)
    assert str(exc.value) == (
        "--gen_length 128 leaves no room for a prompt: the model has 64 positions (max_seq_len in its "
        "config); pass --gen_length 63 or less (e.g. --gen_length 32)"
    )
    assert out.getvalue() == ""


def test_chat_that_outgrows_the_model_drops_old_turns_and_goes_on(model_dir, capsys):
    """64 positions - --gen_length 16 = 48 prompt tokens: one 22-byte question rendered is 40 tokens,
    so every later question drops the exchange before it; a question too long alone is refused and
    the session still answers the next one (before: exit 1 at the second question)."""
    question = "Hi there, how are you?"
    lines = [question, question, "x" * 60, question, ""]
    out = io.StringIO()
    argv = ["--checkpoint", str(model_dir), "--chat", "--gen_length", "16", "--steps", "4"]
    assert _launcher().main(argv, out=out, stdin=io.StringIO("\n".join(lines) + "\n")) == 0
    assert len(out.getvalue().splitlines()) == 1 + 3  # the banner and three answers
    err = capsys.readouterr().err
    assert (
        err.count("note: the conversation outgrew the model's 64 positions; dropped its oldest 2 turns") == 2
    )
    assert "this message was not sent: as a chat turn it is 78 tokens" in err
    assert "leave room for 48; write a shorter one" in err


class _Letters:
    """A stand-in session: one token per character of 'role:content|' per message."""

    def __init__(self, limit: int, gen: int) -> None:
        self.model = SimpleNamespace(config=SimpleNamespace(max_seq_len=limit))
        self.config = SimpleNamespace(gen_length=gen)
        self.room = limit - gen

    def render(self, messages):
        return "".join(f"{m['role'][0]}:{m['content']}|" for m in messages)

    def encode(self, text):
        return list(text)

    def overflow(self, ids):
        return len(ids) + self.config.gen_length - self.model.config.max_seq_len


def test_fit_conversation_keeps_the_system_prompt_and_the_newest_turns(capsys):
    fit = _launcher().fit_conversation
    system = {"role": "system", "content": "be brief"}  # 11 tokens
    old = [{"role": "user", "content": "aaaa"}, {"role": "assistant", "content": "bbbb"}]  # 7 each
    new = {"role": "user", "content": "cccc"}  # 7
    # 11 + 14 + 14 + 7 = 46 tokens; room 30: the two oldest exchanges go, the system prompt stays.
    assert fit(_Letters(40, 10), [system, *old, *old, new]) == [system, new]
    assert "dropped its oldest 4 turns (2 questions and their answers), kept the system prompt" in (
        capsys.readouterr().err
    )
    assert fit(_Letters(60, 10), [system, *old, new]) == [system, *old, new]  # fits: unchanged, no note
    assert capsys.readouterr().err == ""
    assert fit(_Letters(20, 10), [system, *old, new]) is None  # 18 tokens with the system prompt > 10
    assert "this message was not sent: as a chat turn after the system prompt it is 18 tokens" in (
        capsys.readouterr().err
    )


def test_a_dream_chat_turn_starts_as_in_training_and_a_missing_bos_names_the_flag(tmp_path):
    """Dream SFT renders a chat turn without a BOS (and so does the export's chat()); generate.py
    --template put one in front of it, and with a tokenizer without BOS refused naming no way out."""
    dream = byte_model_dir(tmp_path / "dream", family="dream")
    launcher = _launcher()
    out = io.StringIO()
    launcher.main(["--checkpoint", str(dream), "--gen_length", "8", "--prompt", "Hi", "--template"], out=out)
    assert out.getvalue().strip()
    with pytest.raises(
        SystemExit, match=r"--add_bos auto \(the default for a Dream model's raw text prompt\).*--add_bos no"
    ):
        launcher.main(["--checkpoint", str(dream), "--gen_length", "8", "--prompt", "Hi"], out=io.StringIO())
