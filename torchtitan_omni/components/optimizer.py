"""Adam and AdamW that step on each parameter's local shard, and the ``build_optimizers_fn``
that makes them.

Why: FSDP2 parameters, their gradients and the moments are DTensors. torch's fused (or
foreach) Adam step over them goes through DTensor's dispatch, which unwraps and checks every
tensor of every list on the host: on LLaMA#Omni 8B (226 tensors a rank) that took 44 ms of
host time for a 38 ms kernel, so the GPU idled at the end of each step. The update is
elementwise, so each rank can run the same kernel on its local shards directly; the result
is the same, tensor for tensor.

The optimizer state is what torch's ``Adam``/``AdamW`` keep (``step``, ``exp_avg``,
``exp_avg_sq``, as DTensors like the parameters), so checkpoints are interchangeable with
TorchTitan's optimizers and reshard as before.

Gradient clipping (:func:`clip_gradients_`) hands its coefficient to these optimizers' next
step instead of scaling the gradients in a pass of its own: the fused kernel divides each
gradient by the inverse as it reads it (torch's ``grad_scale``, there for AMP) and writes the
clipped gradient back, one read and write of every gradient fewer a step (2.66B parameters on
one GPU: a tenth of the optimizer's 30 ms).

With ``compile.components`` holding ``"optimizer"`` (:func:`compile_optimizer_updates`), the
fused implementation's large tensors are updated by one compiled kernel each
(``components.adam_update``: 1.4x torch's fused kernel's bandwidth on one H200) and the rest by
torch's fused kernel. The compiled kernel multiplies the coefficient in as it reads each
gradient and leaves the gradient as it was: a gradient the step has read is not to be read
again (the trainer clears them before the next backward). With ``optimizer.moments_dtype``
(:func:`keep_moments_in`) that kernel keeps its tensors' moments in bf16, rounded
stochastically.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam
from torchtitan.components.optimizer import OptimizersContainer, build_optimizers

from torchtitan_omni.components.adam_update import (
    COMPILED_MIN_NUMEL,
    LOW_PRECISION_MOMENTS,
    LOW_PRECISION_WEIGHTS,
    compiled_adam_update,
    compiles,
)
from torchtitan_omni.distributed.utils import (
    clip_grad_norm_,
    grad_norm_and_clip_coef,
    scale_grads_,
)


def _local(t: torch.Tensor) -> torch.Tensor:
    # under no_grad, to_local() hands back the shard itself (no autograd node)
    return t.to_local() if isinstance(t, DTensor) else t


def _step_dtype(fused: bool) -> torch.dtype:
    # torch's rule for the ``step`` counter, so the state matches torch's optimizers
    if fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class _LocalShardStep:
    """The step of torch's ``Adam`` (and ``AdamW``), run on the parameters', gradients' and
    moments' local tensors."""

    # what torch.optim.Optimizer provides (the classes below mix this into Adam and AdamW)
    param_groups: list[dict[str, Any]]
    state: defaultdict[torch.Tensor, Any]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)  # torch's Adam or AdamW, next in the MRO
        for group in self.param_groups:
            for key in ("capturable", "differentiable"):
                if group[key]:
                    raise ValueError(f"{type(self).__name__} does not support {key}=True")
        self._grad_coef: torch.Tensor | None = None
        #: tensors of at least this many elements are updated by the compiled kernel (None: off)
        self._compiled_min_numel: int | None = None
        self._compile_backend = "inductor"
        #: elements the compiled kernel updated in the last step
        self.compiled_numel = 0
        #: parameter -> the compute-dtype copy of its local tensor each step rewrites
        self._compute_copies: dict[torch.Tensor, torch.Tensor] = {}
        #: the dtype of the compiled kernel's tensors' moments when not their parameter's
        self._moments_dtype: torch.dtype | None = None

    def compile_updates(self, min_numel: int = COMPILED_MIN_NUMEL, backend: str = "inductor"
                        ) -> None:
        """Update tensors of at least ``min_numel`` elements with one compiled kernel each
        (``components.adam_update``); the fused implementation only (its state and its
        results, to float rounding)."""
        for group in self.param_groups:
            if not group["fused"] or group["amsgrad"]:
                raise ValueError(f"{type(self).__name__}: compiled updates need the fused "
                                 "implementation without amsgrad")
        self._compiled_min_numel, self._compile_backend = min_numel, backend

    def keep_moments_in(self, dtype: torch.dtype) -> None:
        """Keep the moments of the float32 parameters the compiled update takes (those of at
        least its ``min_numel`` elements, counted over the whole parameter so that every rank
        keeps a parameter's moments alike) in ``dtype`` (bfloat16), rounded stochastically
        (``components.adam_update``); needs :meth:`compile_updates`. Moments created or
        loaded in another dtype are cast to it."""
        if self._compiled_min_numel is None:
            raise ValueError(f"{type(self).__name__}: moments in {dtype} need the compiled "
                             "update (compile_updates)")
        if dtype not in LOW_PRECISION_MOMENTS:
            raise ValueError(f"{type(self).__name__}: moments in {dtype}: only "
                             f"{LOW_PRECISION_MOMENTS} besides the parameters' dtype")
        self._moments_dtype = dtype
        self._cast_moments()

    def _moments_dtype_of(self, p: torch.Tensor) -> torch.dtype:
        # a global decision (p.numel() of a DTensor counts every shard): a parameter's
        # moments are one dtype on every rank, as a checkpoint holds them
        if self._compiled_min_numel is not None and p.dtype in LOW_PRECISION_WEIGHTS:
            # the compiled kernel updates these weights in float32 (any size)
            return self._moments_dtype or torch.float32
        if (self._moments_dtype is not None and p.dtype == torch.float32
                and self._compiled_min_numel is not None
                and p.numel() >= self._compiled_min_numel):
            return self._moments_dtype
        return p.dtype

    def _cast_moments(self) -> None:
        # torch's load_state_dict casts moments to their parameter's dtype
        for p, state in self.state.items():
            dtype = self._moments_dtype_of(p)
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != dtype:
                    state[key] = state[key].to(dtype)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, the moments then cast to the dtype they are kept in
        (:meth:`keep_moments_in`; float32 for the compiled kernel's bf16 weights). torch casts
        every floating state tensor to its parameter's dtype, which would round float32
        moments of a bf16 weight: those are taken from ``state_dict`` as saved."""
        saved = {}
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"]):
            for p, index in zip(group["params"], saved_group["params"]):
                if p.dtype in LOW_PRECISION_WEIGHTS and index in state_dict["state"]:
                    saved[p] = state_dict["state"][index]
        super().load_state_dict(state_dict)  # type: ignore[misc]  # torch's Optimizer
        for p, state in saved.items():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    self.state[p][key] = state[key].to(device=p.device)
        self._cast_moments()

    def keep_compute_copies(self, copies: Mapping[torch.Tensor, torch.Tensor]) -> None:
        """After each update of a parameter of ``copies`` (parameter -> a copy of its local
        tensor in a lower precision), set the copy to the new value's cast
        (``components.compute_copies``): in the compiled kernel's pass where the update is
        compiled, in one copy after the step otherwise. A copy that requires a gradient holds
        its parameter's (local, in the copy's dtype): the step reads it there, and
        :meth:`zero_grad` clears it."""
        mine = {p for group in self.param_groups for p in group["params"]}
        self._compute_copies = {p: c for p, c in copies.items() if p in mine}

    def compute_gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        """Parameter -> its gradient's local tensor, for the parameters whose gradient their
        compute copy holds (:meth:`keep_compute_copies`) and has now."""
        return {p: c.grad for p, c in self._compute_copies.items() if c.grad is not None}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; the compute copies' gradients are set to None either way
        (each holds one backward's gradient: ``components.compute_copies``)."""
        super().zero_grad(set_to_none)  # type: ignore[misc]  # torch's Optimizer, next in the MRO
        for copy in self._compute_copies.values():
            copy.grad = None

    def _local_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        # the gradient's local tensor: the parameter's, or the one its compute copy holds
        copy = self._compute_copies.get(p)
        held = None if copy is None else copy.grad
        if held is None:
            return None if p.grad is None else _local(p.grad)
        if p.grad is not None:
            raise RuntimeError(f"{type(self).__name__}: a parameter has a gradient both in its "
                               "own dtype and in its compute copy's")
        return held

    def scale_grads_in_next_step(self, coef: torch.Tensor) -> None:
        """Multiply the gradients by the device scalar ``coef`` (a clipping coefficient) in
        the next :meth:`step`. torch's kernels leave them so scaled, as clipping first would;
        the compiled update only reads them."""
        self._grad_coef = coef

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        coef, self._grad_coef = self._grad_coef, None
        self.compiled_numel = 0
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            copies: list[torch.Tensor | None] = []
            for p in group["params"]:
                grad = self._local_grad(p)
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = (
                        torch.zeros((), dtype=_step_dtype(True), device=p.device)
                        if group["fused"] else torch.tensor(0.0, dtype=_step_dtype(False))
                    )
                    dtype = self._moments_dtype_of(p)
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype,
                                                        memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype,
                                                           memory_format=torch.preserve_format)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros_like(
                            p, memory_format=torch.preserve_format)
                params.append(_local(p))
                grads.append(grad)
                exp_avgs.append(_local(state["exp_avg"]))
                exp_avg_sqs.append(_local(state["exp_avg_sq"]))
                if group["amsgrad"]:
                    max_exp_avg_sqs.append(_local(state["max_exp_avg_sq"]))
                steps.append(state["step"])
                copies.append(self._compute_copies.get(p))
            if self._compiled_min_numel is not None:
                params, grads, exp_avgs, exp_avg_sqs, steps, copies = self._update_compiled(
                    group, coef, params, grads, exp_avgs, exp_avg_sqs, steps, copies)
            if not params:
                continue
            # torch's kernels want a parameter's dtype: a compute-dtype gradient is widened
            grads = [g if g.dtype == p.dtype else g.to(p.dtype) for p, g in zip(params, grads)]
            grad_scale = None
            if coef is not None and group["fused"]:
                # the fused kernel divides by grad_scale (float32) and stores the result
                grad_scale = coef.reciprocal().float()
            elif coef is not None:  # torch's other Adam steps take no grad_scale
                scale_grads_(grads, coef)
            beta1, beta2 = group["betas"]
            adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                 foreach=group["foreach"], capturable=False, differentiable=False,
                 fused=group["fused"], grad_scale=grad_scale, found_inf=None,
                 has_complex=any(torch.is_complex(p) for p in params),
                 decoupled_weight_decay=group["decoupled_weight_decay"],
                 amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
                 weight_decay=group["weight_decay"], eps=group["eps"],
                 maximize=group["maximize"])
            for param, copy in zip(params, copies):
                if copy is not None:
                    copy.copy_(param)
        return loss

    def _update_compiled(self, group, coef, params, grads, exp_avgs, exp_avg_sqs, steps,
                         copies):
        """Update the group's large tensors with the compiled kernel; hand back the lists of
        the rest."""
        lists = (params, grads, exp_avgs, exp_avg_sqs, steps, copies)
        chosen = [compiles(p, g, m, v, self._compiled_min_numel, c)
                  for p, g, m, v, c in zip(params, grads, exp_avgs, exp_avg_sqs, copies)]
        for p, g, m, took in zip(params, grads, exp_avgs, chosen):
            # torch's kernels keep a parameter's dtype and round a bf16 one to nearest
            if (m.dtype != p.dtype or p.dtype in LOW_PRECISION_WEIGHTS) and not took:
                raise RuntimeError(
                    f"{type(self).__name__}: a {p.dtype} parameter's moments are in {m.dtype} "
                    f"but its update does not fit the compiled kernel (shape "
                    f"{tuple(p.shape)}, gradient {g.dtype}, contiguous "
                    f"{p.is_contiguous()}/{g.is_contiguous()})")
        if not any(chosen):
            return lists
        big = [[t for t, c in zip(lst, chosen) if c] for lst in lists]
        torch._foreach_add_(big[4], 1)  # the step counts, as the fused kernel counts them
        update = compiled_adam_update(self._compile_backend)
        update.prefer_sizes(p.numel() for p in big[0])
        beta1, beta2 = group["betas"]
        self.compiled_numel += sum(p.numel() for p in big[0])
        update.update_all(*big[:5], coef, big[5], lr=group["lr"], beta1=beta1, beta2=beta2,
                          eps=group["eps"], weight_decay=group["weight_decay"],
                          decoupled_weight_decay=group["decoupled_weight_decay"],
                          maximize=group["maximize"])
        return tuple([t for t, c in zip(lst, chosen) if not c] for lst in lists)


class LocalShardAdam(_LocalShardStep, torch.optim.Adam):
    """torch's ``Adam`` (same arguments and state), stepping on local shards."""


class LocalShardAdamW(_LocalShardStep, torch.optim.AdamW):
    """torch's ``AdamW`` (same arguments and state), stepping on local shards."""


LOCAL_SHARD_OPTIMIZERS = {"Adam": LocalShardAdam, "AdamW": LocalShardAdamW}


def build_omni_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager=None
                          ) -> OptimizersContainer:
    """TorchTitan's ``build_optimizers`` with :class:`LocalShardAdam` / :class:`LocalShardAdamW`
    in place of torch's classes. The configurations it does not cover (optimizer steps in the
    backward, TorchFT; both refused at start-up by the omni trainer) go to TorchTitan's."""
    if optimizer_config.early_step_in_backward or (ft_manager is not None and ft_manager.enabled):
        return build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    if optimizer_config.name not in LOCAL_SHARD_OPTIMIZERS:
        raise NotImplementedError(f"Optimizer {optimizer_config.name} not added.")
    implementation = optimizer_config.implementation
    kwargs = {
        "lr": optimizer_config.lr,
        "betas": (optimizer_config.beta1, optimizer_config.beta2),
        "eps": optimizer_config.eps,
        "weight_decay": optimizer_config.weight_decay,
        "fused": implementation == "fused",
        "foreach": implementation == "foreach",
    }
    return OptimizersContainer(model_parts, LOCAL_SHARD_OPTIMIZERS[optimizer_config.name], kwargs)


def _local_shard_steps(optimizers: OptimizersContainer, option: str) -> list[_LocalShardStep]:
    # the container's optimizers, each one of ours: ``option`` needs what only they do
    for optimizer in optimizers:
        if not isinstance(optimizer, _LocalShardStep):
            raise ValueError(f"{option}: {type(optimizer).__name__} is not one of the omni "
                             "trainer's Adam/AdamW")
    return list(optimizers)


def compile_optimizer_updates(optimizers: OptimizersContainer, backend: str = "inductor"
                              ) -> None:
    """``compile.components`` with ``"optimizer"``: every optimizer updates its large tensors
    with the compiled kernel (:meth:`_LocalShardStep.compile_updates`)."""
    for optimizer in _local_shard_steps(optimizers, "compile.components 'optimizer'"):
        optimizer.compile_updates(backend=backend)


def keep_moments_in(optimizers: OptimizersContainer, dtype: torch.dtype) -> None:
    """``optimizer.moments_dtype``: every optimizer keeps the moments of the tensors its
    compiled update takes in ``dtype`` (:meth:`_LocalShardStep.keep_moments_in`)."""
    for optimizer in _local_shard_steps(optimizers, "optimizer.moments_dtype"):
        optimizer.keep_moments_in(dtype)


def keep_compute_copies(optimizers: OptimizersContainer,
                        copies: Mapping[torch.Tensor, torch.Tensor]) -> None:
    """``parallelism.expert_compute_copies``: every optimizer rewrites the compute copies of
    the parameters it updates (:meth:`_LocalShardStep.keep_compute_copies`)."""
    for optimizer in _local_shard_steps(optimizers, "parallelism.expert_compute_copies"):
        optimizer.keep_compute_copies(copies)


@torch.no_grad()
def clip_gradients_(optimizers: OptimizersContainer, parameters, max_norm: float,
                    combine=None) -> torch.Tensor:
    """Clip the global L2 norm of ``parameters``' gradients to ``max_norm`` and return the norm
    before (``distributed.utils.grad_norm_and_clip_coef``; ``combine`` as there). When every
    optimizer of ``optimizers`` steps on local shards, the coefficient goes into their next
    step (see the module docstring), and the gradients their compute copies hold count for
    their parameters; otherwise the gradients are scaled now."""
    if not all(isinstance(o, _LocalShardStep) for o in optimizers):
        return clip_grad_norm_(parameters, max_norm, combine)
    held = {p: g for o in optimizers for p, g in o.compute_gradients().items()}
    total, coef = grad_norm_and_clip_coef(parameters, max_norm, combine, held)
    for optimizer in optimizers:
        optimizer.scale_grads_in_next_step(coef)
    return total
