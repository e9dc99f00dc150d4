"""``[compile]``: every spec's debug model compiled (blocks of every part, activation
checkpointing per op inside the compiled blocks, the text head's loss kernel) gives the eager
model's losses and gradients in float32, on batches of changing shapes without recompiling
for a shape already seen; the MoE blocks (exact local dispatch, and capacity-padded dispatch
with copies dropped) each compile as one graph (fullgraph=True); and ``run_train.sh`` with
Ulysses 2 + FSDP trains the same losses compiled as eager."""

from __future__ import annotations

import copy

import pytest
import torch

import torchtitan_omni.models  # noqa: F401  (registers the specs)
from tests.harness import REPO, run_train
from tests.models.batches import mixed_batch
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan_omni.config.manager import parse_job_config
from torchtitan_omni.distributed.compile import compile_units, compiled_graphs, is_compiled
from torchtitan_omni.distributed.expert_parallel import apply_expert_parallel
from torchtitan_omni.distributed.parallelize import (
    apply_activation_checkpointing, apply_compile, matching_modules,
)
from torchtitan_omni.modules.moe_capacity import CapacityDispatcher
from torchtitan_omni.protocols import batch as B
from torchtitan_omni.protocols.modules import AttentionMeta

SPECS = ["janus", "llama_omni", "qwen3_moe_omni", "qwen3_omni"]


def _job(spec: str, *extra: str):
    return parse_job_config(
        [
            "--job.config_file",
            str(REPO / "train_configs" / f"{spec}_debug.toml"),
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
            "--omni.encoder_activation_checkpoint",
            "full",
            *extra,
        ]
    )


def _padded(batch: dict, labels: torch.Tensor, extra: int) -> tuple[dict, torch.Tensor]:
    """The same batch with ``extra`` padding positions appended to every row (a new shape)."""
    rows, s = labels.shape
    cu = batch[B.CU_SEQLENS].long()
    doc = torch.searchsorted(cu[1:], torch.arange(rows * s), right=True).view(rows, s)
    pad_doc = doc.max() + 1 + torch.arange(rows).unsqueeze(1).expand(rows, extra)
    doc = torch.cat([doc, pad_doc], 1).flatten()
    starts = torch.nonzero(torch.cat([torch.tensor([True]), doc[1:] != doc[:-1]])).flatten()
    out = dict(batch)
    out[B.CU_SEQLENS] = torch.cat([starts, torch.tensor([doc.numel()])]).to(torch.int32)
    for key, value in batch.items():
        if B.is_token_aligned(key):
            fill = 0 if key in (B.INPUT, B.POSITION_IDS) else -1
            out[key] = torch.cat([value, torch.full((rows, extra), fill, dtype=value.dtype)], 1)
    return out, torch.cat([labels, torch.full((rows, extra), B.IGNORE_INDEX)], 1)


def _dropped(model) -> int:
    counts = model.llm.moe_counts()
    return 0 if counts is None else int(counts[1].sum())


def _loss_and_grads(model, batch, labels):
    batch = dict(batch)
    cu = batch.pop(B.CU_SEQLENS)
    meta = AttentionMeta(cu, int((cu[1:] - cu[:-1]).max()), batch.pop(B.POSITION_IDS))
    tokens = batch.pop(B.INPUT)
    batch.pop(B.REAL_TOKENS)
    model.zero_grad(set_to_none=True)
    out = model(tokens, meta, labels, **batch)
    loss = sum(out.losses.values()) + sum(out.aux_losses.values())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("spec", SPECS)
def test_compiled_model_matches_eager(spec):
    torch._dynamo.reset()  # graphs cached by another spec's test would hide this one's
    torch.manual_seed(0)
    train_spec = get_train_spec(spec)
    args = train_spec.model_args["debugmodel"]
    eager = train_spec.model_cls(args)
    eager.init_weights()
    compiled = copy.deepcopy(eager)
    job = _job(spec, "--compile.enable", "--compile.components", "model,loss")
    for model in (eager, compiled):
        apply_activation_checkpointing(model, model.parallel_plan, job)
    done = apply_compile(compiled, compiled.parallel_plan, job)
    assert done["llm"] == args.llm_args.n_layers and done["loss heads"] == 1
    assert all(is_compiled(b) for b in compiled.llm.layers.values())
    # no graph break anywhere in a block (fullgraph=True raises on one)
    assert all(getattr(b, "compile_fullgraph", True) for b in compiled.llm.layers.values())
    vocab = args.llm_args.vocab_size
    first = mixed_batch(eager, vocab, 0)
    second = _padded(*mixed_batch(eager, vocab, 1), extra=24)
    batches = [first, second, _padded(*first, extra=24)]
    assert first[1].shape != second[1].shape  # a new shape: the dynamic recompile
    graphs = compiled_graphs()
    for i, (batch, labels) in enumerate(batches):
        if i == 2:
            assert compiled_graphs() > graphs, "nothing was compiled"
            graphs = compiled_graphs()
        ref_loss, ref_grads = _loss_and_grads(eager, batch, labels)
        loss, grads = _loss_and_grads(compiled, batch, labels)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    assert compiled_graphs() == graphs, "a shape seen before was compiled again"


def test_compiled_moe_blocks_with_capacity_dispatch_match_eager():
    """The MoE blocks alone compiled (one graph each, per-op AC inside) with the
    capacity-padded dispatcher, capacity sized by each batch's own tokens (symbolic under
    dynamic shapes): same losses, gradients and dropped copies as eager, copies dropped.

    Backend aot_eager (dynamo's one graph and AOT autograd, without inductor's code
    generation): inductor takes minutes on two shared cores here; the model test above runs
    the same blocks with the exact dispatcher through inductor, and
    ``tests/test_gpu_fast_paths.py`` this dispatcher on CUDA."""
    torch.manual_seed(0)
    train_spec = get_train_spec("qwen3_moe_omni")
    eager = train_spec.model_cls(train_spec.model_args["debugmodel"])
    eager.init_weights()
    names = [n for n, _ in matching_modules(eager, "", eager.parallel_plan.experts)]
    apply_expert_parallel(eager, names, None, capacity_factor=1.0)
    blocks = list(eager.llm.layers.values())
    assert all(isinstance(b.moe.dispatcher, CapacityDispatcher) for b in blocks)
    compiled = copy.deepcopy(eager)
    job = _job("qwen3_moe_omni")
    for model in (eager, compiled):
        apply_activation_checkpointing(model, model.parallel_plan, job)
    units = list(compiled.llm.layers.values())
    assert all(u.compile_fullgraph for u in units)  # fullgraph=True: a graph break raises
    compile_units(units, "aot_eager")
    vocab = train_spec.model_args["debugmodel"].llm_args.vocab_size
    first = mixed_batch(eager, vocab, 0)
    for batch, labels in (first, _padded(*mixed_batch(eager, vocab, 1), extra=24)):
        ref_loss, ref_grads = _loss_and_grads(eager, batch, labels)
        loss, grads = _loss_and_grads(compiled, batch, labels)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
        assert _dropped(compiled) == _dropped(eager) > 0


def test_compile_off_compiles_nothing():
    spec = get_train_spec("llama_omni")
    with torch.device("meta"):
        model = spec.model_cls(spec.model_args["debugmodel"])
    assert apply_compile(model, model.parallel_plan, _job("llama_omni")) == {}
    assert not any(is_compiled(m) for m in model.modules())


@pytest.mark.slow
def test_run_train_compiled_matches_eager_with_gather_dispatch():
    """EP2 with the gather dispatch (no host read): the MoE blocks compiled, each as one graph
    with its checkpoint inside (their experts outside FSDP under full AC: no FSDP hooks
    around them), train the eager losses; so do they with both blocks one FSDP unit
    (``parallelism.llm_blocks_per_fsdp_unit``), and under the per-op selective AC that keeps
    only the attention's outputs (allowed with EP where the experts skip FSDP)."""
    config = REPO / "train_configs" / "qwen3_moe_omni_debug.toml"
    common = ("--training.steps", "3", "--lr_scheduler.warmup_steps", "2",
              "--debug.deterministic", "--debug.seed", "42",
              "--parallelism.expert_parallel_degree", "2",
              "--parallelism.expert_dispatch", "gather", "--activation_checkpoint.mode", "full")
    compiled = ("--compile.enable", "--compile.components", "model", "--compile.backend",
                "aot_eager")
    runs = {}
    attention = ("--activation_checkpoint.mode", "selective",
                 "--activation_checkpoint.selective_ac_option", "attention")
    for tag, extra in (("eager", ()), ("compiled", compiled),
                       ("grouped", (*compiled, "--parallelism.llm_blocks_per_fsdp_unit", "2")),
                       ("attention", (*compiled, *attention))):
        run = run_train(config, 2, *common, "--job.dump_folder",
                        f"outputs/test_compile_gather_{tag}", *extra)
        assert run.returncode == 0, run.output[-4000:]
        assert sorted(run.losses) == [1, 2, 3], run.output[-3000:]
        runs[tag] = run
    assert "compiled graphs:" in runs["compiled"].output
    assert "Experts outside FSDP" in runs["compiled"].output
    # one graph a block: nothing compiled in pieces before the checkpoint
    assert "torch.compile: llm: 2" in runs["compiled"].output, runs["compiled"].output[-3000:]
    assert "with graph breaks" not in runs["compiled"].output
    assert "Experts outside FSDP" in runs["attention"].output
    for tag in ("compiled", "grouped", "attention"):
        for step in (1, 2, 3):
            assert abs(runs[tag].losses[step] - runs["eager"].losses[step]) <= 2e-5, (
                tag, runs["eager"].losses, runs[tag].losses)


@pytest.mark.slow
def test_run_train_compiled_matches_eager_with_ulysses():
    config = REPO / "train_configs" / "llama_omni_debug.toml"
    common = ("--training.steps", "3", "--lr_scheduler.warmup_steps", "2",
              "--debug.deterministic", "--debug.seed", "42",
              "--parallelism.ulysses_degree", "2", "--activation_checkpoint.mode", "selective",
              "--activation_checkpoint.selective_ac_option", "op")
    runs = {}
    for tag, extra in (("eager", ()), ("compiled", ("--compile.enable", "--compile.components",
                                                    "model,loss"))):
        run = run_train(config, 2, *common, "--job.dump_folder", f"outputs/test_compile_{tag}",
                        *extra)
        assert run.returncode == 0, run.output[-4000:]
        assert sorted(run.losses) == [1, 2, 3], run.output[-3000:]
        runs[tag] = run
    assert "compiled graphs:" in runs["compiled"].output
    for step in (1, 2, 3):
        # losses are printed with 5 decimals: equal values may differ by one last digit
        assert abs(runs["compiled"].losses[step] - runs["eager"].losses[step]) <= 2e-5, (
            runs["eager"].losses, runs["compiled"].losses)


@pytest.mark.slow
def test_the_logged_graph_count_sums_every_ranks_graphs(tmp_path):
    """One rank's compile stalls every rank at the next collective, so a line's compiled
    graphs are the sum over the ranks: it grows whenever any rank compiles, also where that
    rank compiles what another already has. Rank 1 compiles five graphs more than rank 0 in
    its first step (``compile_count_entry``); the last line's count is both ranks' own counts
    added."""
    import json

    steps = tmp_path / "steps.jsonl"
    run = run_train(REPO / "train_configs" / "llama_omni_debug.toml", 2,
                    "--training.steps", "2", "--lr_scheduler.warmup_steps", "1",
                    "--compile.enable", "--compile.components", "loss",
                    "--compile.backend", "eager",
                    "--job.dump_folder", "outputs/test_compile_graph_count",
                    env={"TRAIN_FILE": "tests.distributed.compile_count_entry",
                         "OMNI_STEP_FILE": str(steps)})
    assert run.returncode == 0, run.output[-4000:]
    lines = [json.loads(line) for line in steps.read_text().splitlines()]
    assert sorted((line["step"], line["rank"]) for line in lines) == [
        (1, 0), (1, 1), (2, 0), (2, 1)]
    # the last step is logged at once: each rank's own count is of the line's moment
    last = {line["rank"]: line for line in lines if line["step"] == 2}
    assert last[0]["own"] >= 1 and last[1]["own"] >= 5, lines  # the loss kernel; the extras
    assert last[0]["line"] == last[1]["line"] == last[0]["own"] + last[1]["own"], lines
    assert f"compiled graphs: {last[0]['line']}" in run.output


def test_wrapping_keeps_names_and_never_replaces_forward():
    # checkpointing and compiling subclass each unit's class; no instance gets a forward of
    # its own and every parameter keeps its name
    from torchtitan_omni.distributed.activation_checkpoint import is_checkpointed

    spec = get_train_spec("llama_omni")
    model = spec.model_cls(spec.model_args["debugmodel"])
    names = [n for n, _ in model.named_parameters()]
    job = _job("llama_omni", "--compile.enable")
    apply_activation_checkpointing(model, model.parallel_plan, job)
    apply_compile(model, model.parallel_plan, job)
    block = model.llm.layers["0"]
    assert is_checkpointed(block) and is_compiled(block)
    assert isinstance(block, type(spec.model_cls(spec.model_args["debugmodel"]).llm.layers["0"]))
    assert [n for n, _ in model.named_parameters()] == names
    assert not [n for n, m in model.named_modules() if "forward" in vars(m)]


def _largest_saved_by_llm_blocks(rank, world, compiled, checkpointed):
    """The largest tensor (elements) any LLM block saves for its backward, other than its
    parameters, over one EP2 gather-dispatch step; and a block input's size."""
    from tests.distributed import common as C

    dims = C.make_dims(world, ep=2)
    overrides = dict(parallelism__expert_parallel_degree=2,
                     parallelism__expert_dispatch="gather",
                     activation_checkpoint__mode="full" if checkpointed else "none")
    if compiled:
        overrides.update(compile__enable=True, compile__components=["model"],
                         compile__backend="aot_eager")
    model = C.parallel_model(C.ModelSpec(moe=True), dims, C.job_config(**overrides))
    largest, inputs = [0], []

    def pack(tensor):
        params = (p for p in current[0].parameters())
        if not any(tensor.shape == p.shape and tensor.data_ptr() == p.data_ptr()
                   for p in params):
            largest[0] = max(largest[0], tensor.numel())
        return tensor

    current = [None]
    contexts = []

    def enter(block, args):
        current[0] = block
        inputs.append(args[0].numel())
        contexts.append(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        contexts[-1].__enter__()

    def leave(block, args, output):
        contexts.pop().__exit__(None, None, None)

    for block in model.llm.layers.values():
        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)
    C.parallel_step(model, dims, *C.make_batch(500 + rank))
    return largest[0], max(inputs)


@pytest.mark.parametrize("compiled, checkpointed, saves_activations", [
    (True, True, False),  # the one-graph block: its checkpoint inside the compiled graph
    (False, False, True),  # no AC: the activations (the gathered rows among them) are saved
])
def test_compiled_moe_block_saves_only_its_inputs(compiled, checkpointed, saves_activations):
    """EP2 gather dispatch, experts outside FSDP: a MoE block compiled as one graph around its
    checkpoint (full AC) keeps what eager full AC keeps, its inputs and parameters, and no
    activation larger than its input (the all-gathered rows, the sorted copies), so its memory
    does not grow with the EP degree's worst-case buffers. Without AC it does (the check's
    own control)."""
    from tests.harness import run_distributed

    for largest, block_input in run_distributed(_largest_saved_by_llm_blocks, 2, compiled,
                                                checkpointed):
        if saves_activations:
            assert largest > block_input, (largest, block_input)
        else:  # the block's input itself (so the hook saw the compiled graph's saves)
            assert largest == block_input, (largest, block_input)


def test_compiled_moe_block_traces_no_autograd_function():
    """A MoE block checkpointed in full and compiled as one graph holds no
    ``torch.autograd.Function``: its row maps and (on CUDA) its attention are operators with
    their own backward. Inside such a graph, on CUDA, what an autograd.Function took as input
    was kept for the backward instead of recomputed (the sorted copies, 1 GiB a layer at 16K
    under EP2; forty-third session, ``test_gpu_fast_paths``' saved-tensors test), so dynamo's
    ``autograd_function_apply`` must not appear in the block's graph."""
    from tests.distributed.common import qwen3_moe_foundation
    from torchtitan_omni.distributed.activation_checkpoint import checkpoint_units

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    block = qwen3_moe_foundation(64, 1, experts=8, top_k=2, device="cpu").layers["0"]
    checkpoint_units([block], "full")
    torch._dynamo.reset()
    compile_units([block], keep)
    x = torch.randn(1, 50, 64, requires_grad=True)
    pos = torch.cat([torch.arange(30), torch.arange(20)]).unsqueeze(0)
    out, _ = block(x, AttentionMeta(torch.tensor([0, 30, 50], dtype=torch.int32), 30, pos))
    out.sum().backward()
    targets = {str(node.target) for gm in graphs for module in gm.modules()
               if isinstance(module, torch.fx.GraphModule)
               for node in module.graph.nodes if node.op == "call_function"}
    # the check's own control: the graph was captured, its checkpoint and row maps inside
    assert {"tag_activation_checkpoint", "torchtitan_omni.gather_copies.default",
            "torchtitan_omni.combine_copies.default"} <= targets, sorted(targets)
    assert "autograd_function_apply" not in targets


def test_encoder_attention_option_keeps_only_the_attention_in_encoder_blocks():
    """``omni.encoder_activation_checkpoint = "attention"`` checkpoints every encoder block
    with the per-op policy that keeps the attention's outputs, beside an LLM on "op"."""
    from torchtitan_omni.distributed.activation_checkpoint import PER_OP_OPTIONS

    spec = get_train_spec("llama_omni")
    with torch.device("meta"):
        model = spec.model_cls(spec.model_args["debugmodel"])
    job = _job("llama_omni", "--omni.encoder_activation_checkpoint", "attention")
    done = apply_activation_checkpointing(model, model.parallel_plan, job)
    assert done.keys() > {"llm"} and len(done) >= 3, done  # the LLM and its encoders
    for part in model.parallel_plan.parts:
        if part.root not in done:  # a part without blocks to checkpoint
            continue
        option = "op" if part.root == "llm" else "attention"
        units = [m for _, m in matching_modules(model, part.root, part.ac_units)]
        assert len(units) == done[part.root] and all(
            u._omni_checkpoint_options["context_fn"] is PER_OP_OPTIONS[option] for u in units
        ), part.root
