"""Shape property test of the fast attention paths against the reference (the spec), with poisoned
allocations: every tensor torch allocates uninitialised (``torch.empty``, ``empty_like``,
``new_empty``) is filled with NaN (integers with their largest value) first, so a read of an element
that no kernel wrote fails the comparison instead of passing on whatever the allocator left there.
The poison is torch's own (``torch.use_deterministic_algorithms`` with
``torch.utils.deterministic.fill_uninitialized_memory``); each run checks that it is on.

The fused Triton kernels run in Triton's CPU interpreter, in a child process (triton 3.9 chooses
interpreter vs compiler when it decorates, see test_triton_attention.py); the blocked path runs here.
Each case compares the output and every gradient (q, k, v, the phase MLP's four tensors).

What the cases reach, and why:
- padded lengths LP that the phase kernels' key span does not divide (the last span shorter): the
  defect this test was written for (LP = 272 at span 256 left a key span unwritten). The default
  span (256) needs L > 256, slow in the interpreter, so most fast cases shrink it (16 or 32) and
  keep L small (tiles of 8 and 16: the interpreter's cost grows with the number of programs); one
  fast case runs the real sm_90 bf16 launch settings (tile 64, 1 head per
  program, phase tile 16, span 256) at L = 272.
- whole-plane launches (symmetric half plane, mirror stores) and row blocks (a small pair-buffer
  budget); batch 1-3 with ragged key padding, a padding-only sequence; GQA 1:1, 2:1, 4:1; all,
  some and no KV heads active; fp32 and bf16.
- ``make test-all`` (marker ``slow``) adds a sweep of cases drawn from the whole space with a fixed
  seed (``MDLMPE_DS_SHAPE_SEED`` draws others; the failing case's name holds every setting):
  lengths 1 ... 1100 including 255, 256, 257, 272, 320, 511, 513, 1025, under the sm_90 and sm_80
  bf16 launch settings, the fp32 ones, and small explicit tiles.

Tolerances as in test_triton_attention.py: fp32 on both sides differs by rounding only (2e-5
absolute on O(1) values); bf16 q, k, v round the output and input gradients to bf16 (3e-2).
A NaN anywhere fails (``not err <= tol``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
from dataclasses import asdict, dataclass

import pytest
import torch

TOL = {"float32": 2e-5, "bfloat16": 3e-2}
OUTPUTS = ("out", "dq", "dk", "dv", "dw1", "db1", "dw2", "db2")


@contextlib.contextmanager
def poisoned_allocations():
    """Inside: uninitialised allocations are NaN-filled (ints: their max). Restores the old mode."""
    import torch.utils.deterministic as deterministic

    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    fill = deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    deterministic.fill_uninitialized_memory = True
    try:
        if not bool(torch.empty(8).isnan().all()):
            raise AssertionError("poisoned allocations are not on: torch.empty returned non-NaN values")
        yield
    finally:
        deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@dataclass(frozen=True)
class Case:
    """One attention call. ``pads``: padded keys at the end of each sequence (-1: all of it);
    ``active``: one character per KV head; ``launch``: 'sm90' / 'sm80' (the bf16 launch settings of
    that GPU, ``triton.launch.launch_config``), 'default' (what the launcher resolves for the dtype
    in the interpreter) or 'tile=N' (tile and phase tile N, pair chunk 2); ``budget_rows``: rows per
    row block of the pair buffers (None: the whole plane in one launch); ``key_span``: the phase
    kernels' key span (None: the real one, 256)."""

    length: int
    pads: tuple[int, ...] = (0,)
    hq: int = 2
    hkv: int = 2
    active: str = "11"
    dtype: str = "float32"
    launch: str = "default"
    budget_rows: int | None = None
    key_span: int | None = None
    head_dim: int = 8
    seed: int = 0

    @property
    def name(self) -> str:
        rows = f"rows{self.budget_rows}" if self.budget_rows else "plane"
        span = f"span{self.key_span}" if self.key_span else "span256"
        pads = "-".join(str(p) for p in self.pads)
        return (
            f"L{self.length}_pad{pads}_gqa{self.hq}:{self.hkv}_act{self.active}_{self.dtype}_"
            f"{self.launch}_{rows}_{span}_s{self.seed}"
        )


#: Always run: together they reach every branch (span tail in the whole plane and in row blocks,
#: ragged padding and a padding-only sequence, GQA 4:1, partial / empty head sets, bf16, the real
#: sm_90 bf16 launch settings past 256).
FAST = [
    # LP = 48 at span 32: spans 32 + 16 (the last one short) in the symmetric whole plane; batch 3,
    # ragged padding, the last sequence all padding; GQA 2:1.
    Case(37, pads=(0, 5, -1), hq=4, hkv=2, launch="tile=16", key_span=32),
    # LP = 48 at span 32 in row blocks of 16 rows (3 launches per sequence); GQA 4:1.
    Case(45, pads=(3, 0), hq=4, hkv=1, active="1", launch="tile=16", key_span=32, budget_rows=16),
    # bf16, half the KV heads active, LP = 24 at span 16 (16 + 8).
    Case(21, pads=(2, 0), hq=4, hkv=2, active="01", dtype="bfloat16", launch="tile=8", key_span=16),
    # no KV head active: plain RoPE, no kernel launched.
    Case(19, pads=(0, 4), hq=2, hkv=2, active="00", launch="tile=8", key_span=16),
    # the sm_90 bf16 defaults (tile 64, G 1, phase tile 16, span 256): LP = 320, spans 256 + 64.
    Case(272, pads=(7,), hq=2, hkv=1, active="1", dtype="bfloat16", launch="sm90"),
    # d_h 16: 4 MDLMPE pairs in chunks of 2, so every kernel's pair-chunk loop runs twice (the
    # cases above have 2 pairs, one chunk; LLaDA's 32 pairs are 2 chunks of 16).
    Case(21, pads=(0, 3), hq=4, hkv=2, launch="tile=8", key_span=16, head_dim=16),
]


def pair_chunks(case: Case) -> int:
    """Pair chunks (the kernels' NC) ``case`` runs in the interpreter: |M| = d_h / 4 pairs in
    chunks of 2 at 'tile=N' (``_launch_kwargs``), of the launcher's 16 otherwise."""
    from mdlmpe_ds.attention.triton.launch import PairLaunchConfig, pair_chunking

    chunk = 2 if case.launch.startswith("tile=") else PairLaunchConfig().pair_chunk
    return pair_chunking(case.head_dim // 4, chunk, interpreting=True)[1]


#: The lengths every sweep includes (the issue's list: around the span, the tiles and 2^k).
SWEEP_LENGTHS = (1, 2, 15, 17, 100, 255, 256, 257, 272, 320, 511, 513, 1025, 1100)


def sweep_cases(seed: int, count: int = 24) -> list[Case]:
    """``count`` cases drawn from the whole space with ``random.Random(seed)``: first one per length
    of SWEEP_LENGTHS, then random lengths in 1 ... 1100. Long lengths take the GPU launch settings
    (tile 64 / 32: fewer, larger interpreted programs); short ones any setting."""
    rng = random.Random(seed)
    lengths = list(SWEEP_LENGTHS) + [rng.randint(1, 1100) for _ in range(max(0, count - len(SWEEP_LENGTHS)))]
    cases = []
    for i, length in enumerate(lengths):
        batch = rng.randint(1, 3)
        hkv = rng.choice((1, 2))
        hq = hkv * rng.choice((1, 2, 4))
        active = "".join(rng.choice("01") for _ in range(hkv))
        if i % 3 == 0:
            active = "1" * hkv
        dtype = rng.choice(("float32", "bfloat16"))
        if length > 300:
            launch = rng.choice(("sm90", "sm80")) if dtype == "bfloat16" else "default"
        else:
            launch = rng.choice(("sm90", "sm80", "default", "tile=4", "tile=8", "tile=16"))
        pads = tuple(rng.choice((0, 0, rng.randint(0, length), -1)) for _ in range(batch))
        if all(p == -1 for p in pads):
            pads = (0, *pads[1:])
        budget_rows = rng.choice((None, None, 64)) if length > 64 else None
        cases.append(
            Case(
                length,
                pads=pads,
                hq=hq,
                hkv=hkv,
                active=active,
                dtype=dtype,
                launch=launch,
                budget_rows=budget_rows,
                seed=seed * 1000 + i,
            )
        )
    return cases


def _inputs(case: Case):
    """Leaf q, k, v in the case's dtype, A <= D fp32, key_valid, the head mask, a phase MLP with a
    random output layer (|delta| well away from 0) and the output's upstream gradient."""
    from mdlmpe_ds.pe.phase import PhaseMLP

    gen = torch.Generator().manual_seed(case.seed)
    batch, num_pairs = len(case.pads), case.head_dim // 2
    torch.manual_seed(case.seed)
    mlp = PhaseMLP(num_pairs, max(16, num_pairs // 2))
    with torch.no_grad():
        mlp.fc2.weight.normal_(0.0, 0.5, generator=gen)
        mlp.fc2.bias.normal_(0.0, 0.5, generator=gen)
    dt = getattr(torch, case.dtype)

    def leaf(heads: int) -> torch.Tensor:
        return torch.randn(batch, heads, case.length, case.head_dim, generator=gen).to(dt).requires_grad_()

    q, k, v = leaf(case.hq), leaf(case.hkv), leaf(case.hkv)
    D = torch.rand(batch, case.length, num_pairs, generator=gen) + 0.5
    A = torch.rand(batch, case.length, num_pairs, generator=gen) * D
    key_valid = torch.ones(batch, case.length, dtype=torch.bool)
    for b, pad in enumerate(case.pads):
        key_valid[b, case.length - (case.length if pad < 0 else pad) :] = False
    active = torch.tensor([c == "1" for c in case.active])
    grad_out = torch.randn(batch, case.hq, case.length, case.head_dim, generator=gen)
    # A sequence with no valid key has uniform rows by convention (common.key_padding_bias), not as
    # the limit of a function: the backends agree on that output, but their gradients through it
    # differ (plain RoPE SDPA zeroes such a sequence's queries; the reference differentiates its
    # softmax formally). Training never sends a gradient there (no scored token, and its keys are
    # masked for every other row), so the comparison sends none either.
    grad_out[~key_valid.any(dim=1)] = 0.0
    return q, k, v, A, D, key_valid, active, mlp, grad_out


def _launch_kwargs(case: Case) -> dict:
    """The explicit launch settings of a case (none for 'default': the launcher resolves them)."""
    from mdlmpe_ds.attention.triton.launch import launch_config

    if case.launch in ("sm90", "sm80"):
        config = launch_config(case.head_dim, torch.bfloat16, int(case.launch[2:]))
        return dict(
            block_size=config.tile,
            phase_tile=config.phase_tile,
            heads_per_program=config.heads_per_program,
            pair_chunk=config.pair_chunk,
        )
    if case.launch.startswith("tile="):
        tile = int(case.launch[5:])
        return dict(block_size=tile, phase_tile=tile, pair_chunk=2)
    return {}


def _budget_bytes(case: Case, kwargs: dict) -> int | None:
    """The pair-buffer budget that makes row blocks of ``case.budget_rows`` rows (None: the default)."""
    if case.budget_rows is None:
        return None
    from mdlmpe_ds.attention.triton.backend import resolve_launch
    from mdlmpe_ds.attention.triton.launch import padded_length, pair_padding
    from mdlmpe_ds.pe.phase import mdlmpe_pairs

    config = resolve_launch(
        torch.zeros(1, 1, 1, case.head_dim, dtype=getattr(torch, case.dtype)),
        kwargs.get("block_size"),
        phase_tile=kwargs.get("phase_tile"),
    )
    padded = padded_length(case.length, pair_padding(config))
    return 3 * 4 * len(mdlmpe_pairs(case.head_dim // 2)) * padded * case.budget_rows


def attention_runner(inputs: tuple):
    """``run(fn, **extra)``: one call of the attention ``fn`` on ``inputs`` (``_inputs``' tuple),
    backward of sum(out * grad_out), and [the output, the gradients of q, k, v and the phase MLP's
    four tensors] (``OUTPUTS``' order; zeros for a tensor without a gradient). Gradients are
    cleared first, so the reference and a backend can run one after the other on the same leaves."""
    q, k, v, A, D, key_valid, active, mlp, grad_out = inputs
    common = dict(tau_max=0.25, clip_kappa=1e-4, active_kv=active, key_valid=key_valid)
    leaves = (q, k, v, *mlp.parameters())

    def run(fn, **extra) -> list[torch.Tensor]:
        for t in leaves:
            t.grad = None
        out = fn(q, k, v, A, D, mlp.params(), **common, **extra)
        (out.float() * grad_out).sum().backward()
        return [out.detach()] + [torch.zeros_like(t) if t.grad is None else t.grad.clone() for t in leaves]

    return run


def compare(case: Case, backend: str) -> dict[str, float]:
    """Max abs error of ``backend`` ('triton' or 'blocked') against the reference, per output and
    gradient, under poisoned allocations; plus the reference's largest value ('scale')."""
    from mdlmpe_ds.attention.reference import reference_attention

    run = attention_runner(_inputs(case))
    with poisoned_allocations():
        want = run(reference_attention)
        if backend == "triton":
            from mdlmpe_ds.attention.triton import launch
            from mdlmpe_ds.attention.triton.backend import triton_attention

            kwargs = _launch_kwargs(case)
            launch.PHASE_KEY_SPAN = case.key_span or 256
            got = run(triton_attention, **kwargs, pair_buffer_bytes=_budget_bytes(case, kwargs))
        else:
            from mdlmpe_ds.attention.blocked import blocked_attention

            got = run(blocked_attention, block_size=case.budget_rows or 16)
    errors = {n: (w.float() - g.float()).abs().max().item() for n, w, g in zip(OUTPUTS, want, got)}
    errors["scale"] = max(w.float().abs().max().item() for w in want[:4])
    return errors


def _interpret(cases: list[Case], timeout: int) -> dict[str, dict[str, float]]:
    """Run ``cases`` through the Triton kernels in an interpreter child; errors per case name."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    payload = json.dumps([asdict(c) for c in cases])
    proc = subprocess.run(
        [sys.executable, __file__], input=payload, env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode:
        raise AssertionError(f"interpreter child failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(case: Case, errors: dict[str, float]) -> None:
    tol = TOL[case.dtype]
    assert errors["scale"] > 0.1, f"{case.name}: the comparison is between zeros"
    bad = {k: v for k, v in errors.items() if k in OUTPUTS and not v <= tol}
    assert not bad, f"{case.name}: max abs error above {tol} (NaN: an unwritten element was read): {bad}"


@pytest.fixture(scope="module")
def fast_results() -> dict[str, dict[str, float]]:
    """The fast cases in two interpreter children at once (pytest only waits: both cores work). The
    one case past the real span (L = 272 at span 256) costs about what the others cost together
    (interpreter CPU seconds measured: 26 vs 33), so it has a child of its own."""
    from concurrent.futures import ThreadPoolExecutor

    pytest.importorskip("triton")
    groups = [[c for c in FAST if c.length > 256], [c for c in FAST if c.length <= 256]]
    with ThreadPoolExecutor(max_workers=len(groups)) as pool:
        parts = list(pool.map(lambda cases: _interpret(cases, timeout=900), groups))
    return {name: errors for part in parts for name, errors in part.items()}


@pytest.mark.parametrize("case", FAST, ids=lambda c: c.name)
def test_triton_matches_reference_at_every_shape(fast_results, case):
    _check(case, fast_results[case.name])


@pytest.mark.parametrize("case", FAST, ids=lambda c: c.name)
def test_blocked_matches_reference_at_every_shape(case):
    """The blocked path under the same poison (query blocks of ``budget_rows`` or 16 rows: a last
    block shorter than the others wherever the block does not divide L)."""
    _check(case, compare(case, "blocked"))


def test_poison_catches_an_unwritten_read():
    """The poison works: a buffer from torch.empty that nobody wrote reads as NaN inside, not as
    the zeros a fresh allocation often happens to hold."""
    with poisoned_allocations():
        assert bool(torch.empty(4, 4).isnan().all()) and bool(torch.empty_like(torch.ones(3)).isnan().all())
        assert int(torch.empty(2, dtype=torch.int32)[0]) == torch.iinfo(torch.int32).max
    assert not torch.are_deterministic_algorithms_enabled()


WRONG_HEAD_MASKS = {
    "one_too_many": torch.tensor([True, False, True]),
    "one_too_few": torch.tensor([True]),
    "two_dimensional": torch.tensor([[True, False]]),
    "head_indices": torch.tensor([0, 1]),
    "float_mask": torch.tensor([1.0, 0.0]),
}


@pytest.mark.parametrize("backend", ["reference", "blocked", "triton", "dispatch"])
@pytest.mark.parametrize("mask", list(WRONG_HEAD_MASKS))
def test_every_backend_refuses_a_wrong_head_mask(monkeypatch, backend, mask):
    """``active_kv`` must be a bool [Hkv] mask: any other shape or dtype is refused, by name, before
    any work (it would map query heads to the wrong entries). Hkv = 2 here."""
    from mdlmpe_ds.attention import AttentionImpl, mdlmpe_attention
    from mdlmpe_ds.attention.blocked import blocked_attention
    from mdlmpe_ds.attention.reference import reference_attention
    from mdlmpe_ds.pe.config import MDLMPEConfig

    q, k, v, A, D, key_valid, _, mlp, _ = _inputs(Case(6, pads=(0,), hq=4, hkv=2))
    active = WRONG_HEAD_MASKS[mask]
    kwargs = dict(tau_max=0.25, clip_kappa=1e-4, active_kv=active, key_valid=key_valid)
    if backend == "reference":
        call = lambda: reference_attention(q, k, v, A, D, mlp.params(), **kwargs)  # noqa: E731
    elif backend == "blocked":
        call = lambda: blocked_attention(q, k, v, A, D, mlp.params(), **kwargs)  # noqa: E731
    elif backend == "triton":
        pytest.importorskip("triton")
        from mdlmpe_ds.attention.triton.backend import triton_attention

        monkeypatch.setenv("TRITON_INTERPRET", "1")  # passes the availability check; no kernel runs
        call = lambda: triton_attention(q, k, v, A, D, mlp.params(), **kwargs)  # noqa: E731
    else:  # the dispatcher, with a mask that has no True entry (its early plain-RoPE return)

        def call():
            impl = AttentionImpl(backend="reference")
            none_active = torch.zeros_like(active)
            return mdlmpe_attention(
                q, k, v, A, D, mlp.params(), MDLMPEConfig(), impl, active_kv=none_active, key_valid=key_valid
            )

    with pytest.raises(ValueError, match="active_kv"):
        call()


def test_fast_cases_reach_every_branch():
    """The always-run cases keep their reach: a span tail in both launch modes, ragged and full
    padding, GQA 4:1, partial and empty head sets, bf16, the sm_90 settings past 256, more than
    one pair chunk."""
    from mdlmpe_ds.attention.triton.launch import padded_length

    def span_tail(c: Case, step: int) -> bool:
        padded = padded_length(c.length, step)
        span = c.key_span or 256
        return padded > span and padded % span != 0

    assert span_tail(FAST[0], 16) and FAST[0].budget_rows is None
    assert span_tail(FAST[1], 16) and FAST[1].budget_rows is not None
    assert span_tail(FAST[4], 64) and FAST[4].launch == "sm90" and FAST[4].dtype == "bfloat16"
    assert any(-1 in c.pads for c in FAST) and any(c.hq == 4 * c.hkv for c in FAST)
    actives = {c.active.count("1") / len(c.active) for c in FAST}
    assert {0.0, 0.5, 1.0} <= actives
    assert max(pair_chunks(c) for c in FAST) >= 2  # the pair-chunk loops run more than once


def test_sweep_covers_the_listed_lengths_and_settings():
    cases = sweep_cases(int(os.environ.get("MDLMPE_DS_SHAPE_SEED", "0")))
    assert set(SWEEP_LENGTHS) <= {c.length for c in cases}
    assert {"sm90", "sm80"} <= {c.launch for c in cases}
    assert {"float32", "bfloat16"} == {c.dtype for c in cases}


@pytest.mark.slow
def test_triton_shape_sweep():
    """``make test-all``: the drawn sweep through the interpreter (tens of minutes on 2 cores)."""
    pytest.importorskip("triton")
    cases = sweep_cases(int(os.environ.get("MDLMPE_DS_SHAPE_SEED", "0")))
    results = _interpret(cases, timeout=3 * 3600)
    failures = []
    for case in cases:
        try:
            _check(case, results[case.name])
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_blocked_shape_sweep():
    cases = sweep_cases(int(os.environ.get("MDLMPE_DS_SHAPE_SEED", "0")))
    for case in cases:
        if case.length <= 600:  # the reference materialises [B, Hq, L, L, F]
            _check(case, compare(case, "blocked"))


if __name__ == "__main__":
    torch.set_num_threads(1)
    todo = [Case(**{**c, "pads": tuple(c["pads"])}) for c in json.loads(sys.stdin.read())]
    print(json.dumps({c.name: compare(c, "triton") for c in todo}))


@pytest.mark.parametrize("length", [1, 15, 16, 17, 255, 256, 257, 272, 300, 320, 511, 513, 1025, 1100])
@pytest.mark.parametrize("launch", ["sm90", "sm80", "default"])
@pytest.mark.parametrize("budget_rows", [None, 64])
def test_phase_launches_cover_the_pair_plane_once(length, launch, budget_rows):
    """The phase kernels' grids, replayed in Python: over every launch group of a call, each
    (row tile, key tile) of the LP x LP plane is written exactly once (in the symmetric whole-plane
    launch: at or right of the diagonal, or as the mirror of such a tile), and every program of the
    backward owns its own MLP-gradient slot inside the allocated range. Any floor in a grid, a span
    count or a slot count leaves a tile unwritten or a slot shared, whatever the lengths the
    interpreter can afford."""
    pytest.importorskip("triton")
    from mdlmpe_ds.attention.triton import backend
    from mdlmpe_ds.attention.triton import plan as triton_plan

    dtype = "bfloat16" if launch != "default" else "float32"
    case = Case(length, pads=(0, 0), dtype=dtype, launch=launch, budget_rows=budget_rows)
    kwargs = _launch_kwargs(case)
    q = torch.zeros(2, 2, length, case.head_dim, dtype=getattr(torch, case.dtype))
    config = backend.resolve_launch(q, kwargs.get("block_size"), phase_tile=kwargs.get("phase_tile"))
    budget = _budget_bytes(case, kwargs) or triton_plan.PAIR_BUFFER_BYTES
    plan = triton_plan.Plan(q, q, torch.zeros(16, case.head_dim // 2), config, 0.25, budget)
    tile, padded = plan.phase_tile, plan.padded
    tiles = padded // tile
    written = torch.zeros(2, tiles, tiles, dtype=torch.int32)  # [sequence, row tile, key tile]
    slots: list[int] = []
    total_slots = tiles * plan.key_spans * 2
    for s, e, r0, rows in plan.blocks(2):
        grid = plan.phase_grid(rows, e - s)
        symmetric = rows == padded
        for pid_m in range(grid[0]):
            diagonal = r0 + pid_m * tile
            for pid_k in range(grid[1]):
                lo, hi = pid_k * plan.key_span, min(pid_k * plan.key_span + plan.key_span, padded)
                if symmetric:
                    lo = max(lo, diagonal)
                for b in range(s, e):
                    slots.append((b * tiles + diagonal // tile) * grid[1] + pid_k)
                    for start in range(lo, hi, tile):
                        written[b, diagonal // tile, start // tile] += 1
                        if symmetric and start > diagonal:
                            written[b, start // tile, diagonal // tile] += 1
    assert bool((written == 1).all()), f"tiles written 0 or 2+ times: {(written != 1).nonzero().tolist()[:5]}"
    assert len(set(slots)) == len(slots) and max(slots) < total_slots
