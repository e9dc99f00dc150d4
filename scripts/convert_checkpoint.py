"""Convert between torchtitan-omni DCP checkpoints and Hugging Face safetensors folders.

DCP -> HF (one process, no GPU; memory about one output shard)::

    python scripts/convert_checkpoint.py dcp-to-hf --config train_configs/llama_omni_8b.toml \\
        --checkpoint outputs/llama_omni/checkpoint [--parts llm] [--dtype bfloat16] --out exported/

writes ``exported/llm`` (``LlamaForCausalLM`` naming, ``config.json``, the job's tokenizer files
with any omni tokens it gained; loadable by ``AutoModelForCausalLM.from_pretrained``) and one folder
per encoder and decoder (``exported/encoders.vision``, ...) in its adapter's naming.
``--checkpoint`` is a ``step-N`` folder or a checkpoint folder (its newest complete step).

LoRA runs (the config's ``[lora]``): adapters are merged into their weights, so the folders
hold plain models; an adapter-only checkpoint takes its base from the config's
``weights.sources``. ``--adapter-only`` writes only what the run trained to
``OUT/adapter_model.safetensors`` (with ``adapter_config.json``) instead.

HF -> DCP (one process, or ``torchrun --nproc_per_node N`` for models that need sharding)::

    python scripts/convert_checkpoint.py hf-to-dcp --config CONFIG \\
        --source llm=/ckpt/Meta-Llama-3-8B --source encoders.vision=/ckpt/qwen2vl \\
        --out outputs/llama_omni/checkpoint [--step 0]

builds the model as the trainer does, loads each source with the sharded loader (parts without
one keep their random init), and saves the model as the published checkpoint ``OUT/step-0``:
put it in ``checkpoint.folder`` to start training from it, or name it in ``weights.sources``.

Arguments after ``--`` override the config (``-- --model.flavor 8B``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.getcwd())  # experimental.custom_import modules, as under ``python -m``

import torchtitan_omni  # noqa: F401  (device selection before TorchTitan loads)
import torch

from torchtitan_omni.checkpoint.completion import resolve_checkpoint
from torchtitan_omni.checkpoint.hf_export import (
    copy_tokenizer, export_part, exportable_parts, save_model_checkpoint,
)
from torchtitan_omni.checkpoint.lora_export import export_adapter, holds_adapters, merged_reader
from torchtitan_omni.checkpoint.parts import top_level_parts
from torchtitan_omni.checkpoint.safetensors_folder import EXTRA_FILE
from torchtitan_omni.checkpoint.tensor_readers import DCPReader
from torchtitan_omni.lora import apply_lora_config, lora_settings
from torchtitan_omni.config.manager import parse_config
from torchtitan_omni.distributed.process_group import init_process_group
from torchtitan_omni.job_model import model_on_meta, sharded_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _export_tokenizer(cfg, target: str) -> list[str]:
    """The job's tokenizer files next to the exported LLM, tokenizer.json with the omni tokens
    it gained in training (the export's embedding has their rows)."""
    from torchtitan_omni.data.tokenizer import save_with_omni_tokens, tokenizer_folder

    folder = tokenizer_folder(cfg)
    copied = copy_tokenizer(folder, target)
    if "tokenizer.json" in copied and save_with_omni_tokens(folder, target):
        copied[copied.index("tokenizer.json")] = "tokenizer.json (with the omni tokens added)"
    return copied


def _lora_model(cfg, folder: str):
    """The config's model on meta, adapted like the run when ``[lora]`` is on; refuses a LoRA
    checkpoint under a config without LoRA (its adapters would be dropped unmerged)."""
    model = model_on_meta(cfg)
    if cfg.lora.enable:
        model.freeze(list(cfg.omni.freeze))
        apply_lora_config(model, cfg.lora)
    elif holds_adapters(DCPReader(folder)):
        raise ValueError(f"{folder} holds LoRA adapters but the config's lora.enable is off: "
                         "pass the run's config (or -- --lora.enable and its [lora] values)")
    return model


def export_lora_adapter(config: str, overrides: list[str], checkpoint: str, out: str,
                        parts: list[str] | None = None) -> str:
    """Write what a LoRA run trained (adapters, lora.train_modules) to one safetensors file."""
    cfg = parse_config(config, overrides)
    if not cfg.lora.enable:
        raise ValueError("--adapter-only needs the LoRA run's config (lora.enable = true)")
    folder = resolve_checkpoint(checkpoint)
    model = _lora_model(cfg, folder)
    report = export_adapter(model, parts or top_level_parts(model), folder, out,
                            lora_settings(cfg.lora))
    print(f"adapter: {report.tensors} tensors of {report.modules} adapted modules, "
          f"{report.bytes / 2**20:.2f} MiB -> {report.path}")
    return report.path


def dcp_to_hf(config: str, overrides: list[str], checkpoint: str, out: str,
              parts: list[str] | None = None, dtype: str | None = None,
              max_shard_size: str = "5GB") -> dict[str, str]:
    """Export parts of a DCP checkpoint as Hugging Face folders (LoRA adapters merged into
    their weights); returns part -> folder."""
    cfg = parse_config(config, overrides)
    folder = resolve_checkpoint(checkpoint)
    model = _lora_model(cfg, folder)
    reader = (merged_reader(model, folder, list(cfg.weights.sources), lora_settings(cfg.lora))
              if cfg.lora.enable else None)
    available = exportable_parts(model)
    chosen = parts or list(available)
    unknown = [p for p in chosen if p not in available]
    if unknown:
        raise SystemExit(f"--parts {', '.join(unknown)}: not exportable (parts with a Hugging Face "
                         f"adapter: {', '.join(available) or 'none'})")
    done = {}
    for part in chosen:
        target = os.path.join(out, part)
        report = export_part(model, part, available[part], folder, target,
                             DTYPES[dtype] if dtype else None, max_shard_size, reader)
        extra = _export_tokenizer(cfg, target) if part == "llm" else []
        if report.extras:
            extra.append(f"{report.extras} tensors without a Hugging Face name in {EXTRA_FILE}")
        print(f"{part}: {report.tensors} tensors, {report.bytes / 2**20:.1f} MiB in "
              f"{report.files} file(s) -> {target}" + (f" (+ {'; '.join(extra)})" if extra else ""))
        done[part] = target
    return done


def hf_to_dcp(
    config: str, overrides: list[str], sources: list[str], out: str, step: int = 0
) -> str:
    """Load Hugging Face (or DCP) sources into the sharded model and save it as DCP."""
    import torch.distributed as dist

    from torchtitan_omni.checkpoint.manager import layout_of
    from torchtitan_omni.checkpoint.weights import load_initial_weights
    from torchtitan_omni.distributed.parallel_dims import OmniParallelDims
    from torchtitan_omni.platform import local_device

    init_process_group()
    cfg = parse_config(config, overrides)
    sources = list(sources or cfg.weights.sources)
    if not sources:
        raise SystemExit("no --source given and the config has no weights.sources")
    dims = OmniParallelDims.from_config(cfg.parallelism, dist.get_world_size())
    model = sharded_model(cfg, dims, local_device())
    load_initial_weights(model, sources)
    return save_model_checkpoint(model, out, step, layout_of(dims))


def main(argv: list[str] | None = None) -> None:
    from torchtitan.tools.logging import init_logger

    init_logger()
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("dcp-to-hf", help="DCP checkpoint -> one Hugging Face folder per part")
    a.add_argument("--config", required=True, help="the training TOML (model, flavor, assets)")
    a.add_argument("--checkpoint", required=True, help="a step-N folder or a checkpoint folder")
    a.add_argument("--out", required=True)
    a.add_argument("--parts", help="comma-separated parts (default: every part with an adapter)")
    a.add_argument(
        "--dtype", choices=sorted(DTYPES), help="cast floating tensors (default: as saved)"
    )
    a.add_argument("--max-shard-size", default="5GB")
    a.add_argument("--adapter-only", action="store_true",
                   help="LoRA runs: write only what trained (adapters) to OUT/"
                        "adapter_model.safetensors instead of merged Hugging Face folders")
    b = sub.add_parser("hf-to-dcp", help="Hugging Face folders per part -> a DCP checkpoint")
    b.add_argument("--config", required=True)
    b.add_argument("--source", action="append", default=[], help="part=path (repeatable)")
    b.add_argument("--out", required=True, help="checkpoint folder; writes OUT/step-STEP")
    b.add_argument("--step", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if args.command == "dcp-to-hf" and args.adapter_only:
            parts = [p.strip() for p in args.parts.split(",")] if args.parts else None
            export_lora_adapter(args.config, overrides, args.checkpoint, args.out, parts)
        elif args.command == "dcp-to-hf":
            parts = [p.strip() for p in args.parts.split(",")] if args.parts else None
            dcp_to_hf(args.config, overrides, args.checkpoint, args.out, parts, args.dtype,
                      args.max_shard_size)
        else:
            path = hf_to_dcp(args.config, overrides, args.source, args.out, args.step)
            print(f"wrote {path}")
    except ValueError as e:  # bad input: one message, no stack trace
        print(f"convert_checkpoint: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
