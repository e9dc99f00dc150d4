"""Text-only omni specs for the checkpoint tests, and a data loader that can be re-split.

Registered as ``ckpt_omni`` with flavors ``llama`` (the Llama-3 foundation) and ``moe`` (the
Qwen3-MoE foundation, experts split by expert parallel), both with the framework's real HF
adapters.

``CursorLoader`` reads a global stream of rows (row ``i`` is a packed sequence of random-walk
documents drawn from seed ``i``): each step, data rank ``r`` of ``D`` takes rows
``[c + r*B, c + (r+1)*B)`` and the cursor ``c`` advances by ``D*B``. Its state is the cursor,
so ``load_state_dict_resharded`` (the re-splitting interface of
``torchtitan_omni.checkpoint.stateful``) continues the stream under another ``D``: with the
same rows per step (``D*B``), every step trains on the same rows in any layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.protocols.train_spec import register_train_spec

from torchtitan_omni.foundations.llama3 import Llama3, Llama3Args
from torchtitan_omni.foundations.qwen3_moe import Qwen3Moe, Qwen3MoeArgs
from torchtitan_omni.omni_model import OmniModel
from torchtitan_omni.protocols import batch as B
from torchtitan_omni.model_args import OmniModelArgs
from torchtitan_omni.protocols.plan import OmniParallelPlan, PartLayout
from torchtitan_omni.spec import omni_train_spec

VOCAB = 64


def tiny_llama() -> Llama3Args:
    return Llama3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB,
                      ffn_hidden_dim=64, rope_scaling=None, rope_theta=10000.0, max_seq_len=64)


def tiny_moe() -> Qwen3MoeArgs:
    return Qwen3MoeArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=VOCAB,
                        num_experts=4, top_k=2, moe_hidden_dim=16, max_seq_len=64)


@dataclass
class CkptArgs(OmniModelArgs):
    moe: bool = False
    llm: object = field(default_factory=tiny_llama)

    @property
    def llm_args(self):
        return self.llm

    def update_from_config(self, job_config, **kwargs):
        self.llm.max_seq_len = max(self.llm.max_seq_len, job_config.training.seq_len)


def plan(moe: bool) -> OmniParallelPlan:
    return OmniParallelPlan(
        parts=(PartLayout("llm", fsdp_units=("tok_embeddings", "layers.*", "output"),
                          ac_units=("layers.*",)),),
        sequence_parallel_attention=("llm.layers.*.attention",),
        experts=("llm.layers.*.moe.experts",) if moe else (),
    )


class CkptModel(OmniModel):
    def __init__(self, args: CkptArgs):
        llm = Qwen3Moe(args.llm) if args.moe else Llama3(args.llm)
        super().__init__(llm, plan=plan(args.moe))


def make_row(
    index: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Row ``index`` of the stream: tokens, positions, labels and document ends."""
    g = torch.Generator().manual_seed(1_000_003 + index)
    tokens = torch.zeros(seq_len, dtype=torch.long)
    positions = torch.zeros_like(tokens)
    labels = torch.full_like(tokens, B.IGNORE_INDEX)
    ends, start = [], 0
    while start < seq_len:
        n = min(int(torch.randint(4, seq_len // 2 + 1, (1,), generator=g)), seq_len - start)
        first = int(torch.randint(0, VOCAB, (1,), generator=g))
        noise = (torch.rand(n, generator=g) < 0.1).long()
        doc = (first + torch.arange(n) + noise.cumsum(0)) % VOCAB
        tokens[start:start + n] = doc
        positions[start:start + n] = torch.arange(n)
        labels[start:start + n - 1] = doc[1:]
        start += n
        ends.append(start)
    return tokens, positions, labels, ends


class CursorLoader(BaseDataLoader):
    """The global row stream above, split over data ranks by a shared cursor."""

    def __init__(self, dp_rank: int, dp_world_size: int, batch_size: int, seq_len: int) -> None:
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.batch_size, self.seq_len = batch_size, seq_len
        self.cursor = 0

    def __iter__(self):
        while True:
            first = self.cursor + self.dp_rank * self.batch_size
            self.cursor += self.dp_world_size * self.batch_size
            rows = [make_row(first + i, self.seq_len) for i in range(self.batch_size)]
            bounds = [0]
            for r, (*_, ends) in enumerate(rows):
                bounds += [r * self.seq_len + e for e in ends]
            tokens = torch.stack([r[0] for r in rows])
            batch = {B.INPUT: tokens, B.POSITION_IDS: torch.stack([r[1] for r in rows]),
                     B.CU_SEQLENS: torch.tensor(bounds, dtype=torch.int32),
                     B.REAL_TOKENS: torch.tensor(tokens.numel())}
            yield batch, torch.stack([r[2] for r in rows])

    def state_dict(self):
        return {"cursor": self.cursor}

    def load_state_dict(self, state):
        self.cursor = state["cursor"]

    def load_state_dict_resharded(self, states):
        cursors = {s["cursor"] for s in states}
        if len(cursors) != 1:
            raise ValueError(f"data ranks stopped at different cursors {sorted(cursors)}")
        self.cursor = cursors.pop()


def build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, **kwargs):
    t = job_config.training
    return CursorLoader(dp_rank, dp_world_size, t.local_batch_size, t.seq_len)


FLAVORS = {"llama": CkptArgs(), "moe": CkptArgs(moe=True, llm=tiny_moe())}

NAME = "ckpt_omni"

try:
    register_train_spec(NAME, omni_train_spec(
        CkptModel, FLAVORS, build_dataloader_fn=build_dataloader,
        build_tokenizer_fn=lambda job_config: None))
except ValueError:  # already registered in this process
    pass
