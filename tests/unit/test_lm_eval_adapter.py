"""The conditional ELBO estimator and the lm-eval adapter, through lm-eval's own evaluator on local tasks."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from mdlmpe_ds.evaluation.likelihood import conditional_elbo, stratified_from, stratified_mask_counts
from mdlmpe_ds.models import DiffusionLM, preset

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is the optional 'eval' extra")


class CharTokenizer:
    """One token per character (code point < 500, inside llada-tiny's 512-token vocabulary)."""

    bos_token_id = None
    name_or_path = "char"

    def encode(self, text, add_special_tokens=False):
        ids = [ord(c) for c in text]
        assert max(ids, default=0) < 500, text
        return ids

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i < 500)


class EchoFirstToken(torch.nn.Module):
    """A tiny MDLMPE DiffusionLM whose logits get +8 on the row's first token: it 'knows' that the
    answer repeats the first character of the question. Deterministic, so task scores are exact."""

    def __init__(self, encoding="mdlmpe"):
        super().__init__()
        torch.manual_seed(0)
        self.base = DiffusionLM(preset("llada-tiny", position_encoding=encoding))
        self.config = self.base.config

    def forward(self, input_ids, valid=None):
        logits = self.base(input_ids, valid=valid)
        bias = torch.nn.functional.one_hot(input_ids[:, 0], logits.shape[-1]).to(logits.dtype) * 8.0  # [B, V]
        return logits + bias[:, None, :]


@pytest.fixture(scope="module")
def echo():
    return EchoFirstToken().eval()


# ------------------------------------------------------------------------------------ estimator
def test_stratified_counts_are_uniform_per_row_and_spread_over_the_batch():
    for T, b in ((1, 4), (5, 10), (7, 7), (3, 32), (6, 4), (9, 2)):
        rows = torch.stack([stratified_from(k0, T, b) for k0 in range(1, T + 1)])  # [T, b]
        for i in range(b):  # k0 ~ U{1..T} => every row's k ~ U{1..T} (unbiased ELBO)
            assert sorted(rows[:, i].tolist()) == list(range(1, T + 1))
        counts = torch.bincount(rows[0], minlength=T + 1)[1:]
        assert counts.max() - counts.min() <= 1
    k = stratified_mask_counts(5, 10, torch.Generator().manual_seed(0))
    assert k.min() >= 1 and k.max() <= 5


def test_elbo_of_one_token_is_its_exact_log_probability(echo):
    context, target = [72, 105, 33], [104]
    g = torch.Generator().manual_seed(0)
    elbo = conditional_elbo(echo, context, target, echo.config.mask_token_id, g, mc_num=4, batch_size=2)
    with torch.no_grad():
        logits = echo(torch.tensor([[*context, echo.config.mask_token_id]]))
    exact = torch.log_softmax(logits[0, -1].double(), -1)[104].item()
    # The estimator's log-softmax runs in float32: its error is a few ulps of the largest magnitude
    # involved (the logits and the log-sum-exp), not a fixed 1e-6 (seen: 1.25e-6 on an AVX2 EPYC).
    scale = max(abs(exact), logits[0, -1].abs().max().item(), 1.0)
    assert elbo == pytest.approx(exact, abs=8 * torch.finfo(torch.float32).eps * scale)


def test_elbo_matches_its_expectation_by_enumeration(echo):
    """E_k E_positions[-sum CE * T / k] enumerated over every (k, mask) for T = 3, vs the MC estimate."""
    mask = echo.config.mask_token_id
    context, target = [65, 66], [67, 68, 69]
    T = len(target)
    expected = 0.0
    with torch.no_grad():
        for k in range(1, T + 1):
            subsets = list(itertools.combinations(range(T), k))
            for subset in subsets:
                noisy = list(target)
                for j in subset:
                    noisy[j] = mask
                logp = torch.log_softmax(echo(torch.tensor([context + noisy]))[0].double(), -1)
                ll = sum(logp[len(context) + j, target[j]].item() for j in subset)
                expected += ll * T / k / len(subsets) / T
    g = torch.Generator().manual_seed(1)
    estimate = conditional_elbo(echo, context, target, mask, g, mc_num=600, batch_size=60)
    assert estimate == pytest.approx(expected, rel=0.03)


def test_blockwise_elbo_is_the_chain_of_block_conditionals(echo):
    """Blocks of one token make every term exact: log p(x) = sum_t log p(x_t | ctx, x_<t), with the
    later tokens present as masks (full context) or absent (blocked); one block is the plain ELBO."""
    from mdlmpe_ds.evaluation.likelihood import blockwise_elbo

    mask = echo.config.mask_token_id
    context, target = [72, 105], [65, 66, 67]

    def chain(later_as_masks: bool) -> float:
        total = 0.0
        with torch.no_grad():
            for t in range(len(target)):
                tail = [mask] * (len(target) - t - 1) if later_as_masks else []
                ids = torch.tensor([context + target[:t] + [mask] + tail])
                logp = torch.log_softmax(echo(ids)[0, len(context) + t].double(), -1)
                total += logp[target[t]].item()
        return total

    for block_context, later in (("full", True), ("blocked", False)):
        g = torch.Generator().manual_seed(0)
        got = blockwise_elbo(echo, context, target, mask, g, 1, block_context, mc_num=2, batch_size=2)
        assert got == pytest.approx(chain(later), abs=1e-4)
    assert chain(True) != pytest.approx(chain(False), abs=1e-4)  # the regimes differ
    whole = blockwise_elbo(echo, context, target, mask, torch.Generator().manual_seed(5), 8, mc_num=6)
    plain = conditional_elbo(echo, context, target, mask, torch.Generator().manual_seed(5), mc_num=6)
    assert whole == plain
    with pytest.raises(ValueError, match="block_context"):
        blockwise_elbo(echo, context, target, mask, torch.Generator(), 2, "half")


def test_adapter_scores_likelihood_block_by_block(echo):
    from mdlmpe_ds.evaluation.likelihood import blockwise_elbo
    from mdlmpe_ds.evaluation.lm_eval_adapter import MDLMPEEvalLM, _seed_for

    class Req:
        def __init__(self, *args):
            self.args = args

    lm = MDLMPEEvalLM(echo, tokenizer=CharTokenizer(), mc_num=4, likelihood_block=2, block_context="blocked")
    ((ll, _),) = lm.loglikelihood([Req("ab", " abc")])
    g = torch.Generator().manual_seed(_seed_for(lm.seed, "ab", " abc"))
    ctx, cont = [97, 98], [ord(c) for c in " abc"]
    assert ll == blockwise_elbo(echo, ctx, cont, echo.config.mask_token_id, g, 2, "blocked", 4, 32)
    ((plain, _),) = MDLMPEEvalLM(echo, tokenizer=CharTokenizer(), mc_num=4).loglikelihood([Req("ab", " abc")])
    assert ll != plain


# ------------------------------------------------------------------------------------ lm-eval
def _write_tasks(tmp_path):
    letters = "abcdefghij"
    mc = []
    for c in letters:  # the right answer (the question's letter, repeated) at a varying index
        gold = ord(c) % 3
        others = ["xxx", "yyy", "zzz"]
        mc.append({"question": f"{c}?", "choices": [*others[:gold], c * 3, *others[gold:2]], "answer": gold})
    gen = [{"question": f"{c}:", "answer": c * 4} for c in letters[:4]]

    (tmp_path / "mc.jsonl").write_text("\n".join(json.dumps(d) for d in mc))
    (tmp_path / "gen.jsonl").write_text("\n".join(json.dumps(d) for d in gen))

    def task(name, data, body):  # a local JSONL dataset; the datasets cache stays inside tmp_path
        head = (
            f"task: {name}\ndataset_path: json\ntest_split: test\n"
            f"dataset_kwargs:\n  cache_dir: {tmp_path / 'cache'}\n"
            f"  data_files:\n    test: {tmp_path / data}\n"
        )
        (tmp_path / f"{name}.yaml").write_text(head + body)

    task(
        "mdlmpe_local_mc",
        "mc.jsonl",
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n",
    )
    task(
        "mdlmpe_local_gen",
        "gen.jsonl",
        "output_type: generate_until\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 4\n'
        "metric_list:\n  - metric: exact_match\n",
    )
    return len(mc), len(gen)


def test_adapter_answers_local_tasks_through_lm_eval(tmp_path, echo, monkeypatch):
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    from mdlmpe_ds.evaluation.lm_eval_adapter import MDLMPEEvalLM

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    n_mc, n_gen = _write_tasks(tmp_path)
    lm = MDLMPEEvalLM(
        echo, tokenizer=CharTokenizer(), mc_num=4, mc_batch_size=4, batch_size=3, block_length=2
    )
    calls = {"loglikelihood": 0, "generate_until": 0}
    for name in calls:
        original = getattr(lm, name)

        def counted(requests, *a, _name=name, _orig=original, **k):
            calls[_name] += len(requests)
            return _orig(requests, *a, **k)

        setattr(lm, name, counted)
    results = simple_evaluate(
        model=lm,
        tasks=["mdlmpe_local_mc", "mdlmpe_local_gen"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True,
    )
    res = results["results"]
    assert res["mdlmpe_local_mc"]["acc,none"] == 1.0
    assert res["mdlmpe_local_gen"]["exact_match,none"] == 1.0
    assert calls == {"loglikelihood": 3 * n_mc, "generate_until": n_gen}
    assert results["config"]["truncated_requests"] == {
        "loglikelihood": 0,
        "generate_until": 0,
    }  # get_model_info
    outputs = [s["filtered_resps"][0] for s in results["samples"]["mdlmpe_local_gen"]]
    assert outputs == ["aaaa", "bbbb", "cccc", "dddd"]


def test_adapter_scores_are_independent_of_batching(echo):
    from mdlmpe_ds.evaluation.lm_eval_adapter import MDLMPEEvalLM

    class Req:
        def __init__(self, *args):
            self.args = args

    reqs = [Req(text, {"until": ["\n"], "max_gen_toks": 4}) for text in ("q:", "zz", "r:")]
    opts = dict(tokenizer=CharTokenizer(), temperature=1.0, block_length=2)
    one = MDLMPEEvalLM(echo, batch_size=1, **opts).generate_until(reqs)
    three = MDLMPEEvalLM(echo, batch_size=3, **opts).generate_until(reqs[::-1])[::-1]
    assert one == three
    ll = MDLMPEEvalLM(echo, mc_num=8, **opts).loglikelihood([Req("ab", " aa"), Req("ab", " bb")])
    again = MDLMPEEvalLM(echo, mc_num=8, **opts).loglikelihood([Req("ab", " bb"), Req("ab", " aa")])[::-1]
    assert ll == again and ll[0][0] > ll[1][0]


_DP_SCRIPT = """
import importlib.util, json, sys
from pathlib import Path

from lm_eval.evaluator import simple_evaluate
from lm_eval.tasks import TaskManager

from mdlmpe_ds.evaluation.lm_eval_adapter import MDLMPEEvalLM

spec = importlib.util.spec_from_file_location("helpers", sys.argv[1])
helpers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(helpers)
tmp = Path(sys.argv[2])
lm = MDLMPEEvalLM(helpers.EchoFirstToken().eval(), tokenizer=helpers.CharTokenizer(), device="cpu",
                  mc_num=4, mc_batch_size=4, batch_size=2, block_length=2)
handled = {}
for name in ("loglikelihood", "generate_until"):
    original = getattr(lm, name)
    def counted(requests, *a, _name=name, _orig=original, **k):
        handled[_name] = handled.get(_name, 0) + len(requests)
        return _orig(requests, *a, **k)
    setattr(lm, name, counted)
results = simple_evaluate(model=lm, tasks=["mdlmpe_local_mc", "mdlmpe_local_gen"],
                          task_manager=TaskManager(include_path=str(tmp), include_defaults=False),
                          log_samples=True)
(tmp / f"handled{lm.rank}.json").write_text(json.dumps(handled))
if lm.rank == 0:
    samples = {task: len(docs) for task, docs in results["samples"].items()}
    (tmp / "results.json").write_text(json.dumps({"results": results["results"], "samples": samples}))
"""


@pytest.mark.dist
def test_adapter_data_parallel_under_torchrun(tmp_path):
    """Two gloo processes: lm-eval shards the requests by rank and rank 0 gathers the same scores."""
    import os
    import socket
    import subprocess
    import sys

    n_mc, n_gen = _write_tasks(tmp_path)
    script = tmp_path / "dp.py"
    script.write_text(_DP_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(port),
        str(script),
        __file__,
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    gathered = json.loads((tmp_path / "results.json").read_text())
    results = gathered["results"]
    assert gathered["samples"] == {"mdlmpe_local_mc": n_mc, "mdlmpe_local_gen": n_gen}  # all ranks' docs
    assert results["mdlmpe_local_mc"]["acc,none"] == 1.0
    assert results["mdlmpe_local_gen"]["exact_match,none"] == 1.0
    handled = [json.loads((tmp_path / f"handled{r}.json").read_text()) for r in range(2)]
    assert sum(h["loglikelihood"] for h in handled) == 3 * n_mc
    assert sum(h["generate_until"] for h in handled) == n_gen
    assert all(h["loglikelihood"] > 0 and h["generate_until"] > 0 for h in handled)


def test_adapter_truncates_long_contexts_from_the_left(echo, monkeypatch):
    from mdlmpe_ds.evaluation import lm_eval_adapter

    class Req:
        def __init__(self, *args):
            self.args = args

    seen = []
    monkeypatch.setattr(
        lm_eval_adapter, "conditional_elbo", lambda model, ctx, cont, *a: seen.append((ctx, cont)) or -1.0
    )
    lm = lm_eval_adapter.MDLMPEEvalLM(echo, tokenizer=CharTokenizer(), max_length=8)
    lm.loglikelihood([Req("abcdefgh", " xy"), Req("ab", " xy")])
    assert seen == [([ord(c) for c in "defgh"], [ord(c) for c in " xy"]), ([97, 98], [ord(c) for c in " xy"])]
    with pytest.raises(ValueError, match="does not fit"):
        lm.loglikelihood([Req("a", " " + "x" * 8)])


def test_rolling_loglikelihood_scores_every_token_once(echo, monkeypatch):
    from mdlmpe_ds.evaluation import lm_eval_adapter

    class Req:
        def __init__(self, *args):
            self.args = args

    windows = []

    def fake_elbo(model, ctx, cont, *a):
        windows.append((list(ctx), list(cont)))
        return -float(len(cont))

    monkeypatch.setattr(lm_eval_adapter, "conditional_elbo", fake_elbo)
    lm = lm_eval_adapter.MDLMPEEvalLM(echo, tokenizer=CharTokenizer(), max_length=4)
    text = "abcdefghij"
    assert lm.loglikelihood_rolling([Req(text)]) == [-10.0]
    assert [t for _, cont in windows for t in cont] == [ord(c) for c in text]  # each token once, in order
    assert windows[0][0] == [echo.config.eos_token_id]  # the first window is conditioned on the prefix
    assert all(len(ctx) + len(cont) <= 4 for ctx, cont in windows)


# ------------------------------------------------------------------------------------ refusals and warnings
class _Req:
    def __init__(self, *args):
        self.args = args


class BosCharTokenizer(CharTokenizer):
    bos_token_id = 1


def test_truncated_prompts_keep_the_bos_and_are_counted_and_reported(echo, monkeypatch, caplog):
    """Before: ``(prefix + prompt)[-room:]`` dropped the BOS with the oldest tokens, and lm-eval
    scored the cut prompts without a word (GSM8K 4-shot contexts of ~150 tokens cut to 28)."""
    import logging
    from types import SimpleNamespace

    from mdlmpe_ds.evaluation import lm_eval_adapter

    prompts, scored = [], []

    def fake_generate(model, rows, config, seeds):
        prompts.extend(list(r) for r in rows)
        return SimpleNamespace(responses=torch.full((len(rows), config.gen_length), echo.config.eos_token_id))

    monkeypatch.setattr(lm_eval_adapter, "generate", fake_generate)
    monkeypatch.setattr(
        lm_eval_adapter, "conditional_elbo", lambda m, ctx, cont, *a: scored.append(ctx) or -1.0
    )
    lm = lm_eval_adapter.MDLMPEEvalLM(
        echo, tokenizer=BosCharTokenizer(), add_bos=True, max_length=9, gen_length=4
    )
    gen = {"until": ["\n"], "max_gen_toks": 4}
    with caplog.at_level(logging.WARNING, logger=lm_eval_adapter.__name__):
        lm.generate_until([_Req("abcdefghij", gen), _Req("ab", gen), _Req("0123456789", gen)])
    assert prompts[0] == [1, *map(ord, "ghij")] and prompts[1] == [1, 97, 98]  # BOS + the newest 4 tokens
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 of 3 generate_until requests" in warnings[0]  # once per call
    assert "6 tokens cut on average, at most 6" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=lm_eval_adapter.__name__):
        lm.loglikelihood([_Req("abcdefghij", " xy"), _Req("a", " xy")])
    assert scored[0] == [1, *map(ord, "fghij")] and scored[1] == [1, 97]  # 9 = BOS + 5 + " xy" (3)
    assert "1 of 2 loglikelihood requests" in caplog.text
    assert lm.truncated == {"loglikelihood": 1, "generate_until": 2}
    assert lm.get_model_info()["truncated_requests"] == lm.truncated  # lm-eval's results' config


def test_gen_length_not_a_whole_number_of_blocks_is_refused_at_construction(echo, caplog):
    """Before: gen_length=5, block_length=4 decoded 8 tokens without a word (launch/generate.py
    refuses the same combination)."""
    import logging

    from mdlmpe_ds.evaluation.lm_eval_adapter import MDLMPEEvalLM

    with pytest.raises(
        ValueError, match=r"gen_length=5 is not a multiple of block_length=4.*decode 8 tokens"
    ):
        MDLMPEEvalLM(echo, tokenizer=CharTokenizer(), gen_length=5, block_length=4)
    lm = MDLMPEEvalLM(echo, tokenizer=CharTokenizer(), gen_length=8, block_length=4)
    assert lm._sampler_config({"max_gen_toks": 3}).gen_length == 8
    # The task's max_gen_toks (no gen_length given) cannot be refused from here: rounded up, loudly.
    from_task = MDLMPEEvalLM(echo, tokenizer=CharTokenizer(), block_length=4)
    with caplog.at_level(logging.WARNING, logger="mdlmpe_ds.evaluation.lm_eval_adapter"):
        assert from_task._sampler_config({"max_gen_toks": 5}).gen_length == 8
    assert "max_gen_toks=5 is not a multiple of model_args block_length=4; decoding 8 tokens" in caplog.text


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("mc_num", 0, "model_args mc_num=0: must be >= 1"),
        ("mc_batch_size", 0, "model_args mc_batch_size=0: must be >= 1"),
        ("gen_length", -5, "model_args gen_length=-5: must be >= 1"),
        ("gen_length", "abc", "model_args gen_length='abc': expected a whole number"),
        ("steps", 0, "model_args steps=0: must be >= 1"),
        ("block_length", 0, "model_args block_length=0: must be >= 1"),
        ("likelihood_block", 0, "model_args likelihood_block=0: must be >= 1"),
        ("max_length", 1, "model_args max_length=1: must be >= 2"),
        ("algorithm", "bogus", "model_args algorithm='bogus': unknown sampling algorithm"),
        ("block_context", "half", "model_args block_context='half'"),
        ("temperature", -1.0, "model_args temperature=-1.0: must be >= 0"),
        ("top_p", 5, "model_args top_p=5.0: must be in"),
        ("suppress_eos", "maybe", "model_args suppress_eos='maybe': expected true or false"),
    ],
)
def test_bad_model_args_are_refused_at_construction_naming_the_key(key, value, message):
    """Before: mc_num=0 failed at the first request as 'mc_num=0 and batch_size=32 must be >= 1'
    (a batch size the user never set); the check now runs before any model is loaded."""
    from mdlmpe_ds.evaluation.lm_eval_adapter import MDLMPEEvalLM

    with pytest.raises(ValueError) as err:
        MDLMPEEvalLM(
            "/nonexistent/model", tokenizer=CharTokenizer(), **{key: value}
        )  # no load: no FileNotFound
    assert message in str(err.value)
    if key != "mc_batch_size":
        assert "batch_size" not in str(err.value)
