"""Helpers of the checkpoint tests: build the sharded test model in a gloo rank as the trainer
does, gather its full weights, compute logits, and write tiny Hugging Face checkpoints."""

from __future__ import annotations

import copy
import importlib.util
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.harness import REPO, run_train

CONFIG = str(REPO / "tests/checkpoint/ckpt.toml")
#: full-precision per-step losses and the same run each time (the resume tests compare runs)
DETERMINISTIC = ("--debug.deterministic", "--debug.seed", "42")


def has_module(name: str) -> bool:
    """Whether a framework module exists (parallelisms land in parallel with these tests)."""
    return importlib.util.find_spec(name) is not None


def job_config(*overrides: str):
    """The test config parsed and validated like the trainer's (``WORLD_SIZE`` from the env)."""
    from torchtitan_omni.config.manager import OmniConfigManager

    return OmniConfigManager().parse_args(["--job.config_file", CONFIG, *overrides])


def build(world_size: int, *overrides: str):
    """(model, parallel dims, config): built on meta, parallelized, materialized, initialized."""
    import tests.checkpoint.spec  # noqa: F401  (registers the spec)
    from torchtitan_omni.job_model import sharded_model
    from torchtitan_omni.distributed.parallel_dims import OmniParallelDims

    cfg = job_config(*overrides)
    dims = OmniParallelDims.from_config(cfg.parallelism, world_size)
    return sharded_model(cfg, dims, torch.device("cpu")), dims, cfg


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer, whole (a collective for sharded ones)."""
    from torchtitan_omni.checkpoint.parts import state_tensors

    out = {}
    for name, t in state_tensors(model).items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = full.detach().clone()
    return out


def plain_model(flavor: str = "llama", seed: int = 0):
    """The unsharded test model, initialized in this process (the single-rank reference)."""
    import tests.checkpoint.spec as spec

    args = copy.deepcopy(spec.FLAVORS[flavor])
    model = spec.CkptModel(args)
    model.init_seed = seed
    with torch.no_grad():
        model.init_weights()
    return model


def text_logits(model, dims, tokens: torch.Tensor, doc_len: int) -> torch.Tensor:
    """Logits ``[B, S_local, V]`` of every position of this rank's sequence slice
    (documents of ``doc_len`` tokens), captured at the text head; ``dims`` None: one rank."""
    from torchtitan_omni.distributed.sequence import shard_sequence
    from torchtitan_omni.protocols import batch as B
    from torchtitan_omni.protocols.modules import AttentionMeta

    b, s = tokens.shape
    positions = (torch.arange(s) % doc_len).expand(b, s).contiguous()
    bounds = torch.arange(0, b * s + 1, doc_len, dtype=torch.int32)
    batch = {B.INPUT: tokens, B.POSITION_IDS: positions}
    labels = torch.zeros_like(tokens)  # every position is a target: logits everywhere
    sp = dims.sp if dims is not None else 1
    sp_rank = dims.get_mesh("sp").get_local_rank() if sp > 1 else 0
    batch, labels = shard_sequence(batch, labels, sp_rank, sp)
    captured = []
    # the head's input: the final hidden states of every (labelled) position; the head then
    # gives their logits (in training it returns the loss without keeping them)
    handle = model.llm.output.register_forward_hook(lambda m, i, o: captured.append(i[0]))
    try:
        meta = AttentionMeta(bounds, doc_len, batch[B.POSITION_IDS])
        with torch.no_grad():
            model(batch[B.INPUT], meta, labels)
            logits = model.llm.output(captured[0])
    finally:
        handle.remove()
    return logits.reshape(b, s // sp, -1)


def train_logged(config, folder: str, ngpu: int,
                 *overrides: str) -> tuple[dict[int, dict[str, float]], str]:
    """``run_train.sh`` (deterministic) with its outputs in ``folder``: every step's named
    losses at full precision (``tests.checkpoint.train_entry``), and the console output."""
    losses = os.path.join(folder, "losses.jsonl")
    run = run_train(config, ngpu, "--job.dump_folder", folder, *DETERMINISTIC, *overrides,
                    env={"TRAIN_FILE": "tests.checkpoint.train_entry", "OMNI_LOSS_FILE": losses})
    assert run.returncode == 0, run.output[-4000:]
    with open(losses) as f:
        records = [json.loads(line) for line in f]
    return {r.pop("step"): r for r in records}, run.output


def copy_checkpoints(src: str, dst: str, drop: tuple[int, ...] = ()) -> None:
    """``src``'s checkpoint folder into ``dst`` (job dump folders) without the steps ``drop``:
    a run in ``dst`` resumes from the newest one left."""
    import shutil

    shutil.copytree(os.path.join(src, "checkpoint"), os.path.join(dst, "checkpoint"))
    for step in drop:
        shutil.rmtree(os.path.join(dst, "checkpoint", f"step-{step}"))


def dcp_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole, read in this process (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


def rank0(value):
    """``value`` on rank 0, None elsewhere (keeps what the harness pickles small)."""
    return value if not dist.is_initialized() or dist.get_rank() == 0 else None


def tiny_hf_llama(
    folder: str, dtype=torch.float32, max_shard_size: str | None = "40KB", seed: int = 0
):
    """A random ``LlamaForCausalLM`` shaped like ``spec.tiny_llama()``, saved to ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.checkpoint.spec import tiny_llama

    a = tiny_llama()
    config = LlamaConfig(
        vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.ffn_hidden_dim,
        num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads, head_dim=a.resolved_head_dim, rms_norm_eps=a.norm_eps,
        rope_theta=a.rope_theta, max_position_embeddings=a.max_seq_len, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF inits norms to one; random norms make the test sharper
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return model


def tiny_hf_moe(folder: str, seed: int = 0):
    """A random ``Qwen3MoeForCausalLM`` shaped like ``spec.tiny_moe()``, saved to ``folder``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.checkpoint.spec import tiny_moe

    a = tiny_moe()
    config = Qwen3MoeConfig(
        vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.moe_hidden_dim * a.top_k,
        moe_intermediate_size=a.moe_hidden_dim, num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads, head_dim=a.head_dim,
        num_experts=a.num_experts, num_experts_per_tok=a.top_k, norm_topk_prob=a.norm_topk_prob,
        rms_norm_eps=a.norm_eps, rope_theta=a.rope_theta, max_position_embeddings=a.max_seq_len,
        tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "experts" in name or "gate" in name:
                p.normal_(0, 0.2)  # distinct experts, a router that prefers some
    model.save_pretrained(folder, safe_serialization=True)
    return model


def file_count(folder: str) -> int:
    return sum(1 for n in os.listdir(folder) if n.endswith(".safetensors"))


# ----------------------------------------------------------------- a minimal training loop
class StepState:
    """The trainer's ``train_state`` (step counter) for the manager tests."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


class MiniTrainer:
    """Model, optimizer, scheduler, loader and ``OmniCheckpointManager`` as the trainer wires
    them, with a plain training step (the manager tests need states, not the trainer)."""

    def __init__(self, world_size: int, folder: str, *overrides: str) -> None:
        from torchtitan.components.lr_scheduler import build_lr_schedulers
        from torchtitan.components.optimizer import build_optimizers

        from tests.checkpoint.spec import CursorLoader
        from torchtitan_omni.checkpoint.manager import OmniCheckpointManager

        self.model, self.dims, cfg = build(world_size, "--checkpoint.folder", folder, *overrides)
        self.cfg = cfg
        self.optimizers = build_optimizers([self.model], cfg.optimizer, self.dims)
        self.schedulers = build_lr_schedulers(self.optimizers, cfg.lr_scheduler, cfg.training.steps)
        dp_rank, dp = (
            (self.dims.get_mesh("batch").get_local_rank(), self.dims.get_mesh("batch").size())
            if self.dims.dp_enabled
            else (0, 1)
        )
        self.loader = CursorLoader(dp_rank, dp, cfg.training.local_batch_size, cfg.training.seq_len)
        self.state = StepState()
        self.manager = OmniCheckpointManager(
            dataloader=self.loader, model_parts=[self.model], optimizers=self.optimizers,
            lr_schedulers=self.schedulers, states={"train_state": self.state},
            checkpoint_config=cfg.checkpoint, sd_adapter=None, base_folder=cfg.job.dump_folder,
            parallel_dims=self.dims,
        )
        self._batches = None

    def step(self) -> None:
        from torchtitan_omni.distributed.sequence import shard_sequence
        from torchtitan_omni.protocols import batch as B
        from torchtitan_omni.protocols.modules import AttentionMeta

        if self._batches is None:
            self._batches = iter(self.loader)
        batch, labels = next(self._batches)
        sp_rank = self.dims.get_mesh("sp").get_local_rank() if self.dims.sp_enabled else 0
        batch, labels = shard_sequence(batch, labels, sp_rank, self.dims.sp)
        cu = batch[B.CU_SEQLENS]
        meta = AttentionMeta(cu, int((cu[1:] - cu[:-1]).max()), batch[B.POSITION_IDS])
        self.optimizers.zero_grad()
        torch.rand(3)  # as dropout would: the RNG state moves with the steps
        out = self.model(batch[B.INPUT], meta, labels)
        (out.losses["text"] / labels.numel()).backward()
        self.optimizers.step()
        self.schedulers.step()
        self.state.step += 1

    def save(self, last: bool = False) -> None:
        self.manager.save(self.state.step, last_step=last)

    def full_states(self) -> dict:
        """Full model and optimizer tensors (by DCP key), the scheduler and data positions."""
        out = {f"model.{k}": v for k, v in full_state(self.model).items()}
        for key, value in self.optimizers.state_dict().items():
            if isinstance(value, torch.Tensor):
                full = value.full_tensor() if isinstance(value, DTensor) else value
                out[f"optimizer.{key}"] = full.detach().clone()
        out["rng"] = torch.get_rng_state()
        out["lr_step"] = self.schedulers.schedulers[0].last_epoch
        out["cursor"] = self.loader.cursor
        out["step"] = self.state.step
        return out


def load_convert_script():
    """``scripts/convert_checkpoint.py`` as a module (scripts/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "convert_checkpoint", REPO / "scripts" / "convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def resolve(folder: str) -> str:
    """The newest complete checkpoint in a checkpoint folder."""
    from torchtitan_omni.checkpoint.completion import resolve_checkpoint

    return resolve_checkpoint(folder)


def saved_hf_state(folder: str) -> dict[str, torch.Tensor]:
    """The tensors as written on disk (transformers 5 fuses experts in memory, not on disk)."""
    from safetensors.torch import load_file

    state = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(folder, name)))
    return state


def expected_state(folder: str, adapter) -> dict[str, torch.Tensor]:
    """Our tensors assembled from the HF files through the adapter table, as float32."""
    hf = saved_hf_state(folder)
    out = {}
    for name, src in adapter.sources().items():
        parts = [hf[k].t() if src.transpose else hf[k] for k in src.keys]
        t = parts[0] if src.stack_dim is None else torch.stack(parts, dim=src.stack_dim)
        out[f"llm.{name}"] = t.float()
    return out
