"""Export a training checkpoint to a consolidated Hugging Face-format directory.

    python launch/export.py outputs/sft-demo/checkpoints/latest outputs/sft-demo/export [--dtype bf16]

CHECKPOINT may be a step directory, the `latest` file, a `checkpoints/` folder or the run's
output_dir (then the newest COMPLETE checkpoint is used). The ZeRO-3 shards are consolidated in this
one process from the fp32 master weights (DeepSpeed's zero_to_fp32 reader; no GPU, no process
group), written as config.json + sharded safetensors + index under the upstream parameter names
plus the MDLMPE keys (models/hf_io.save_pretrained); the run's tokenizer files are copied in with the
chat template training used, and the self-contained modeling file with `auto_map`
(mdlmpe_ds/hub/export.py). `mdlmpe_ds.models.hf_io.load_pretrained(OUT)` reads it back, and so does
`transformers.AutoModel.from_pretrained(OUT, trust_remote_code=True)`.

A LoRA checkpoint (`--lora`, mdlmpe_ds/lora/) holds the adapters and the MDLMPE weights; the frozen
base is read from the run's `model_name_or_path` (or, for a from-scratch preset, the run's
`lora_base.safetensors`). `--merge` (the default) writes W + (alpha / r) B A into the one
consolidated model above, the same format as a full fine-tune; `--adapter-only` writes a
peft adapter directory (adapter_config.json + adapter_model.safetensors, addressed to the exported
model's modules, the MDLMPE modules carried whole) plus the trained MDLMPE weights under our names
(mdlmpe.safetensors) and the run's tokenizer files; `--base-only` writes the base with the trained
MDLMPE weights and no adapters, the model that adapter loads onto:

    model = PeftModel.from_pretrained(AutoModel.from_pretrained(BASE, trust_remote_code=True), ADAPTER)

OUT is written whole into a staging directory next to it and swapped in, so an earlier export there
leaves no file behind (a single-file model.safetensors next to new shards would make transformers
load the old weights); files are readable by others (0644). OUT may not be a checkpoint, the
checkpoints/ folder, a run's output_dir or a directory holding other files: the export refuses,
naming it (mdlmpe_ds/hub/export_target.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def export(
    checkpoint: str | Path,
    out: str | Path,
    dtype: str = "fp32",
    max_shard_gb: float = 5.0,
    push_to_hub: str | None = None,
    adapter_only: bool = False,
    base_only: bool = False,
) -> Path:
    from mdlmpe_ds.hub.export import finish_export
    from mdlmpe_ds.hub.export import push_to_hub as upload
    from mdlmpe_ds.hub.export_target import check_target, staged, write_marker
    from mdlmpe_ds.lora import adapters as lora
    from mdlmpe_ds.lora import export as lora_export
    from mdlmpe_ds.models.config import ModelConfig
    from mdlmpe_ds.models.hf_io import save_pretrained
    from mdlmpe_ds.training import checkpoint as ckpt
    from mdlmpe_ds.training import weights_only
    from mdlmpe_ds.training.consolidate import as_declared_shapes, checkpoint_state, consolidated_state

    # A model-only save of a stopped run (train.save_on_signal model) exports like a checkpoint.
    model_only = weights_only.is_weights_dir(checkpoint)
    step_dir = Path(checkpoint) if model_only else ckpt.resolve_checkpoint(checkpoint)
    saved = ckpt.read_saved_run(step_dir)
    inputs = (saved.run_config["model"].get("model_name_or_path"), saved.run_config["data"].get("tokenizer"))
    # never into a checkpoint, over a run or over its inputs (hub/export_target.py)
    kind = "adapter" if adapter_only else "base" if base_only else "merged"
    target = check_target(out, step_dir, inputs, kind)
    config = ModelConfig.from_dict(saved.model_config, stored=True)
    state = checkpoint_state(step_dir)
    spec = lora.spec_of(saved.run_config)
    if spec is None and (adapter_only or base_only):
        flag = "--adapter-only" if adapter_only else "--base-only"
        raise ValueError(f"{step_dir} is a full fine-tune checkpoint: {flag} needs a LoRA run")
    if spec is not None:
        _, adapters, mdlmpe = lora_export.split_state(state)
        if adapter_only:
            with staged(target) as stage:
                _export_adapter(step_dir, saved, stage, target, adapters, mdlmpe, spec, DTYPES[dtype])
                write_marker(stage, kind, step_dir, saved.step)
            if push_to_hub:
                print(f"uploaded {target} -> {upload(target, push_to_hub)}")
            return target
    if spec is not None and base_only:  # the frozen base and the trained MDLMPE weights: the adapter's base
        base = lora_export.read_base(step_dir, saved.run_config)
        state = as_declared_shapes(lora_export.merge(base, {}, mdlmpe, spec), config)
    else:  # the plain model's state (a LoRA run's adapters merged), shaped as the model declares
        state = consolidated_state(step_dir, saved.run_config, config, state)
    converted = {name: tensor.to(DTYPES[dtype]) for name, tensor in state.items()}
    # Written whole into a staging directory, then swapped in: no file of an earlier export survives.
    with staged(target) as stage:
        files = save_pretrained(converted, stage, config, max_shard_bytes=int(max_shard_gb * 1024**3))
        done = finish_export(stage, config.family, _tokenizer_dir(saved.tokenizer))
        write_marker(stage, kind, step_dir, saved.step)
    print(
        f"exported {step_dir} (update {saved.step}) -> {target}: {len(files)} files, "
        f"{sum(t.numel() for t in converted.values()):,} parameters ({dtype}); "
        f"tokenizer files: {done['tokenizer_files'] or 'none'}; chat template: {done['chat_template']}; "
        "loads with transformers AutoModel.from_pretrained(OUT, trust_remote_code=True)"
    )
    if push_to_hub:
        print(f"uploaded {target} -> {upload(target, push_to_hub)}")
    return target


def _export_adapter(step_dir, saved, out, target, adapters, mdlmpe, spec, dtype: torch.dtype) -> None:
    """--adapter-only: the peft adapter directory + MDLMPE weights + the run's tokenizer files, written
    into ``out`` (the staging directory of ``target``)."""
    import shutil

    from mdlmpe_ds.hub.export import TOKENIZER_FILES
    from mdlmpe_ds.lora import base as lora_base
    from mdlmpe_ds.lora import export as lora_export
    from mdlmpe_ds.models.config import ModelConfig

    lora_base.check_base_identity(
        step_dir, lora_base.base_source(step_dir, saved.run_config)
    )  # the adapter's base
    # The base as the run names it (a hub id, or the user's directory; None for a preset's own base).
    base = saved.run_config["model"].get("model_name_or_path")
    revision = saved.run_config["model"].get("revision")
    family = ModelConfig.from_dict(saved.model_config, stored=True).family
    out = Path(out)
    files = lora_export.write_adapter_dir(
        out, adapters, mdlmpe, spec, base, dtype, family=family, revision=revision
    )
    tokenizer = _tokenizer_dir(saved.tokenizer)
    copied = []
    for name in TOKENIZER_FILES if tokenizer else ():
        if (Path(tokenizer) / name).is_file():
            shutil.copy2(Path(tokenizer) / name, out / name)
            copied.append(name)
    print(
        f"exported the LoRA adapter of {step_dir} (update {saved.step}) -> {target}: "
        f"{', '.join(f.name for f in files)} ({len(adapters)} adapted projections, --lora {spec.text()}); "
        f"base model: {base or 'the run preset (export it with --base-only)'}; tokenizer files: "
        f"{copied or 'none'}; loads with PeftModel.from_pretrained(AutoModel.from_pretrained(BASE_EXPORT, "
        "trust_remote_code=True), OUT), BASE_EXPORT from --base-only"
    )


def _tokenizer_dir(tokenizer: str | None) -> str | None:
    """The run's tokenizer as a local directory (a hub id is read from the local cache)."""
    if not tokenizer or Path(tokenizer).is_dir():
        return tokenizer
    from mdlmpe_ds.hub.resolve import resolve_tokenizer

    return str(resolve_tokenizer(tokenizer))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--max_shard_gb", type=float, default=5.0)
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument(
        "--merge",
        action="store_true",
        help="LoRA checkpoints: merge the adapters into one consolidated model (the default)",
    )
    kind.add_argument(
        "--adapter-only",
        action="store_true",
        help="LoRA checkpoints: a peft adapter directory plus the MDLMPE weights, no merged model",
    )
    kind.add_argument(
        "--base-only",
        action="store_true",
        help="LoRA checkpoints: the base with the trained MDLMPE weights, no adapters (what "
        "an --adapter-only export loads onto with PeftModel)",
    )
    parser.add_argument(
        "--push_to_hub", metavar="REPO", default=None, help="upload the export to this hub repo"
    )
    args = parser.parse_args(argv)
    from mdlmpe_ds.hub.export_target import ExportTargetError
    from mdlmpe_ds.training.log_setup import configure

    configure(stream="stderr")
    try:
        export(
            args.checkpoint, args.out, args.dtype, args.max_shard_gb, args.push_to_hub, args.adapter_only,
            args.base_only,
        )  # fmt: skip
    except ExportTargetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
