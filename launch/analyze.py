"""Draw MDLMPE's mechanism figures (paper Appendix F) or a checkpoint's diagnostics.

A thin wrapper of ``python -m mdlmpe_ds.analysis`` (same arguments). The six deterministic figures
at the paper's settings, each as PNG + the JSON of its numbers and checks::

    python launch/analyze.py mechanism --out figures/

Your own geometry (L_ref, W/L, rho, RoPE theta, head dim) and rotary pair, one or more figures::

    python launch/analyze.py mechanism --figures envelope transfer jacobian --length 4096 \\
        --window-ratio 0.125 --rho 0.5 --theta 10000 --head-dim 64 --pair 6 --out figures/

A trained or exported model directory (config.json + safetensors): gamma, per-layer phase residual
statistics, delta_{ij,f} on a probe, and delta across one generation of the project's sampler,
optionally logged to TensorBoard::

    python launch/analyze.py checkpoint --model outputs/llada-sft/export --out diag/ \\
        --length 128 --mask-fraction 0.5 --steps 16 --device cuda --dtype bf16 --tensorboard diag/tb
"""

from __future__ import annotations

import sys

from mdlmpe_ds.analysis.cli import main
from mdlmpe_ds.training.log_setup import configure

if __name__ == "__main__":
    configure(stream="stderr")
    sys.exit(main())
