"""Float8 through TorchTitan's converter: either name reaches TorchTitan 0.2.2's registry, only
the foundation's block linears are swapped (the text head, encoders, decoders and the frozen VQ
stay as they are), an emulated float8 forward/backward of the debug model runs, and the trainer
trains with emulated float8 on CPU near its float32 losses (torchao needed; skipped without
it)."""

from __future__ import annotations

import copy
import dataclasses
import sys
import types

import pytest
import torch

import torchtitan_omni.models  # noqa: F401  (registers the specs)
from tests.harness import REPO, run_train
from tests.models.batches import mixed_batch
from torchtitan.protocols.model_converter import build_model_converters
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan_omni.components.quantization import (
    ENCODERS_FILTER, FLOAT8_CONVERTER, FLOAT8_ENCODERS_CONVERTER, OMNI_FLOAT8_FILTERS,
    prepare_float8,
)
from torchtitan_omni.config.manager import parse_job_config
from torchtitan_omni.modules.linear_cross_entropy import LinearHead


@pytest.fixture
def float8_allowed(monkeypatch):
    """Start-up checks as on a Hopper GPU (float8 is refused on CPU runs), torchao faked when
    it is not installed (only its presence is checked at start-up)."""
    from torchtitan_omni.config import values

    monkeypatch.setattr(values.platform, "is_cpu", lambda: False)
    monkeypatch.setattr(values, "cuda_capability", lambda: (9, 0))
    try:
        import torchao  # noqa: F401
    except ImportError:
        monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))


def _job(*extra):
    return parse_job_config(
        ["--job.config_file", str(REPO / "train_configs" / "llama_omni_debug.toml"), *extra]
    )


class _Dims:
    dp_shard_enabled = False


def convert_as_trainer(model: torch.nn.Module, *extra: str) -> torch.nn.Module:
    """``model`` converted in place as the trainer converts it for ``model.converters =
    ["float8"]`` (:func:`prepare_float8`, then the converters from TorchTitan's registry);
    ``extra``: more arguments (e.g. ``--quantize.linear.float8.emulate``)."""
    job = _job("--model.converters", "float8", *extra)
    prepare_float8(job)
    build_model_converters(job, _Dims()).convert(model)
    return model


def test_filters_are_added_only_with_float8(float8_allowed):
    assert prepare_float8(_job()) == []
    job = _job("--model.converters", "float8", "--quantize.linear.float8.filter_fqns", "w2")
    assert prepare_float8(job) == ["w2", *OMNI_FLOAT8_FILTERS]
    assert prepare_float8(job) == ["w2", *OMNI_FLOAT8_FILTERS]  # idempotent
    assert job.model.converters == [FLOAT8_CONVERTER]
    # the encoders: TorchTitan's converter still skips them, the omni converter takes them
    job = _job("--model.converters", "float8", "--omni.float8_encoders")
    for _ in range(2):  # idempotent
        left = prepare_float8(job)
        assert ENCODERS_FILTER not in left
        assert ENCODERS_FILTER in job.quantize.linear.float8.filter_fqns
        assert job.model.converters == [FLOAT8_CONVERTER, FLOAT8_ENCODERS_CONVERTER]


@pytest.mark.parametrize("names", [["float8"], [FLOAT8_CONVERTER], ["float8", FLOAT8_CONVERTER]])
def test_either_name_builds_torchtitans_converter_once(float8_allowed, names):
    """TorchTitan 0.2.2 looks converters up by registry key ('float8' is not one)."""
    pytest.importorskip("torchao.float8")
    from torchtitan.components.quantization.float8 import Float8LinearConverter

    job = _job("--model.converters", ",".join(names), "--quantize.linear.float8.emulate")
    prepare_float8(job)
    container = build_model_converters(job, _Dims())
    assert [type(c) for c in container.converters] == [Float8LinearConverter]


def test_moe_routers_stay_out_of_float8(float8_allowed):
    """In the MoE foundation float8 takes the attention projections, not the routers (the
    experts are grouped weights, not linears: TorchTitan's grouped-GEMM float8 is refused)."""
    pytest.importorskip("torchao.float8")
    spec = get_train_spec("qwen3_moe_omni")
    args = spec.model_args["debugmodel"]
    # 16 experts: a router TorchTitan's own rule (dims divisible by 16) would swap
    args = dataclasses.replace(args, llm=dataclasses.replace(args.llm, num_experts=16))
    model = convert_as_trainer(spec.model_cls(args), "--quantize.linear.float8.emulate")
    swapped = sorted(n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear")
    linears = [n for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.startswith("llm.layers.")]
    routers = [n for n in linears if n.endswith("moe.gate")]
    assert routers and swapped == sorted(set(linears) - set(routers))


def test_encoders_join_float8_when_asked(float8_allowed):
    """``omni.float8_encoders``: every encoder linear TorchTitan's rule accepts (dimensions
    divisible by 16) goes float8 as well, nothing else changes; without it none does. The
    converted model still trains (emulated), its vision tower receiving gradients."""
    pytest.importorskip("torchao.float8")
    spec = get_train_spec("llama_omni")
    args = spec.model_args["debugmodel"]

    def converted(*extra):
        model = convert_as_trainer(spec.model_cls(args), "--quantize.linear.float8.emulate",
                                   *extra)
        return model, {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}

    _, foundation_only = converted()
    model, with_encoders = converted("--omni.float8_encoders")
    in_encoders = {n for n in with_encoders if n.startswith("encoders.")}
    eligible = {n for n, m in model.named_modules() if n.startswith("encoders.")
                and isinstance(m, torch.nn.Linear)
                and m.in_features % 16 == 0 and m.out_features % 16 == 0}
    assert {n.split(".")[1] for n in in_encoders} == {"vision", "audio"}
    assert in_encoders == eligible
    assert with_encoders - in_encoders == foundation_only
    assert not any(n.startswith("encoders.") for n in foundation_only)
    model.init_weights()
    batch, labels = mixed_batch(model, args.llm_args.vocab_size)
    from tests.models.test_debug_flavors import _forward

    loss, _ = _forward(model, batch, labels)
    loss.backward()
    vision = next(model.encoders["vision"].get_submodule(n.removeprefix("encoders.vision."))
                  for n in sorted(in_encoders) if n.startswith("encoders.vision."))
    assert torch.isfinite(loss) and vision.weight.grad is not None
    assert float(vision.weight.grad.abs().sum()) > 0


def scaled_mm_inner_dims(run, monkeypatch) -> list[int]:
    """The inner dimension of every ``torch._scaled_mm`` that ``run()`` calls (torchao calls
    it inside its float8 tensors' dispatch, where a dispatch mode does not see it)."""
    inner = []
    scaled_mm = torch._scaled_mm

    def recorded(a, b, *args, **kwargs):
        inner.append(a.shape[1])
        return scaled_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recorded)
    run()
    return inner


def test_encoder_float8_matmuls_pad_rows_to_16(float8_allowed, monkeypatch):
    """An encoder's row count follows the batch's media, and its weight gradients' float8
    matmuls run over those rows, where ``torch._scaled_mm`` on a GPU takes only multiples of 16
    (11,048 patches failed on 2x H200). The encoders' float8 linears pad each matmul's inner
    dimension; the foundation's keep torchao's default. Real (not emulated) float8 matmuls on
    CPU, which runs any size: the vision tower over 12 patches (3 merged rows)."""
    pytest.importorskip("torchao.float8")
    from torchtitan.components.quantization import float8 as titan_float8

    monkeypatch.setattr(titan_float8, "has_cuda_capability", lambda *_: True)  # as on Hopper
    spec = get_train_spec("llama_omni")
    model = convert_as_trainer(spec.model_cls(spec.model_args["debugmodel"]),
                               "--omni.float8_encoders")
    model.init_weights()
    float8 = {n: m for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert {n for n, m in float8.items() if m.config.pad_inner_dim} == {
        n for n in float8 if n.startswith("encoders.")}
    vision = model.encoders["vision"]
    media = {"patches": torch.randn(12, vision.args.patch_dim),
             "grid_thw": torch.tensor([[1, 2, 6]])}

    def step():
        vision.lm_encode(media, "image").square().sum().backward()

    inner = scaled_mm_inner_dims(step, monkeypatch)
    linears = sum(1 for n in float8 if n.startswith("encoders.vision."))
    assert len(inner) == 3 * linears  # forward, input gradient, weight gradient
    assert all(k % 16 == 0 for k in inner), sorted(set(inner))
    assert vision.merger.mlp.layers[0].weight.grad is not None


def test_converter_swaps_only_foundation_blocks(float8_allowed):
    pytest.importorskip("torchao.float8")
    spec = get_train_spec("llama_omni")
    args = spec.model_args["debugmodel"]
    model = convert_as_trainer(spec.model_cls(args), "--quantize.linear.float8.emulate")
    swapped = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    linears = [n for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.startswith("llm.layers.")]
    assert swapped and sorted(swapped) == sorted(linears)
    assert type(model.llm.output) is LinearHead
    model.init_weights()
    batch, labels = mixed_batch(model, args.llm_args.vocab_size)
    from tests.models.test_debug_flavors import _forward

    loss, _ = _forward(model, batch, labels)
    loss.backward()
    assert torch.isfinite(loss)
    assert model.llm.layers["0"].attention.wq.weight.grad is not None


@pytest.mark.slow
def test_trainer_with_emulated_float8_on_cpu():
    """The whole trainer path (start-up check, TorchTitan's converter from its registry, FSDP
    over 2 ranks gathering float8 weights, the scales' post-optimizer hook) with float8
    numerics emulated: the losses stay near the same run's in float32 (float8 rounds the block
    linears' inputs and weights: close, not equal), also with ``omni.float8_encoders``."""
    pytest.importorskip("torchao.float8")
    config = "train_configs/llama_omni_debug.toml"
    args = ("--training.steps", "4", "--lr_scheduler.warmup_steps", "2", "--debug.seed", "7",
            "--checkpoint.no-enable")
    # with TorchTitan's recommended FSDP settings, as the GPU benchmark points run float8
    float8 = ("--model.converters", "float8", "--quantize.linear.float8.emulate",
              "--quantize.linear.float8.enable_fsdp_float8_all_gather",
              "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp")
    plain = run_train(config, 2, *args, "--job.dump_folder", "outputs/test_float8_plain")
    fp8 = run_train(config, 2, *args, *float8, "--job.dump_folder", "outputs/test_float8_emulated")
    # the encoders' linears too (their FSDP units gathering float8 weights as well)
    encoders = run_train(config, 2, *args, *float8, "--omni.float8_encoders",
                         "--job.dump_folder", "outputs/test_float8_emulated_encoders")
    for run in (plain, fp8, encoders):
        assert run.returncode == 0, run.output[-3000:]
    assert "Float8 linears in the foundation's blocks;" in fp8.output
    assert "Float8 linears in the foundation's blocks and the encoders;" in encoders.output
    a, b, c = plain.loss_list(), fp8.loss_list(), encoders.loss_list()
    assert len(a) == len(b) == len(c) == 4
    assert a != b and b != c  # float8 rounding took effect, in the encoders too
    for x, y, z in zip(a, b, c):
        assert abs(x - y) < 0.02 * abs(x) and abs(x - z) < 0.02 * abs(x), (a, b, c)


def calls_in_backward(block: torch.nn.Module, x: torch.Tensor, *ops) -> tuple[int, torch.Tensor]:
    """How many times the backward of ``block(x).square().sum()`` runs one of ``ops`` (the
    recompute's calls among them), and the input's gradient."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in ops:
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    x = x.clone().requires_grad_()
    out = block(x)
    with Count():
        out.float().square().sum().backward()
    return Count.calls, x.grad


def float8_block(emulate: bool) -> torch.nn.Module:
    """Two linears with a GELU between, converted to torchao's float8 linears."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 64))
    convert_to_float8_training(block, config=Float8LinearConfig(emulate=emulate))
    return block


def test_per_op_checkpointing_keeps_float8_scales(monkeypatch):
    """Per-op selective AC keeps the amax a float8 linear scales by (a scalar) instead of
    recomputing it from the whole input in the backward; gradients are the same either way."""
    pytest.importorskip("torchao.float8")
    from torchtitan_omni.distributed import activation_checkpoint as ac

    block = float8_block(emulate=True)
    recomputing = copy.deepcopy(block)
    ac.checkpoint_units([block], "selective", "op")
    x = torch.randn(32, 64)
    op = torch.ops.aten.max.default
    kept, grad = calls_in_backward(block, x, op)
    monkeypatch.setattr(ac, "_SAVE_OVERLOADS", set())
    ac.checkpoint_units([recomputing], "selective", "op")
    again, grad_again = calls_in_backward(recomputing, x, op)
    assert kept < again, (kept, again)
    torch.testing.assert_close(grad, grad_again, rtol=0, atol=0)
