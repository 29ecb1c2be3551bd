"""What the tools say when they are given something that cannot work: each message names the flag,
file or corpus and what to do (before, several went on silently or ended in another library's
error). Evaluation beyond the trained length, unknown corpora, zero counts, a device this machine
lacks, a YAML syntax error."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest
import torch
from byte_model_fixtures import byte_model_dir

from mdlmpe_ds.models import DiffusionLM, preset, save_pretrained

REPO = Path(__file__).resolve().parents[2]


def _launcher(name: str):
    spec = importlib.util.spec_from_file_location(f"launch_{name}_cli", REPO / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """An export of a 64-position model with a byte-level tokenizer that fits its vocabulary (so the
    old code scored it without complaint)."""
    return byte_model_dir(tmp_path_factory.mktemp("model64"), chat_template=None)


def test_evaluate_refuses_windows_longer_than_the_model_was_trained_for(model_dir, tmp_path):
    """Before: exit 0 with a perplexity of 4096-token windows on a 64-position model."""
    with pytest.raises(SystemExit) as exc:
        _launcher("evaluate").main(
            [
                str(model_dir),
                "--corpora",
                "botchan",
                "--seq_len",
                "4096",
                "--max_sequences",
                "1",
                "--num_samples",
                "2",
                "--t_sampling",
                "iid",
                "--out",
                str(tmp_path / "ppl"),
            ]
        )
    message = str(exc.value)
    assert f"--seq_len 4096 is longer than the maximum length 64 of {model_dir}" in message
    assert "max_seq_len" in message and "--seq_len 64 or less" in message
    assert not (tmp_path / "ppl.json").exists()


@pytest.mark.parametrize(
    ("args", "want"),
    [
        (["--corpora", "bogus"], "corpus 'bogus' is not a named corpus"),
        (["--corpora", "shakespeare-heldou"], "Did you mean 'shakespeare-heldout'"),
        (["--max_sequences", "0"], "--max_sequences 0: must be >= 1 (windows scored per corpus)"),
        (["--batch_size", "0"], "--batch_size 0: must be >= 1 (windows per forward pass)"),
    ],
)
def test_evaluate_names_a_bad_argument_before_loading_anything(tmp_path, capsys, args, want, monkeypatch):
    """--corpora bogus went to the Hub; --max_sequences 0 said the corpus was shorter than a window;
    --batch_size 0 ended in range()'s error. Now argparse-style errors, before any model is read."""
    from mdlmpe_ds.evaluation import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exc:
        _launcher("evaluate").main([str(tmp_path / "no-model"), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert want in err, err
    if "bogus" in args:
        assert "Named corpora: shakespeare, shakespeare-heldout, ptb" in err and "wikitext-103" in err


def test_a_pretraining_corpus_typo_names_the_corpus_not_the_tokenizer():
    """Before: 'give data.tokenizer explicitly', as if the corpus existed."""
    from mdlmpe_ds.data.corpora import corpus_text_files

    with pytest.raises(ValueError) as exc:
        corpus_text_files("shakespear")
    message = str(exc.value)
    assert "corpus 'shakespear' is not a named corpus" in message and "Did you mean 'shakespeare'" in message
    assert "tokenizer" not in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without CUDA")
def test_device_cuda_on_a_cpu_machine_says_so(model_dir, tmp_path, capsys):
    """Before: torch's 'Torch not compiled with CUDA enabled' assertion after loading the model."""
    from mdlmpe_ds.evaluation.loading import load_model
    from mdlmpe_ds.models.device import check_device

    with pytest.raises(
        ValueError, match=r"--device cuda: no CUDA GPU is usable here \(.*\); use --device cpu"
    ):
        check_device("cuda")
    with pytest.raises(ValueError, match="no CUDA GPU is usable here"):
        load_model(model_dir, device="cuda")
    with pytest.raises(ValueError, match="is not a torch device"):
        check_device("gpu0")
    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(SystemExit) as exc:
        _launcher("generate").main(
            ["--checkpoint", str(model_dir), "--device", "cuda", "--prompt", "Hi"], out=io.StringIO()
        )
    assert "error: --device cuda: no CUDA GPU is usable here" in str(exc.value)
    with pytest.raises(SystemExit):
        _launcher("evaluate").main([str(model_dir), "--device", "cuda", "--out", str(tmp_path / "p")])
    assert "--device cuda: no CUDA GPU is usable here" in capsys.readouterr().err


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
    """Before: PyYAML's message naming '<unicode string>'."""
    from mdlmpe_ds.config.cli import load_config_file

    file = tmp_path / "run.yaml"
    file.write_text("optim:\n  lr: 1e-4\n train:\n  max_steps: [1\n")
    with pytest.raises(ValueError) as exc:
        load_config_file(file)
    message = str(exc.value)
    assert message.startswith(f"{file}: line ") and "not valid YAML" in message
    assert "<unicode string>" not in message


def test_analyze_checkpoint_refuses_a_probe_longer_than_the_model(tmp_path):
    """Before: `analyze.py checkpoint --length 500` probed a 64-position model at untrained positions."""
    model_dir = tmp_path / "mdlmpe64"
    config = preset("llada-tiny", position_encoding="mdlmpe", max_seq_len=64, mdlmpe={"max_seq_len": 64})
    save_pretrained(DiffusionLM(config), model_dir, config)
    argv = ["checkpoint", "--model", str(model_dir), "--out", str(tmp_path / "diag")]
    with pytest.raises(SystemExit) as exc:
        _launcher("analyze").main([*argv, "--length", "500"])
    assert str(exc.value) == (
        f"--length 500 is longer than the maximum length 64 of {model_dir} (max_seq_len in its config): "
        "positions past it were never trained; use --length 64 or less"
    )
    with pytest.raises(SystemExit, match="--prompt-ids gives 65 ids, more than the maximum length 64"):
        _launcher("analyze").main([*argv, "--prompt-ids", ",".join(["5"] * 65)])
    assert not (tmp_path / "diag").exists()


def test_prepare_data_refuses_max_documents_zero_before_building(tmp_path, capsys, monkeypatch):
    """Before: a full store built under a key no run maps (runs refuse data.max_documents=0)."""
    from mdlmpe_ds.data import corpora

    monkeypatch.setattr(corpora, "prepare_stores", lambda *a, **k: pytest.fail("a store was built"))
    prepare = _launcher("prepare_data")
    monkeypatch.setattr(prepare, "prepare_stores", lambda *a, **k: pytest.fail("a store was built"))
    argv = ["corpus", "shakespeare", "--tokenizer", "t", "--store_dir", str(tmp_path), "--max_documents", "0"]
    with pytest.raises(SystemExit) as exc:
        prepare.main(argv)
    assert exc.value.code == 2
    assert "--max_documents 0: must be >= 1, as a run's data.max_documents" in capsys.readouterr().err
