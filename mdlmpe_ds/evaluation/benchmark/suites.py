"""The paper's evaluations as data: which lm-eval tasks, scored how, decoded how, and why.

Every value carries its source. The paper fixes the tasks, their grouping and the few-shot counts
(Table 1's row labels, Appendix "Datasets and Evaluation Benchmarks") and the block sizes of Table 3;
it is silent on the decoding budget, the sampler and the likelihood estimator, which therefore come
from the official evaluation settings of the two backbones:

- LLaDA: ``EVAL.md``, ``eval_llada.py`` and ``eval_llada_lm_eval.sh`` of github ML-GSAI/LLaDA at
  commit b7e6c35 (cited below as ``LLaDA <file>:<line>``);
- Dream: ``eval_instruct/eval.sh`` (Dream-v0-Instruct's generation settings), ``eval/eval_dream_mc.sh``
  and ``eval/eval.py`` (likelihood scoring) of github DreamLM/Dream (the Dream-org models' code) at
  commit fac0a7f (``Dream <file>:<line>``).

Where neither says anything the value is this project's choice and says so. Multiple-choice tasks are
scored by the conditional diffusion ELBO of each option for both families, as both base models'
likelihood evaluations do (LLaDA ``eval_llada_lm_eval.sh``, Dream ``eval/eval_dream_mc.sh``).

Item counts (``items``) are the sizes of the evaluated splits, used only by ``--dry-run``'s estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

LLADA = "ML-GSAI/LLaDA@b7e6c35"
DREAM = "DreamLM/Dream@fac0a7f"
PAPER_T1 = "paper Table 1 row label / Appendix 'Datasets and Evaluation Benchmarks'"
OURS = "this project (paper and official scripts silent)"
SPLIT = "size of the lm-eval task's evaluation split"
LIKELIHOOD = "loglikelihood"
GENERATE = "generate"
CODE = "code"
FAMILIES = ("llada", "dream")


@dataclass(frozen=True)
class Sourced:
    """A setting and where it comes from."""

    value: Any
    source: str


def _s(value: Any, source: str) -> Sourced:
    return Sourced(value, source)


@dataclass(frozen=True)
class TaskSpec:
    """One row of a suite: an lm-eval task, how it is scored and, per family, how it is decoded.

    ``decoding[family]`` maps ``MDLMPEEvalLM`` keyword arguments (mc_num, gen_length, steps,
    block_length, algorithm, temperature, top_p, suppress_eos, cfg_scale) to sourced values.
    ``metric`` is lm-eval's ``metric,filter`` key; the filter is the task's answer extractor.
    """

    label: str  # the paper's row name
    group: str  # the paper's row group
    task: Sourced  # lm-eval task (or group) name
    num_fewshot: Sourced
    kind: str  # LIKELIHOOD | GENERATE | CODE (code runs model-written programs)
    metric: Sourced
    items: Sourced
    decoding: dict[str, dict[str, Sourced]]
    choices: int = 1  # options per item (likelihood tasks; for the forward-pass estimate)
    subtasks: int = 1  # lm-eval group members (``--limit`` applies to each)
    variant: str = ""  # e.g. "B=32" in the block-size study

    @property
    def key(self) -> str:
        """File-name-safe identity inside a suite (task, shots, variant)."""
        parts = [self.task.value, f"{self.num_fewshot.value}shot", self.variant.replace("=", "")]
        return "-".join(p for p in parts if p)

    def row_label(self) -> str:
        return f"{self.label} ({self.num_fewshot.value})"

    def display(self) -> str:
        """The row label with its variant (``MMLU (5) B=16``)."""
        return f"{self.row_label()} {self.variant}".strip()


@dataclass(frozen=True)
class Suite:
    name: str
    title: str
    layout: str  # "by-task" (paper Table 1) or "by-variant" (paper Table 3)
    tasks: tuple[TaskSpec, ...] = field(default_factory=tuple)


# ----------------------------------------------------------------------------------- decoding
def _likelihood(llada_mc: Sourced, dream_mc: Sourced) -> dict[str, dict[str, Sourced]]:
    return {
        "llada": {
            "mc_num": llada_mc,
            "cfg_scale": _s(0.0, f"{LLADA} EVAL.md:41 (LLaDA's Table 1 reports results without CFG)"),
        },
        "dream": {
            "mc_num": dream_mc,
            "cfg_scale": _s(0.0, f"{DREAM} eval/eval.py:40,342 (guidance 1.0 = off)"),
        },
    }


_DREAM_MC = f"{DREAM} eval/eval.py:39 (mc_num=128; eval_dream_mc.sh:2-3 runs this task with the default)"


def _llada_gen(length: int, line: str, suppress_eos: bool = False) -> dict[str, Sourced]:
    src = f"{LLADA} EVAL.md:{line} (LLaDA-8B-Instruct gen_length = block_length)"
    return {
        "gen_length": _s(length, src),
        "block_length": _s(length, src + "; pure diffusion, EVAL.md:70"),
        "steps": _s(
            length, f"{LLADA} opencompass/examples/llada_instruct_gen_*.py:9 (gen_steps = gen_length)"
        ),
        "algorithm": _s("low_confidence", f"{LLADA} eval_llada.py:45 (remasking='low_confidence')"),
        "temperature": _s(0.0, f"{LLADA} eval_llada.py:265 (temperature=0)"),
        "suppress_eos": _s(suppress_eos, f"{LLADA} EVAL.md:76 (logits_eos_inf)"),
    }


def _dream_gen(length: int, line: int) -> dict[str, Sourced]:
    src = f"{DREAM} eval_instruct/eval.sh:{line}"
    return {
        "gen_length": _s(length, f"{src} (max_new_tokens)"),
        "steps": _s(length, f"{src} (diffusion_steps)"),
        "algorithm": _s("entropy", f"{src} (alg=entropy)"),
        "temperature": _s(0.1, f"{src} (temperature=0.1)"),
        "top_p": _s(0.9, f"{src} (top_p=0.9)"),
    }


def _gen(llada: dict[str, Sourced], dream: dict[str, Sourced]) -> dict[str, dict[str, Sourced]]:
    return {"llada": llada, "dream": dream}


# ----------------------------------------------------------------------------------- tasks
def _mmlu() -> TaskSpec:
    return TaskSpec(
        label="MMLU",
        group="general",
        task=_s("mmlu", PAPER_T1),
        num_fewshot=_s(5, "paper Table 1 'MMLU (5)'"),
        kind=LIKELIHOOD,
        metric=_s("acc,none", OURS + ": accuracy of the likeliest option"),
        items=_s(14042, SPLIT + " (test)"),
        choices=4,
        subtasks=57,
        decoding=_likelihood(
            _s(1, f"{LLADA} eval_llada_lm_eval.sh:24 (mc_num=1)"),
            _s(1, f"{_DREAM_MC}; a one-token answer makes every row the exact log-probability, so 1 row"),
        ),
    )


def _arc() -> TaskSpec:
    return TaskSpec(
        label="ARC-C",
        group="general",
        task=_s("arc_challenge", PAPER_T1),
        num_fewshot=_s(0, "paper Table 1 'ARC-C (0)'"),
        kind=LIKELIHOOD,
        metric=_s("acc_norm,none", OURS + ": length-normalised accuracy, as the Open LLM Leaderboard"),
        items=_s(1172, SPLIT + " (test)"),
        choices=4,
        decoding=_likelihood(_s(128, f"{LLADA} eval_llada_lm_eval.sh:16 (mc_num=128)"), _s(128, _DREAM_MC)),
    )


def _hellaswag() -> TaskSpec:
    return TaskSpec(
        label="HellaSwag",
        group="general",
        task=_s("hellaswag", PAPER_T1),
        num_fewshot=_s(0, "paper Table 1 'HellaSwag (0)'"),
        kind=LIKELIHOOD,
        metric=_s("acc_norm,none", OURS + ": length-normalised accuracy, as the Open LLM Leaderboard"),
        items=_s(10042, SPLIT + " (validation)"),
        choices=4,
        decoding=_likelihood(_s(128, f"{LLADA} eval_llada_lm_eval.sh:18 (mc_num=128)"), _s(128, _DREAM_MC)),
    )


TABLE1 = Suite(
    name="paper-table1",
    title="Instruction post-training: RoPE vs MDLMPE (paper Table 1)",
    layout="by-task",
    tasks=(
        _mmlu(),
        TaskSpec(
            label="MMLU-Pro",
            group="general",
            task=_s("mmlu_pro", PAPER_T1),
            num_fewshot=_s(0, "paper Table 1 'MMLU-Pro (0)'"),
            kind=GENERATE,
            metric=_s("exact_match,custom-extract", "lm-eval mmlu_pro's own extractor ('answer is (X)')"),
            items=_s(12032, SPLIT + " (test)"),
            subtasks=14,
            decoding=_gen(_llada_gen(256, "74-75"), _dream_gen(128, 14)),
        ),
        _hellaswag(),
        _arc(),
        TaskSpec(
            label="GSM8K",
            group="math and reasoning",
            task=_s("gsm8k", PAPER_T1),
            num_fewshot=_s(4, "paper Table 1 'GSM8K (4)'"),
            kind=GENERATE,
            metric=_s("exact_match,flexible-extract", OURS + ": lm-eval gsm8k's last-number extractor"),
            items=_s(1319, SPLIT + " (test)"),
            decoding=_gen(_llada_gen(512, "74-75"), _dream_gen(256, 25)),
        ),
        TaskSpec(
            label="MATH",
            group="math and reasoning",
            task=_s(
                "minerva_math", f"paper 'Hendrycks MATH'; lm-eval task as {LLADA} eval_llada_lm_eval.sh:36"
            ),
            num_fewshot=_s(4, "paper Table 1 'MATH (4)'"),
            kind=GENERATE,
            metric=_s("exact_match,none", "lm-eval minerva_math's own answer normalisation"),
            items=_s(5000, SPLIT + " (test)"),
            subtasks=7,
            decoding=_gen(_llada_gen(512, "74-75"), _dream_gen(512, 36)),
        ),
        TaskSpec(
            label="HumanEval",
            group="code",
            task=_s("humaneval", PAPER_T1),
            num_fewshot=_s(0, "paper Table 1 'HumanEval (0)'"),
            kind=CODE,
            metric=_s("pass@1,create_test", "lm-eval humaneval's own execution metric"),
            items=_s(164, SPLIT + " (test)"),
            decoding=_gen(_llada_gen(512, "74-75", suppress_eos=True), _dream_gen(768, 58)),
        ),
        TaskSpec(
            label="MBPP",
            group="code",
            task=_s("mbpp", PAPER_T1),
            num_fewshot=_s(4, "paper Table 1 'MBPP (4)'"),
            kind=CODE,
            metric=_s("pass_at_1,none", "lm-eval mbpp's own execution metric"),
            items=_s(500, SPLIT + " (test)"),
            decoding=_gen(_llada_gen(256, "74-75"), _dream_gen(1024, 69)),
        ),
    ),
)

PAPER_T3 = "paper Table 3 (block sizes 16, 32, 64)"


def _with_block(spec: TaskSpec, block: int) -> TaskSpec:
    """``spec`` scored as block diffusion with blocks of ``block`` tokens (``likelihood.blockwise_elbo``)."""
    extra = {
        "likelihood_block": _s(block, PAPER_T3),
        "block_context": _s("full", OURS + ": the project's default regime (later blocks as masks)"),
    }
    decoding = {family: {**d, **extra} for family, d in spec.decoding.items()}
    return replace(spec, decoding=decoding, variant=f"B={block}")


TABLE3 = Suite(
    name="paper-table3",
    title="Block-size study: RoPE vs MDLMPE at each block size (paper Table 3)",
    layout="by-variant",
    tasks=tuple(_with_block(make(), b) for b in (16, 32, 64) for make in (_mmlu, _arc, _hellaswag)),
)

SUITES: dict[str, Suite] = {s.name: s for s in (TABLE1, TABLE3)}


def get_suite(name: str) -> Suite:
    if name not in SUITES:
        raise KeyError(f"unknown suite {name!r}; choose one of {sorted(SUITES)}")
    return SUITES[name]


def decoding_for(spec: TaskSpec, family: str) -> dict[str, Any]:
    """The adapter keyword arguments of ``spec`` for a model family (plain values)."""
    if family not in spec.decoding:
        raise ValueError(
            f"{spec.label}: no decoding settings for family {family!r} ({sorted(spec.decoding)})"
        )
    return {k: v.value for k, v in spec.decoding[family].items()}


def forward_passes(spec: TaskSpec, decoding: dict[str, Any], items: int) -> int:
    """Sequence forwards to score ``items`` documents under ``decoding``: options x Monte-Carlo rows
    for likelihood tasks, denoising steps for generation; x2 under classifier-free guidance."""
    per_item = spec.choices * int(decoding["mc_num"]) if spec.kind == LIKELIHOOD else int(decoding["steps"])
    return items * per_item * (2 if float(decoding.get("cfg_scale", 0.0)) > 0 else 1)


DECODING_KEYS = (
    "mc_num",
    "likelihood_block",
    "block_context",
    "gen_length",
    "steps",
    "block_length",
    "algorithm",
    "temperature",
    "top_p",
    "suppress_eos",
    "cfg_scale",
)


def select(suite: Suite, only: list[str] | None) -> Suite:
    """The rows matching any selector: a row label (``MMLU``), an lm-eval task (``gsm8k``), a group
    (``code``) or a variant (``B=16``), case-insensitive; a selector that matches nothing is an error."""
    if not only:
        return suite
    wanted = {o.lower() for o in only}

    def names(spec: TaskSpec) -> set[str]:
        return {spec.label.lower(), str(spec.task.value).lower(), spec.group.lower(), spec.variant.lower()}

    unknown = sorted(o for o in wanted if not any(o in names(s) for s in suite.tasks))
    if unknown:
        choices = sorted({n for s in suite.tasks for n in names(s) if n})
        raise ValueError(f"--only {unknown} match no row of {suite.name}; choose from {choices}")
    return replace(suite, tasks=tuple(s for s in suite.tasks if names(s) & wanted))


def parse_overrides(pairs: list[str] | None, suite: Suite) -> dict[str, Any]:
    """``KEY=VALUE`` decoding overrides (ints, floats, true/false, else text), checked against the
    suite: a key no row uses is an error rather than a silently ignored setting."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, text = pair.partition("=")
        if not sep or key not in DECODING_KEYS:
            raise ValueError(f"--set {pair!r}: expected KEY=VALUE with KEY one of {DECODING_KEYS}")
        if not any(key in d for s in suite.tasks for d in s.decoding.values()):
            raise ValueError(f"--set {key}: no row of {suite.name} has this setting")
        value: Any = text
        for cast in (int, float):
            try:
                value = cast(text)
                break
            except ValueError:
                continue
        if text.lower() in ("true", "false"):
            value = text.lower() == "true"
        out[key] = value
    return out
