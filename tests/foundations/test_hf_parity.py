"""The foundations against Hugging Face transformers, built from the same config and weights.

The HF model is built from the config our adapter exports (so ``hf_config`` is checked too),
randomly initialized in float32; its weights load into our foundation through the adapter.
Logits are compared on one packed document and on several documents packed into two rows
(each compared with its own HF forward); Qwen3-MoE's load-balancing loss is compared with HF's
``aux_loss`` / ``load_balancing_loss_func``.
"""

from __future__ import annotations

import glob
import tempfile

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from tests.foundations.hf_mapping import hf_to_ours, ours_to_hf  # noqa: E402
from torchtitan_omni.foundations.llama3 import Llama3, Llama3Args  # noqa: E402
from torchtitan_omni.foundations.qwen3 import Qwen3, Qwen3Args  # noqa: E402
from torchtitan_omni.foundations.qwen3_moe import AUX_LOSS, Qwen3Moe, Qwen3MoeArgs  # noqa: E402
from torchtitan_omni.modules.rope import RopeScaling  # noqa: E402
from torchtitan_omni.protocols.modules import AttentionMeta  # noqa: E402

RTOL = 1e-5


def _llama_args() -> Llama3Args:
    # Scaling with original_max_position_embeddings=32 puts the 16-dim head's frequencies in
    # all three regions (kept, smoothed, divided), so the Llama-3.1 rule is exercised.
    return Llama3Args(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_hidden_dim=96,
        norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=32),
    )


def _qwen_args(norm_topk_prob: bool = True) -> Qwen3MoeArgs:
    # head_dim 16 with dim 48: q/k/v widths differ from the model width (explicit head_dim).
    return Qwen3MoeArgs(
        dim=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=96, num_experts=8,
        top_k=2, moe_hidden_dim=32, norm_topk_prob=norm_topk_prob, max_seq_len=64,
    )


def _qwen3_dense_args() -> Qwen3Args:
    # Odd sizes: GQA 3:1 (6 q heads, 2 kv heads), head_dim 20 (not a power of two) with dim
    # 40, so q is 120 wide and k/v 40; an FFN width that is no multiple of the model width.
    return Qwen3Args(dim=40, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=20, vocab_size=96,
                     ffn_hidden_dim=72, max_seq_len=64)


def _hf_model(config_dict: dict, cls_name: str, config_cls_name: str):
    config = getattr(transformers, config_cls_name).from_dict(
        {**config_dict, "initializer_range": 0.15}
    )
    config._attn_implementation = "eager"  # an implementation independent of our SDPA path
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config).float().eval()
    with torch.no_grad():  # HF initializes norms to one; random norms test their mapping
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _checkpoint(hf_model) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes (transformers 5 fuses experts in memory, not on disk)."""
    with tempfile.TemporaryDirectory() as d:
        hf_model.save_pretrained(d)
        state = {}
        for path in sorted(glob.glob(f"{d}/*.safetensors")):
            state.update(load_file(path))
    return state


def _ours(foundation_cls, args, hf_model):
    model = foundation_cls(args)
    sd = hf_to_ours(model.hf_adapter(), _checkpoint(hf_model))
    missing, unexpected = model.load_state_dict(sd, strict=True)
    assert not missing and not unexpected
    model.rope.init_weights()
    return model.eval()


def _logits(model, tokens, cu_seqlens, position_ids):
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    meta = AttentionMeta(
        cu_seqlens=cu_seqlens, max_seqlen=int(lengths.max()), position_ids=position_ids
    )
    return model.output(model(model.tok_embeddings(tokens), meta))


def _assert_close(ours, ref, what):
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= RTOL * scale, f"{what}: max abs diff {err:.3e} vs max |ref| {scale:.3e}"


def _packed(docs: list[list[torch.Tensor]]):
    """Rows of documents -> tokens [B, S], position ids, cu_seqlens over B*S."""
    rows, positions, bounds = [], [], [0]
    for row in docs:
        rows.append(torch.cat(row))
        positions.append(torch.cat([torch.arange(len(d)) for d in row]))
        for d in row:
            bounds.append(bounds[-1] + len(d))
    return torch.stack(rows), torch.stack(positions), torch.tensor(bounds, dtype=torch.int32)


CASES = {
    "llama3": (Llama3, _llama_args, "LlamaForCausalLM", "LlamaConfig"),
    "qwen3_moe": (Qwen3Moe, _qwen_args, "Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
    "qwen3": (Qwen3, _qwen3_dense_args, "Qwen3ForCausalLM", "Qwen3Config"),
}


@pytest.mark.parametrize("family", list(CASES))
@torch.no_grad()
def test_single_document_logits_match_hf(family):
    cls, make_args, hf_cls, cfg_cls = CASES[family]
    args = make_args()
    hf = _hf_model(cls(args).hf_adapter().hf_config(), hf_cls, cfg_cls)
    ours = _ours(cls, args, hf)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (1, 40), generator=g)
    ref = hf(input_ids=tokens, output_router_logits=family == "qwen3_moe")
    got = _logits(ours, tokens, torch.tensor([0, 40], dtype=torch.int32), torch.arange(40)[None])
    _assert_close(got, ref.logits, f"{family} logits")
    if family == "qwen3_moe":
        aux = ours.aux_losses()[AUX_LOSS]
        torch.testing.assert_close(aux, ref.aux_loss.float(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("family", list(CASES))
@torch.no_grad()
def test_packed_documents_match_separate_hf_forwards(family):
    cls, make_args, hf_cls, cfg_cls = CASES[family]
    args = make_args()
    hf = _hf_model(cls(args).hf_adapter().hf_config(), hf_cls, cfg_cls)
    ours = _ours(cls, args, hf)
    g = torch.Generator().manual_seed(2)
    docs = [[torch.randint(0, args.vocab_size, (n,), generator=g) for n in row]
            for row in ([13, 11], [24])]
    tokens, positions, cu = _packed(docs)
    got = _logits(ours, tokens, cu, positions).flatten(0, 1)
    router_logits = []
    for i, doc in enumerate(d for row in docs for d in row):
        ref = hf(input_ids=doc[None], output_router_logits=family == "qwen3_moe")
        _assert_close(got[cu[i]:cu[i + 1]], ref.logits[0], f"{family} document {i}")
        if family == "qwen3_moe":
            router_logits.append(ref.router_logits)
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        per_layer = tuple(
            torch.cat([r[layer] for r in router_logits]) for layer in range(args.n_layers)
        )
        ref_aux = load_balancing_loss_func(per_layer, args.num_experts, args.top_k)
        torch.testing.assert_close(ours.aux_losses()[AUX_LOSS], ref_aux.float(), rtol=1e-5, atol=0)


@torch.no_grad()
def test_qwen3_moe_without_topk_renormalization_matches_hf():
    args = _qwen_args(norm_topk_prob=False)
    hf = _hf_model(Qwen3Moe(args).hf_adapter().hf_config(), "Qwen3MoeForCausalLM", "Qwen3MoeConfig")
    assert hf.config.norm_topk_prob is False
    ours = _ours(Qwen3Moe, args, hf)
    tokens = torch.randint(0, args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    got = _logits(ours, tokens, torch.tensor([0, 24], dtype=torch.int32), torch.arange(24)[None])
    _assert_close(got, hf(input_ids=tokens).logits, "qwen3_moe (norm_topk_prob=False) logits")


@pytest.mark.parametrize("family", list(CASES))
def test_adapter_round_trip(family):
    """ours -> HF names -> ours is the identity, and HF's own model accepts the HF names."""
    cls, make_args, hf_cls, cfg_cls = CASES[family]
    args = make_args()
    model = cls(args)
    g = torch.Generator().manual_seed(4)
    state = {k: torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    adapter = model.hf_adapter()
    hf_state = ours_to_hf(adapter, state)
    back = hf_to_ours(adapter, hf_state)
    assert set(back) == set(state)
    for k in state:
        assert torch.equal(back[k], state[k]), k
    # The HF names and shapes are exactly those of the HF model's checkpoint.
    saved = _checkpoint(_hf_model(adapter.hf_config(), hf_cls, cfg_cls))
    assert {k: tuple(v.shape) for k, v in saved.items()} == {
        k: tuple(v.shape) for k, v in hf_state.items()
    }


@pytest.mark.parametrize("family", list(CASES))
@torch.no_grad()
def test_kv_cached_decoding_matches_hf_logits(family):
    """Prefill then token-by-token decoding through ``AttentionMeta.kv_cache`` gives HF's
    logits of the full sequence (two independent rows)."""
    from torchtitan_omni.modules.attention import KVCache

    cls, make_args, hf_cls, cfg_cls = CASES[family]
    args = make_args()
    hf = _hf_model(cls(args).hf_adapter().hf_config(), hf_cls, cfg_cls)
    ours = _ours(cls, args, hf)
    tokens = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(12).expand(2, 12)
    cache = KVCache()
    steps = [(0, 8)] + [(i, i + 1) for i in range(8, 12)]
    pieces = []
    for a, b in steps:
        meta = AttentionMeta(None, 0, positions[:, a:b], kv_cache=cache)
        pieces.append(ours.output(ours(ours.tok_embeddings(tokens[:, a:b]), meta)))
    _assert_close(torch.cat(pieces, 1), hf(input_ids=tokens).logits, f"{family} cached decoding")
