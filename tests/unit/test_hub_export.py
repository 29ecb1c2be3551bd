"""Exports that plain transformers loads (issue 17 "Names out"): AutoModel with trust_remote_code
gives the logits of our loader, for both families, RoPE and MDLMPE, padded batches included; the
exported tokenizer renders conversations exactly as SFT did."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer

from mdlmpe_ds.data.chat_templates import render_chatml, render_llada, template_for
from mdlmpe_ds.hub.export import finish_export
from mdlmpe_ds.hub.templates import CHATML_JINJA, LLADA_JINJA
from mdlmpe_ds.models import DiffusionLM, load_pretrained, preset, save_pretrained
from mdlmpe_ds.models.hf_config import hf_config_dict

CONVERSATION = [
    {"role": "system", "content": "Be brief. "},
    {"role": "user", "content": "  What is 2 + 2?\n"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]


def _trained_looking(family, encoding, **kw):
    torch.manual_seed(0)
    config = preset(f"{family}-tiny", position_encoding=encoding, **kw)
    model = DiffusionLM(config).eval()
    with torch.no_grad():  # non-zero phase output, non-unit norms, a gate away from its init
        for name, param in model.named_parameters():
            if "phase.fc2" in name or name.endswith("norm.weight") or "gate_logit" in name:
                param.normal_(std=0.5)
    return model


def _batch(config):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (3, 20), generator=gen)
    ids[:, 4:9] = config.mask_token_id  # a masked span: MDLMPE's features vary along the row
    ids[2, 12:] = config.mask_token_id
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, 14:] = False  # right padding
    valid[2, :5] = False  # left padding
    return ids, valid


@pytest.mark.parametrize(
    ("family", "encoding", "tied"),
    [
        ("llada", "rope", False),
        ("llada", "mdlmpe", False),
        ("dream", "rope", False),
        ("dream", "mdlmpe", True),
        ("llada", "alibi", False),  # the from-scratch baselines load too
        ("dream", "absolute", False),
        ("llada", "mdlmpe-shared", False),  # one phase MLP for the model (phase_mlp="shared")
        ("dream", "mdlmpe-shared", True),
    ],
)
def test_export_loads_in_transformers_with_our_logits(tmp_path, qwen_tokenizer_dir, family, encoding, tied):
    kw = {"mdlmpe": {"phase_mlp": "shared"}} if encoding == "mdlmpe-shared" else {}
    encoding = encoding.removesuffix("-shared")
    model = _trained_looking(family, encoding, tie_embeddings=tied, **kw)
    save_pretrained(model, tmp_path, model.config)
    finish_export(tmp_path, family, qwen_tokenizer_dir)
    ours = load_pretrained(tmp_path).eval()
    theirs, info = AutoModel.from_pretrained(tmp_path, trust_remote_code=True, output_loading_info=True)
    theirs.eval()
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids, valid = _batch(model.config)
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # left-padded rows start at position 0
    with torch.no_grad():
        cases = ((None, None), (valid, None), (valid, positions))
        for mask, pos in cases[:2] if encoding == "absolute" else cases:  # a fixed table: no positions
            want = ours(ids, mask, positions=pos)
            attention = None if mask is None else mask.long()
            got = theirs(ids, attention_mask=attention, position_ids=pos, aligned=True).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if family == "dream":  # by default next-token aligned, as upstream Dream's logits
            raw = theirs(ids).logits
            torch.testing.assert_close(raw[:, :-1], ours(ids)[:, 1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("encoding", ["rope", "alibi", "mdlmpe"])
def test_bf16_export_gives_an_all_padding_sequence_what_training_gives(
    tmp_path, qwen_tokenizer_dir, encoding
):
    """A bf16 export, a batch whose first sequence is all padding: every logit is finite and close
    to our loader's in bf16 (whose padding keys get ``attention.common.masked_key_bias``). The
    export's padding bias used to be finfo(float32).min cast to bf16, which is -inf: that row's
    softmax was NaN."""
    model = _trained_looking("llada", encoding)
    save_pretrained(model, tmp_path, model.config)
    finish_export(tmp_path, "llada", qwen_tokenizer_dir)
    theirs = AutoModel.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.bfloat16).eval()
    ours = load_pretrained(tmp_path).to(torch.bfloat16).eval()
    ids, valid = _batch(model.config)
    valid[0] = False
    with torch.no_grad():
        got = theirs(ids, attention_mask=valid.long()).logits
        want = ours(ids, valid)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)
    # The export runs without mdlmpe_ds, so it keeps its own copy of the padding rule: the same.
    from mdlmpe_ds.attention.common import masked_key_bias
    from mdlmpe_ds.hub.modeling_mdlmpe import _masked_key_value

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert _masked_key_value(dtype) == masked_key_bias(dtype), dtype


def test_dream_export_under_the_official_generation_convention(tmp_path, qwen_tokenizer_dir):
    """Official Dream code shifts the model's logits itself (generation_utils.py ``_sample``:
    ``cat([logits[:, :1], logits[:, :-1]])``, docs/models.md §2.3). On our Dream export that shift
    gives our own sampler's logits at every position after the first, so the official sampler picks
    the tokens ours picks; an export returning pre-shifted logits would be read one token off."""
    model = _trained_looking("dream", "mdlmpe")
    save_pretrained(model, tmp_path, model.config)
    finish_export(tmp_path, "dream", qwen_tokenizer_dir)
    theirs = AutoModel.from_pretrained(tmp_path, trust_remote_code=True).eval()
    ids, _ = _batch(model.config)
    with torch.no_grad():
        logits = theirs(ids).logits  # what the official code receives
        official = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)  # what it then decodes
        want = model(ids)
    torch.testing.assert_close(official[:, 1:], want[:, 1:], rtol=1e-5, atol=1e-5)
    masked = ids == model.config.mask_token_id
    assert torch.equal(official.argmax(-1)[masked], want.argmax(-1)[masked])


def test_masked_lm_auto_class_and_upstream_keys(tmp_path, qwen_tokenizer_dir):
    model = _trained_looking("llada", "rope")
    save_pretrained(model, tmp_path, model.config)
    finish_export(tmp_path, "llada", qwen_tokenizer_dir)
    raw = json.loads((tmp_path / "config.json").read_text())
    # A RoPE-only export keeps every upstream key with its value (the official code reads them).
    upstream = hf_config_dict(model.config)
    assert {k: raw[k] for k in upstream} == upstream
    assert raw["auto_map"]["AutoModel"].startswith("modeling_mdlmpe.")
    assert (tmp_path / "modeling_mdlmpe.py").is_file()
    masked_lm = AutoModelForMaskedLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    ids, _ = _batch(model.config)
    with torch.no_grad():
        torch.testing.assert_close(masked_lm(ids).logits, model(ids), rtol=1e-5, atol=1e-5)


# An upstream-style template that differs from training's renderer (like LLaDA-8B-Instruct's, it
# appends an assistant header even when add_generation_prompt is False).
UPSTREAM_STYLE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{{ '<|im_start|>assistant\\n' }}"
)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_exported_chat_template_renders_as_training(tmp_path, qwen_tokenizer_dir, family):
    upstream = tmp_path / "upstream_tokenizer"
    shutil.copytree(qwen_tokenizer_dir, upstream)
    (upstream / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((upstream / "tokenizer_config.json").read_text())
    (upstream / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": UPSTREAM_STYLE}))
    model = _trained_looking(family, "rope")
    out = tmp_path / "export"
    save_pretrained(model, out, model.config)
    done = finish_export(out, family, upstream)
    source = AutoTokenizer.from_pretrained(upstream)
    exported = AutoTokenizer.from_pretrained(out)
    training = template_for(family, source)
    assert done["chat_template"] == training.name
    for prompt in (False, True):
        messages = CONVERSATION if prompt else CONVERSATION[:3]
        want = training.render(messages, prompt)
        got = exported.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        assert got == want


@pytest.mark.parametrize(("jinja", "render"), [(LLADA_JINJA, render_llada), (CHATML_JINJA, render_chatml)])
def test_jinja_templates_equal_the_training_renderers(qwen_tokenizer_dir, jinja, render):
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    tokenizer.chat_template = jinja
    for messages in (CONVERSATION, CONVERSATION[1:3], CONVERSATION[:3]):
        for prompt in (False, True):
            got = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert got == render(messages, prompt)


def test_readme_snippet_answers_from_an_export(tmp_path):
    """The README's three-line transformers snippet, run on a tiny MDLMPE export (fixture tokenizer
    with ChatML tokens): it loads, renders the training template and fills every mask."""
    import re
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo / "tests" / "dist"))
    from sft_fixtures import make_tokenizer

    tok = make_tokenizer(tmp_path / "tok")
    model = _trained_looking(
        "dream", "mdlmpe", vocab_size=128, mask_token_id=3, eos_token_id=0, pad_token_id=0
    )
    export = tmp_path / "export"
    save_pretrained(model, export, model.config)
    finish_export(export, "dream", tok)
    readme = (repo / "README.md").read_text()
    snippet = re.search(r"```python\n(from transformers import AutoModel.*?)```", readme, re.S).group(1)
    assert len(snippet.strip().splitlines()) == 3
    printed = []
    namespace = {"print": printed.append}
    exec(snippet.replace("outputs/llada-sft/export", str(export)), namespace)
    answer = printed[0]
    assert isinstance(answer, str) and "<|mask|>" not in answer
    loaded = namespace["model"]
    ids = torch.tensor([[5, 6, 3, 3, 7, 3]])
    filled = loaded.fill_masks(ids, steps=2)
    assert not bool((filled == 3).any()) and torch.equal(filled[ids != 3], ids[ids != 3])


def test_push_to_hub_uploads_the_export_to_a_local_mock_of_the_upload_api(
    tmp_path, qwen_tokenizer_dir, monkeypatch
):
    """--push_to_hub against a local HTTP server speaking the three calls an upload makes (create
    repo, preupload, commit); every export file arrives byte for byte."""
    import base64
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from mdlmpe_ds.hub.export import push_to_hub

    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")  # the mock is local even behind a proxy
    received: dict[str, bytes] = {}
    calls: list[str] = []

    class Hub(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            payload = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            path = self.path.split("?")[0]
            calls.append(path)
            base = f"http://127.0.0.1:{self.server.server_port}"
            if path == "/api/repos/create":
                self._reply(
                    {"url": f"{base}/{json.loads(payload)['organization']}/{json.loads(payload)['name']}"}
                )
            elif "/preupload/" in path:
                files = json.loads(payload)["files"]
                self._reply(
                    {
                        "files": [
                            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files
                        ]
                    }
                )
            elif "/commit/" in path:
                for line in payload.splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        received[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                self._reply({"commitUrl": f"{base}/org/tiny/commit/{'a' * 40}", "commitOid": "a" * 40})
            else:
                self.send_error(404)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        model = _trained_looking("llada", "mdlmpe")
        out = tmp_path / "export"
        save_pretrained(model, out, model.config)
        finish_export(out, "llada", qwen_tokenizer_dir)
        url = push_to_hub(out, "org/tiny", endpoint=f"http://127.0.0.1:{server.server_port}", token="hf_test")
    finally:
        server.shutdown()
    assert calls[0] == "/api/repos/create" and calls[-1].startswith("/api/models/org/tiny/commit/")
    assert url.endswith("/commit/" + "a" * 40)
    local = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert received == local
    assert "modeling_mdlmpe.py" in received and "model.safetensors" in received


def test_loading_an_exports_tokenizer_asks_nothing_and_reads_no_stdin(tmp_path, qwen_tokenizer_dir):
    """An export's config has an auto_map (its modeling code); transformers' AutoTokenizer then asked
    "Do you wish to run the custom code? [y/N]" on stdout and read the answer from stdin, so
    `generate.py > out.txt` began with the question and `printf 'prompt' | generate.py --chat`
    lost its prompts to it. Our loaders pass trust_remote_code=False: nothing asked, stdin untouched."""
    import subprocess
    import sys

    model = _trained_looking("llada", "rope")
    save_pretrained(model, tmp_path, model.config)
    finish_export(tmp_path, "llada", qwen_tokenizer_dir)
    code = (
        "import sys; from mdlmpe_ds.runs.common import load_tokenizer_dir; "
        "from mdlmpe_ds.evaluation.loading import load_tokenizer; "
        f"load_tokenizer_dir({str(tmp_path)!r}); load_tokenizer({str(tmp_path)!r}); "
        "print('left on stdin:', sys.stdin.read().strip())"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], input="first prompt\n", capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "custom code" not in proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("left on stdin: first prompt")
    # nor transformers' "You are using a model of type `llada` to instantiate a model of type ``"
    assert "to instantiate a model of type" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
