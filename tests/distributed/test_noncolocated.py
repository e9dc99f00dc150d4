"""Non-colocated encoders (``torchtitan_omni.distributed.noncolocated``) on gloo, float32.

The llama_omni debug model (vision over images and videos in one merged pass, audio, an image
decoder) on 3 ranks: rank 0 runs the vision and audio encoders only, ranks 1-2 run the LLM as
data parallel, rank 2 with a batch without media. The summed losses and every gradient
(encoders' on rank 0, the LLM's and decoder's on ranks 1-2) equal the single-process
reference over both batches within 1e-5; with frozen encoders no all-to-all runs in backward
and the LLM's gradients still match. The qwen3_moe_omni debug model (an MoE foundation) on 3
ranks likewise. The tiny test model on 4 ranks puts the encoders on two non-adjacent ranks (0
and 2), so that items of several sizes are spread over them and put back in order; it also
freezes the audio encoder alone (one exchange with gradient, one without), and runs two
micro-batches per LLM rank in the pipelined schedule (``encoder_schedule``) against the
reference over all four batches, the encoder ranks encoding micro-batch 2 before micro-batch
1's gradients arrive.
"""

from __future__ import annotations

from unittest import mock

import torch

from tests.harness import run_distributed

RTOL = 1e-5


def _without_media(model, batch):
    """``batch`` without any encoder's media (the placeholders become plain text tokens)."""
    from torchtitan_omni.protocols import batch as B

    prefixes = tuple(f"{m}_" for m in model.encoder_of)
    out = {k: v for k, v in batch.items() if not k.startswith(prefixes)}
    assert all(B.embed_index_key(m) not in out for m in model.encoder_of)
    return out


def _batches(spec, n):
    """``n`` LLM ranks' batches; the last without media."""
    from tests.distributed import common as C

    if spec.zoo:
        from tests.models.batches import mixed_batch
        from torchtitan.protocols.train_spec import get_train_spec

        import torchtitan_omni.models  # noqa: F401  (registers the specs)

        vocab = get_train_spec(spec.zoo).model_args["debugmodel"].llm_args.vocab_size
        ref = C.reference_model(spec)  # mixed_batch asks the encoders for their rows
        out = [mixed_batch(ref, vocab, seed=20 + i) for i in range(n)]
    else:
        ref = C.reference_model(spec)
        out = [C.make_batch(40 + i, rows=3, seq=24) for i in range(n)]
    batch, labels = out[-1]
    out[-1] = (_without_media(ref, batch), labels)
    return out


class _Count:
    """Counts ``all_to_all_single`` calls (the exchanges' collectives) while active."""

    def __init__(self):
        import torch.distributed as dist

        self.calls, self._real = 0, dist.all_to_all_single

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._real(*args, **kwargs)


def _llm_step(model, client, batch, labels, group):
    """One data-parallel step of an LLM rank: the exchange, forward, backward; the gradients
    and losses summed over the LLM ranks. Returns the losses and the backward's all-to-alls."""
    import torch.distributed as dist

    from tests.distributed import common as C
    from torchtitan_omni.components.loss import OmniLoss
    from torchtitan_omni.protocols import batch as B

    local = model.count_targets(batch, labels)
    names = list(local)
    glob = torch.stack([local[n] for n in names])
    dist.all_reduce(glob, group=group)
    counts = dict(zip(names, glob))
    client.exchange(batch)
    meta, media = C._meta(batch)
    out = model(batch[B.INPUT], meta, labels, **media)
    loss, parts = OmniLoss({}, aux_weight=0.0)(out.losses, counts, out.aux_losses, group.size())
    count = _Count()
    with mock.patch.object(dist, "all_to_all_single", count):
        loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
    names = [n for n in parts if n in counts]
    summed = torch.stack([parts[n].detach() for n in names])
    dist.all_reduce(summed, group=group)
    return {n: float(v) for n, v in zip(names, summed)}, count.calls


def _setup(world, spec, encoder_ranks, frozen, n):
    """Both rank sets, their groups, ``n`` batches per LLM rank, the model to run and the
    reference's losses and gradients over every batch, the encoders in ``frozen`` frozen."""
    import torch.distributed as dist

    from tests.distributed import common as C
    from torchtitan_omni.distributed.noncolocated import RankSets

    llm_ranks = tuple(r for r in range(world) if r not in encoder_ranks)
    ranks = RankSets(tuple(encoder_ranks), llm_ranks, dist.group.WORLD)
    groups = {"llm": dist.new_group(list(llm_ranks)), "enc": dist.new_group(list(encoder_ranks))}
    batches = _batches(spec, n * len(llm_ranks))
    freeze = [f"encoders.{name}" for name in frozen]
    model, ref = C.reference_model(spec), C.reference_model(spec)
    model.freeze(freeze)
    ref.freeze(freeze)
    ref_losses = C.reference_step(ref, batches)
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    return ranks, groups, batches, model, ref_losses, ref_grads


def _encoder_grads(model, group):
    """The encoders' gradients summed over the encoder ranks (data parallel among them)."""
    import torch.distributed as dist

    for p in model.encoders.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
    return {f"encoders.{n}": p.grad for n, p in model.encoders.named_parameters()}


def _run(rank, world, spec, encoder_ranks, frozen):
    """One step of both rank sets with the encoders named in ``frozen`` frozen."""
    import torch.distributed as dist

    from tests.distributed import common as C
    from torchtitan_omni.distributed.noncolocated import (
        EncoderServer,
        install_remote_encoders,
    )

    ranks, groups, batches, model, ref_losses, ref_grads = _setup(world, spec, encoder_ranks,
                                                                  frozen, 1)
    llm_ranks = ranks.llm
    out = {"frozen": frozen}
    if ranks.on_encoders:
        server = EncoderServer(ranks, model.encoders)
        server.step()
        count = _Count()
        with mock.patch.object(dist, "all_to_all_single", count):
            server.backward()
        grads = _encoder_grads(model, groups["enc"])
        out.update(role="encoders", items=server.last_items, backward_calls=count.calls)
    else:
        client = install_remote_encoders(model, ranks)
        batch, labels = batches[llm_ranks.index(rank)]
        losses, calls = _llm_step(model, client, batch, labels, groups["llm"])
        grads = {n: p.grad for n, p in model.named_parameters()}
        out.update(role="llm", backward_calls=calls,
                   loss_err=max(C.rel_error(losses[k], ref_losses[k]) for k in ref_losses),
                   encoder_params=[n for n in grads if n.startswith("encoders.")],
                   trainable_exchange=client.last_trainable_exchange)
    out["grad_problems"] = C.compare(grads, {n: ref_grads[n] for n in grads}, RTOL)
    out["checked"] = sum(g is not None for g in grads.values())
    # a check that cannot fail is no check: the reference's gradients must be real
    out["ref_grad"] = {n: float(ref_grads[n].abs().sum()) for n in grads
                       if ref_grads[n] is not None}
    return out


ALL = ("vision", "audio")


def _check(results, frozen):
    everything = set(frozen) == set(ALL)
    for rank, res in enumerate(results):
        assert not res["grad_problems"], (rank, res["grad_problems"][:5])
        assert all(v > 0 for v in res["ref_grad"].values()), (rank, res)
        assert res["checked"] or (everything and res["role"] == "encoders"), (rank, res)
        if res["role"] == "llm":
            assert res["loss_err"] < RTOL, (rank, res)
            assert not res["encoder_params"], (rank, res["encoder_params"])
        # backward: one all-to-all (the rows' gradients), none with frozen encoders
        assert res["backward_calls"] == (0 if everything else 1), (rank, res)
    if everything:
        assert all(r["checked"] == 0 for r in results if r["role"] == "encoders")


def _pipelined(rank, world, spec, encoder_ranks, frozen, n=2):
    """``n`` micro-batches per LLM rank in the pipelined schedule, the encoders named in
    ``frozen`` frozen, against the reference step over every rank's micro-batches."""
    import torch.distributed as dist

    from tests.distributed import common as C
    from torchtitan_omni.components.loss import OmniLoss
    from torchtitan_omni.distributed.encoder_schedule import (
        run_micro_batches,
        serve_micro_batches,
    )
    from torchtitan_omni.distributed.noncolocated import (
        EncoderServer,
        install_remote_encoders,
    )
    from torchtitan_omni.protocols import batch as B

    ranks, groups, batches, model, ref_losses, ref_grads = _setup(world, spec, encoder_ranks,
                                                                  frozen, n)
    llm_ranks = ranks.llm
    out = {"frozen": frozen}
    if ranks.on_encoders:
        server = EncoderServer(ranks, model.encoders)
        serve_micro_batches(server, n, "pipelined")
        grads = _encoder_grads(model, groups["enc"])
        out.update(role="encoders", events=server.events, items=server.last_items)
    else:
        client = install_remote_encoders(model, ranks)
        s = llm_ranks.index(rank)
        mine = batches[n * s:n * s + n]
        local = {}
        for batch, labels in mine:
            for k, v in model.count_targets(batch, labels).items():
                local[k] = local.get(k, 0) + v
        names = list(local)
        glob = torch.stack([local[k] for k in names])
        dist.all_reduce(glob, group=groups["llm"])
        counts = dict(zip(names, glob))
        loss_fn = OmniLoss({}, aux_weight=0.0)

        def run(i):
            batch, labels = mine[i]
            meta, media = C._meta(batch)
            result = model(batch[B.INPUT], meta, labels, **media)
            loss, parts = loss_fn(result.losses, counts, result.aux_losses, len(llm_ranks))
            loss.backward()
            return {k: v.detach() for k, v in parts.items() if k in counts}

        parts = run_micro_batches(client, n, "pipelined", lambda i: (mine[i][0], ()), run)
        summed = torch.stack([sum(p[k] for p in parts) for k in names])
        dist.all_reduce(summed, group=groups["llm"])
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=groups["llm"])
        grads = {k: p.grad for k, p in model.named_parameters()}
        out.update(role="llm", encoder_params=[k for k in grads if k.startswith("encoders.")],
                   loss_err=max(C.rel_error(float(v), ref_losses[k])
                                for k, v in zip(names, summed)))
    out["grad_problems"] = C.compare(grads, {k: ref_grads[k] for k in grads}, RTOL)
    out["checked"] = sum(g is not None for g in grads.values())
    out["ref_grad"] = {k: float(ref_grads[k].abs().sum()) for k in grads
                       if ref_grads[k] is not None}
    return out


def _cases(rank, world, spec, encoder_ranks, cases, pipelined=()):
    return ([_run(rank, world, spec, encoder_ranks, frozen) for frozen in cases]
            + [_pipelined(rank, world, spec, encoder_ranks, frozen) for frozen in pipelined])


def test_llama_omni_encoders_on_rank_0_match_reference():
    from tests.distributed import common as C

    cases = ((), ALL)
    results = run_distributed(_cases, 3, C.ModelSpec(zoo="llama_omni"), (0,), cases,
                              timeout=600)
    for i, frozen in enumerate(cases):
        per_rank = [r[i] for r in results]
        _check(per_rank, frozen)
        assert per_rank[0]["items"] == 3  # rank 1's image, video and audio clip


def test_qwen3_moe_omni_encoders_on_rank_0_match_reference():
    """The MoE foundation (routing, load-balancing loss) behind the same exchange."""
    from tests.distributed import common as C

    results = run_distributed(_cases, 3, C.ModelSpec(zoo="qwen3_moe_omni"), (0,), ((),),
                              timeout=600)
    per_rank = [r[0] for r in results]
    _check(per_rank, ())
    assert per_rank[0]["items"] == 3  # rank 1's image, video and audio clip


def test_tiny_model_two_encoder_ranks_match_reference():
    from tests.distributed import common as C

    cases = ((), ALL, ("audio",))  # the last: one exchange with, one without gradient
    pipelined = (("audio",),)  # two micro-batches per LLM rank, pipelined
    results = run_distributed(_cases, 4, C.ModelSpec(), (0, 2), cases, pipelined, timeout=600)
    for i, frozen in enumerate(cases):
        per_rank = [r[i] for r in results]
        _check(per_rank, frozen)
        # both encoder ranks got work (balanced by cost)
        assert all(per_rank[r]["items"] > 0 for r in (0, 2)), per_rank
    for rank, res in enumerate(r[len(cases)] for r in results):
        assert not res["grad_problems"], (rank, res["grad_problems"][:5])
        assert res["checked"] and all(v > 0 for v in res["ref_grad"].values()), (rank, res)
        if res["role"] == "llm":
            assert res["loss_err"] < RTOL, (rank, res)
            assert not res["encoder_params"], (rank, res["encoder_params"])
        else:  # micro-batch 2 encoded before micro-batch 1's gradients came
            assert res["events"] == ["encode 0", "encode 1", "gradients 0", "gradients 1"], res


def test_encoder_ranks_encode_under_the_trainers_autocast():
    """An encoder set of one rank has no FSDP mixed-precision policy: the contexts of the LLM
    ranks' forward (TorchTitan's ``maybe_enable_amp`` when FSDP is off, and the train or
    validation context) must wrap its encoding, in training and in validation; without them
    the encoders computed in float32 (4.5x slower)."""
    import contextlib
    from types import SimpleNamespace

    from torchtitan_omni.encoder_ranks import build_encoder_ranks_validator, encode_under

    class Encoders(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, name, media, modality):
            return self.proj(media["x"])

    entered = []

    def context():
        return contextlib.nullcontext(entered.append("context"))

    amp = torch.autocast("cpu", dtype=torch.bfloat16)
    media = {"x": torch.randn(3, 4)}
    out = encode_under(Encoders(), lambda: (context(), amp))("vision", media, "image")
    assert out.dtype == torch.bfloat16 and entered == ["context"]
    validator = build_encoder_ranks_validator(
        SimpleNamespace(), SimpleNamespace(rank_sets=None), validation_context=context,
        maybe_enable_amp=amp, tokenizer=None)
    out = validator.encoder_run(Encoders())("vision", media, "image")
    assert out.dtype == torch.bfloat16 and entered == ["context", "context"]
