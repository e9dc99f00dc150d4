"""LoRA in one process: an adapted model at init is its base model exactly; training changes
only the adapters; adapters and merging agree; the mixins keep names and never replace a
forward; compiled adapted blocks match eager; code that reads a linear's weight directly (a
head's chunked loss, a fused qkv read row by row) takes the adapters; ``[lora]`` settings are
checked at start-up with one line each."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed import common as C
from tests.harness import REPO
from tests.lora.common import TARGETS, perturb_adapters
from torchtitan_omni.config.manager import ConfigError, OmniConfigManager
from torchtitan_omni.lora import apply_lora
from torchtitan_omni.modules.lora import (
    adapter_names, add_lora, is_lora, lora_modules, merge_table, merged_weight,
)
from torchtitan_omni.protocols import batch as B


def _losses(model, batch, labels):
    meta, media = C._meta(batch)
    out = model(batch[B.INPUT], meta, labels, **media)
    return out.losses, out.aux_losses


def _adapted(spec, seed=0, **kw):
    with torch.device("cpu"):
        model = C.build_model(spec)
    summary = apply_lora(model, 4, 8.0, 0.0, kw.pop("targets", TARGETS), **kw)
    model.init_seed = seed
    with torch.no_grad():
        model.init_weights()
    return model, summary


@pytest.mark.parametrize("moe", [False, True])
def test_adapted_model_at_init_is_the_base_model_exactly(moe):
    spec = C.ModelSpec(moe=moe)
    base = C.reference_model(spec)
    model, summary = _adapted(spec)
    assert any(n.endswith("moe.experts") for n in summary.modules) == moe
    assert any(n.startswith("encoders.vision.attn.") for n in summary.modules)
    # the base weights are the same tensors by name and value: per-name seeded init
    adapters = adapter_names(model)
    state = {n: p for n, p in model.named_parameters() if n not in adapters}
    assert state.keys() == dict(base.named_parameters()).keys()
    for batch_seed in (1, 2):
        batch, labels = C.make_batch(batch_seed)
        ref, ref_aux = _losses(base, batch, labels)
        out, aux = _losses(model, batch, labels)
        for k in ref:
            assert torch.equal(out[k], ref[k]), (k, out[k], ref[k])
        for k in ref_aux:
            assert torch.equal(aux[k], ref_aux[k]), k
    # logits, not only the loss: the hidden states before the head are bitwise equal
    batch, labels = C.make_batch(3)
    seen = []
    for m in (base, model):
        handle = m.llm.output.register_forward_hook(lambda mod, i, o: seen.append(i[0]))
        _losses(m, batch, labels)
        handle.remove()
    assert torch.equal(base.llm.output(seen[0]), model.llm.output(seen[1]))


def test_training_changes_only_adapters_and_lowers_the_loss():
    spec = C.ModelSpec(moe=True)
    model, summary = _adapted(spec, targets=TARGETS + ["encoders.audio.conv|encoders.audio.proj"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    adapters = adapter_names(model)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == adapters
    assert summary.trainable_params == sum(p.numel() for p in trainable) == summary.adapter_params
    # weight decay would move any parameter the optimizer held
    opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)
    batch, labels = C.make_batch(5)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        out, aux = _losses(model, batch, labels)
        loss = out["text"] / (labels != B.IGNORE_INDEX).sum() + 0.01 * sum(aux.values())
        loss.backward()
        assert all(p.grad is None for n, p in model.named_parameters() if n not in adapters)
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0], losses
    for name, p in model.named_parameters():
        if name in adapters:
            assert not torch.equal(p, before[name]), f"{name} did not train"
        else:
            assert torch.equal(p, before[name]), f"frozen {name} changed"


def test_merged_weights_give_the_adapted_outputs():
    from torchtitan_omni.modules.moe import GroupedExperts

    torch.manual_seed(0)
    linear = torch.nn.Linear(12, 20)
    plain = copy.deepcopy(linear)
    add_lora(linear, 3, 6.0)
    with torch.no_grad():
        linear.lora_a.normal_()
        linear.lora_b.normal_()
    x = torch.randn(7, 12)
    with torch.no_grad():
        plain.weight.copy_(merged_weight(linear.weight, linear.lora_a, linear.lora_b, 2.0))
    torch.testing.assert_close(plain(x), linear(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain(x), torch.nn.functional.linear(x, linear.weight, linear.bias))

    experts = GroupedExperts(8, 6, 3)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=0.3)
    merged = copy.deepcopy(experts)
    add_lora(experts, 2, 4.0)
    with torch.no_grad():
        for n in adapter_names(experts):
            getattr(experts, n).normal_(std=0.3)
        for base, (a, b, scale) in merge_table(experts).items():
            getattr(merged, base).copy_(merged_weight(getattr(experts, base), getattr(experts, a),
                                                      getattr(experts, b), scale))
    x, counts = torch.randn(9, 8), torch.tensor([4, 0, 5])
    torch.testing.assert_close(experts(x, counts), merged(x, counts), rtol=1e-5, atol=1e-5)


def test_adapters_keep_names_and_never_replace_forward():
    spec = C.ModelSpec(moe=True)
    with torch.device("meta"):
        plain, model = C.build_model(spec), C.build_model(spec)
    apply_lora(model, 4, 8.0, 0.0, TARGETS)
    names = [n for n, _ in model.named_parameters() if n not in adapter_names(model)]
    assert names == [n for n, _ in plain.named_parameters()]
    assert not [n for n, m in model.named_modules() if "forward" in vars(m)]
    wq = model.llm.layers["0"].attention.wq
    assert is_lora(wq) and isinstance(wq, torch.nn.Linear)
    assert [n for n, _ in wq.named_parameters()] == ["weight", "lora_a", "lora_b"]
    experts = model.llm.layers["0"].moe.experts
    assert [tuple(getattr(experts, f"w1_lora_{x}").shape) for x in "ab"] == [(4, 4, 32), (4, 16, 4)]
    assert [tuple(getattr(experts, f"w2_lora_{x}").shape) for x in "ab"] == [(4, 4, 16), (4, 32, 4)]
    assert not is_lora(model.llm.layers["0"].moe.gate)  # the router stays frozen
    assert not any(p.requires_grad for p in model.llm.layers["0"].moe.gate.parameters())


def test_compiled_adapted_blocks_match_eager():
    from torchtitan_omni.distributed.parallelize import apply_compile

    torch._dynamo.reset()
    spec = C.ModelSpec(moe=False)
    eager, _ = _adapted(spec)
    perturb_adapters(eager)
    compiled = copy.deepcopy(eager)
    job = C.job_config(compile__enable=True, compile__backend="aot_eager",
                       compile__components=["model"])
    assert apply_compile(compiled, compiled.parallel_plan, job)["llm"] == 2
    batch, labels = C.make_batch(6)
    for m in (eager, compiled):
        out, _ = _losses(m, batch, labels)
        out["text"].backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        if p.grad is None:
            assert q.grad is None, name
        else:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert sum(p.grad is not None for p in eager.parameters()) == len(adapter_names(eager))


def _parse(*args: str):
    config = str(REPO / "train_configs" / "qwen3_moe_omni_debug.toml")
    return OmniConfigManager().parse_args(["--job.config_file", config, *args])


@pytest.mark.parametrize("args, message", [
    (("--lora.rank", "0"), "lora.rank must be >= 1, got 0"),
    (("--lora.alpha", "0"), "lora.alpha must be > 0, got 0.0"),
    (("--lora.dropout", "1"), "lora.dropout must be in [0, 1), got 1.0"),
    (("--lora.target_modules", "llm.layers.*.attention.wq,llm.layerz.*.wq"),
     "lora.target_modules entry 'llm.layerz.*.wq' matches no module of the model"),
    (("--lora.target_modules", "llm.layers.*.attention"),
     "lora.target_modules entry 'llm.layers.*.attention' matches no module LoRA can adapt: "
     "llm.layers.0.attention (SelfAttention: only nn.Linear and grouped experts take adapters)"),
    (("--lora.target_modules", "llm.output"), "llm.output (LinearHead: it is a text head"),
    (("--lora.train_modules", "encoders.nothing"),
     "lora.train_modules entry 'encoders.nothing' matches no module of the model"),
    (("--lora.train_modules", "llm.layers.0"),
     "lora.train_modules selects llm.layers.0, which overlaps the LoRA target "
     "llm.layers.0.attention.wk"),
    (("--omni.freeze", "llm"), "lora.target_modules selects llm.layers.0.attention.wq, "
     "which is frozen"),
    (("--lora.save_adapter_only", "--checkpoint.enable",
      "--checkpoint.initial_load_path", "/tmp"),
     "lora.save_adapter_only with checkpoint.initial_load_path"),
])
def test_bad_lora_settings_are_refused_on_one_line(args, message):
    with pytest.raises(ConfigError) as err:
        _parse("--lora.enable", *args)
    assert message in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_lora_settings_without_enable():
    with pytest.raises(ConfigError, match="lora.save_adapter_only is set but lora.enable is not"):
        _parse("--lora.save_adapter_only")
    cfg = _parse("--lora.rank", "0")  # not checked while LoRA is off
    assert not cfg.lora.enable
    cfg = _parse("--lora.enable")  # the default targets fit the MoE model: experts, attention
    assert cfg.lora.enable and cfg.lora.rank == 8
    with torch.device("meta"):
        from torchtitan_omni.job_model import model_on_meta
        from torchtitan_omni.lora import apply_lora_config

        model = model_on_meta(cfg)
    summary = apply_lora_config(model, cfg.lora)
    assert sorted({n.split(".", 3)[-1] for n in summary.modules}) == [
        "attention.wk", "attention.wo", "attention.wq", "attention.wv", "moe.experts"]
    assert len(lora_modules(model)) == len(summary.modules)


def test_heads_and_fused_projections_that_read_weights_directly_take_the_adapters():
    from torchtitan_omni.encoders.blocks import FusedQKVAttention
    from torchtitan_omni.encoders.projector import MLPProjector
    from torchtitan_omni.protocols.modules import AttentionMeta

    torch.manual_seed(0)
    # a prediction head's loss path: at B = 0 the base loss, then the adapted logits' loss
    head = MLPProjector(8, 11, hidden_dim=6, depth=2)
    x, targets = torch.randn(5, 8), torch.randint(0, 11, (5,))
    base = head(x, targets)
    add_lora(head.layers[1], 2, 4.0)
    with torch.no_grad():
        head.layers[1].lora_a.normal_()
        head.layers[1].lora_b.zero_()
    torch.testing.assert_close(head(x, targets), base, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        head.layers[1].lora_b.normal_()
    expected = torch.nn.functional.cross_entropy(head(x), targets, reduction="sum")
    torch.testing.assert_close(head(x, targets), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, base)
    # a fused qkv read row by row (async Ulysses' project) agrees with the one-GEMM path
    attn = FusedQKVAttention(16, 2)
    add_lora(attn.qkv, 2, 4.0)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(std=0.3)
    h = torch.randn(1, 5, 16)
    meta = AttentionMeta(torch.tensor([0, 5], dtype=torch.int32), 5, torch.zeros(1, 5).long(),
                         causal=False)
    for got, want in zip((attn.project(h, w, meta) for w in "qkv"), attn.project_qkv(h, meta)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
