"""torchtitan-omni's additions to TorchTitan's ``JobConfig``.

Loaded through ``job.custom_config_module = "torchtitan_omni.config.job_config"`` (every
bundled TOML sets it, and ``torchtitan_omni.train`` sets it when a config does not): TorchTitan
merges these dataclasses into its own, so ``[parallelism]`` gains ``ulysses_degree`` next to
its own keys and the new sections ``[omni]``, ``[data]``, ``[weights]``, ``[lora]`` and
``[generate]`` appear.

Annotations are real types (no ``from __future__ import annotations``) because
``torchtitan_omni.config.validate`` checks TOML values against them.
"""

from dataclasses import dataclass, field
from typing import Literal

from torchtitan_omni.protocols.modality import ALL_MODALITIES


@dataclass
class Parallelism:
    """Sequence and per-module layouts on top of TorchTitan's degrees."""

    ulysses_degree: int = 1
    """Ulysses sequence-parallel degree: each rank holds 1/degree of the packed sequence and
    all-to-all swaps sequence for heads around attention. Parameters are FSDP-sharded over
    dp_shard x ulysses. Must divide the attention heads (after GQA repeat)."""

    ulysses_async: bool = False
    """Overlap the all-to-alls with compute: the heads in groups (``ulysses_async_head_chunks``),
    each group's exchanges running during another group's attention, forward and backward.
    Same numbers as the synchronous variant."""

    ulysses_async_head_chunks: int = 0
    """Async Ulysses only: how many head groups to pipeline. 0 (default): the most of 4 and 2
    that gives every rank whole q and kv heads in each group, else 1. 1: no groups (only the
    q/k/v exchanges behind the next projection, the output gradient behind the output
    projection's weight gradient). A count must divide the heads with ``ulysses_degree``."""

    encoder_fsdp_mesh: Literal["plan", "fsdp", "dp_shard", "none"] = "plan"
    """Mesh of the encoders' and decoders' FSDP sharding: "plan" keeps the model spec's choice,
    "fsdp" shards over dp_shard x ulysses like the LLM, "dp_shard" over data ranks only,
    "none" replicates them."""

    encoder_fsdp_unit: Literal["block", "part"] = "part"
    """How finely the encoders are FSDP-sharded: "part" (default) makes each whole encoder one
    unit: one all-gather per forward and one per backward and one reduce-scatter per step, its
    whole parameters resident while it runs (about 1.3 GB in bf16 for Qwen2-VL's vision
    tower); measured 1.02-1.17x the step of "block" on 4x H100 (toy and realistic media rows,
    dense and MoE LLMs) for 0.6-4.4 GiB more peak memory. "block" makes each block the model
    spec lists (its fsdp_units) a unit of its own, gathered just before it runs and freed
    after: least memory, a collective and FSDP's hooks per block and pass; for encoders too
    large to gather whole. Decoders keep their blocks' units. Where the encoders are not
    FSDP-sharded (one rank) or have no blocks, either value is the same layout. An encoder's
    own table (fsdp_unit = "part") is refused where it cannot act. See docs/parallelism.md."""

    llm_blocks_per_fsdp_unit: int = 1
    """How many consecutive LLM blocks share one FSDP unit (one ``fully_shard`` of the
    blocks' list): one all-gather, one reduce-scatter and one set of FSDP's hooks per group
    and pass instead of per block, for the parameters of that many blocks gathered at once.
    1 (default): each block its own unit, as TorchTitan. Larger groups spend less host time
    per step where the host, not the GPU, sets the step's pace (small blocks, such as MoE
    blocks whose experts skip FSDP); the last group may be shorter. Needs the LLM
    FSDP-sharded (dp_shard x ulysses > 1). See docs/parallelism.md."""

    encoder_sequence_parallel: Literal["replicate", "split", "balance"] = "replicate"
    """Which ranks encode which media items: "replicate" encodes every media item on every SP
    rank (simple, SP x encoder compute); "split" encodes a share of the items on each SP rank
    and all-gathers the embeddings (needs encoders that treat items independently); "balance"
    spreads the items of all data-parallel and SP ranks over them by estimated cost (also
    without Ulysses; two uneven all-to-alls per encoder pass; needs encoders with
    output_rows). See docs/parallelism.md."""

    parts: dict[str, dict[str, str | list[int]]] = field(default_factory=dict)
    """Per-part layouts over the four global layout keys, one TOML table per encoder or
    decoder, keyed by its qualified name: [parallelism.parts."encoders.vision"] with
    fsdp_mesh (as encoder_fsdp_mesh), fsdp_unit (as encoder_fsdp_unit), sequence_parallel
    (as encoder_sequence_parallel; encoders only) and activation_checkpoint (as
    omni.encoder_activation_checkpoint); ranks (a list of global ranks, encoders only) runs
    the encoders on those ranks and the LLM on the others (non-colocated). A key left out
    takes the global key's value. TOML only (not on the command line). See
    docs/parallelism.md."""

    encoder_schedule: Literal["sync", "pipelined"] = "sync"
    """Non-colocated encoders only (parts' ranks): the order of a step's micro-batches on
    the two rank sets. "sync" (default): per micro-batch the encoder ranks encode, then the
    LLM ranks run forward and backward, then the encoder ranks run backward, each set
    waiting for the other. "pipelined": the encoder ranks encode micro-batch i+1 (and run
    the backward of i-1) while the LLM ranks compute micro-batch i; the same numbers, needs
    gradient accumulation (>= 2 micro-batches per step) to overlap anything, and keeps one
    more micro-batch's encoder activations. See docs/parallelism.md."""

    expert_capacity_factor: float = 0.0
    """MoE token dispatch. 0 (default): exact, no token dropped (under expert parallel an
    uneven all-to-all whose split sizes are read on the host, once per layer). > 0: every
    (rank, expert) pair gets ceil(factor x tokens x top_k / experts) slots, tokens being a
    rank's tokens per micro-batch (local_batch_size x seq_len / ulysses_degree, or the token
    budget): fixed-size all-to-all, no host sync, MoE blocks compile as one graph; copies over
    capacity are dropped (their expert output is zero), counted and logged
    (moe/dropped_tokens). See docs/parallelism.md."""

    expert_dispatch: Literal["copies", "tokens", "gather"] = "copies"
    """What the exact expert-parallel dispatcher exchanges. "copies" (default): every routed
    copy of a token goes to its expert's rank (top_k rows per token each way). "tokens": a
    token goes once to each rank holding at least one of its experts, and that rank sends back
    one row, the router-weighted sum of its experts' outputs: fewer rows when a token's experts
    share ranks (top 8 of 128 experts on EP4: about 3.6 rows per token instead of 8). Same
    results up to summation order; on one 4x H100 host not faster (0.87x with full AC).
    "gather": every rank all-gathers the group's tokens, runs its experts over the copies
    routed to them and reduce-scatters the weighted sums: no split sizes, so no host read per
    layer and fixed shapes; (ranks - 1) x tokens rows each way per rank; the sorted copies in
    a worst-case buffer (ranks x tokens x top_k rows, whose elementwise passes grow with the
    EP degree). Compiled on 2x H200 (EP2) 1.19x "copies" compiled on 8K text, 1.13x at 16K; tied
    at EP4; eager slower (0.92x at EP2): use it with torch.compile.
    "tokens" and "gather" need expert parallel and the exact dispatcher
    (expert_capacity_factor 0). See docs/parallelism.md."""

    expert_exchange: Literal["nccl", "nvshmem"] = "nccl"
    """How the exact expert-parallel dispatcher (expert_capacity_factor 0, expert_dispatch
    "copies") moves its rows. "nccl" (default): an uneven all-to-all whose split sizes are
    read on the host, one host sync per MoE layer and pass. "nvshmem": torch's
    symmetric-memory all-to-all-v with the split sizes on the device (CUDA with NVSHMEM): no
    host read in the step, so the host runs ahead of the GPU; received rows live in buffers
    sized for the worst case (EP degree x tokens x top_k rows per rank), and so are the
    experts' activations: keep activation checkpointing on with it (without, autograd keeps
    every MoE layer's worst-case activations). Same results, nothing dropped. See
    docs/parallelism.md."""

    expert_dispatch_chunks: int = 1
    """Capacity-padded expert parallel only (expert_capacity_factor > 0): cut each (rank,
    expert) slot block into this many chunks and overlap each chunk's dispatch all-to-all
    with the experts of the previous chunk, and its combine all-to-all with the experts of the
    next one; the backward overlaps their gradients' exchanges the same way. 1 (default):
    one exchange each way. Same drops, outputs and gradients as 1 (up
    to float summation order); no effect without expert parallel. See docs/parallelism.md."""

    expert_compute_copies: bool = False
    """Keep each local expert weight's bfloat16 (the compute dtype's) copy, rewritten by the
    optimizer step as it updates the weight (in the compiled update's kernel with
    compile.components "optimizer"), and let the experts read it instead of casting their
    float32 weights in every forward and recompute. For MoE experts that cast their own
    weights: under expert parallel over every data rank with every LLM block checkpointed
    (the experts then skip FSDP), or without FSDP (one GPU). Costs 2 bytes of memory per
    local expert parameter; the same numbers, bit for bit. With one micro-batch a step and
    expert_dispatch_chunks 1 the copies also hold the experts' gradients in bfloat16 (no cast
    to float32, half their memory), which the optimizer and clipping read in float32. Refused
    where no expert casts its own weights (FSDP's mixed precision casts them at its
    all-gather). See docs/parallelism.md."""

    expert_ac_keep_exchanges: bool = False
    """Expert parallel with activation checkpointing of the LLM blocks: checkpoint each MoE
    block around its expert all-to-alls (its norms, attention and experts each on their own)
    instead of whole, so that the recompute in the backward exchanges nothing: 4 all-to-alls
    per MoE layer and step instead of 6, and no second host read of the exact dispatcher's
    split sizes. Costs about 2 x tokens x top_k x dim activations per layer (0.5 GiB for
    Qwen3-30B-A3B at 8K in bf16). Off by default (0.98x measured on 4x H100). Refused without
    expert parallel or without activation checkpointing. See docs/parallelism.md."""


@dataclass
class Optimizer:
    """TorchTitan's ``[optimizer]`` plus the dtypes of Adam's moments and of the experts'
    weights."""

    moments_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype of AdamW's first and second moments for the float32 parameters of at least
    4M elements (their update's compiled kernel keeps them; smaller ones stay in float32).
    "bfloat16": 8 bytes a parameter fewer for the update to move (the step's part that does
    not grow with tokens) and 4 fewer to hold; the moments are computed in float32 and stored
    rounded stochastically, so each stored value's expectation is the exact one (rounding to
    nearest would freeze a second moment that changes by less than half of bfloat16's spacing
    a step, as with beta2 0.999). Needs compile.components with "optimizer". A checkpoint's
    moments load in either dtype. Not bit for bit the float32 run. See
    docs/parallelism.md."""

    expert_weights_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype the MoE experts' weights are stored and trained in where they cast their own
    weights to the compute dtype (expert parallel over every data rank with every LLM block
    checkpointed, or no FSDP under a bf16 autocast). "bfloat16": the projections read the
    weights as they are (no cast, no compute copy), their gradients are bf16, and the
    compiled update computes each new weight in float32 and stores it rounded stochastically
    (so its expectation is the exact update; rounding to nearest would drop every update
    smaller than half of bfloat16's spacing). 6 bytes an expert parameter fewer for the update
    to move than float32 weights with compute copies, and 4 fewer to hold (no float32 weight,
    no copy). The moments stay in moments_dtype. Needs compile.components with "optimizer";
    not with parallelism.expert_compute_copies (nothing left to copy). A checkpoint's expert
    weights load in either dtype. Not bit for bit the float32 run. See
    docs/parallelism.md."""


@dataclass
class Model:
    """TorchTitan's ``[model]`` plus where a model's encoders and decoders come from."""

    parts_flavor: str = ""
    """A flavor of the spec whose encoders and decoders the model takes (their args; weights
    still come from weights.sources), e.g. "debugmodel" for tiny parts around a real LLM with
    model.flavor = "hf". Empty: the flavor's own (for "hf": the spec's full-size parts, each
    encoder shaped by its weights.sources folder's config.json where one is given)."""


AUTO_WORKERS = -1


@dataclass
class DataLoader:
    """TorchTitan's ``[training.dataloader]`` with omni defaults: media are decoded and
    patchified in loader workers, off the training step's critical path."""

    num_workers: int = AUTO_WORKERS
    """Loader worker processes per rank; -1 (default): on GPU runs sized from the CPU cores per
    local rank (``torchtitan_omni.data.loader.auto_workers``: up to 4, none with a core or less
    per rank), none on CPU runs (training computes on every core); 0: load in the training
    process."""

    pin_memory: bool = True
    """Page-locked batches, so the copy to the GPU does not block the host (CUDA runs; a
    CPU-only run has no device copy to speed up)."""


@dataclass
class Training:
    """Omni defaults of TorchTitan's ``[training]`` keys."""

    dataloader: DataLoader = field(default_factory=DataLoader)


@dataclass
class Omni:
    """Which parts train, how the losses combine, and per-part activation checkpointing."""

    freeze: list[str] = field(default_factory=list)
    """Dotted module paths to freeze, e.g. ["llm", "encoders.vision"] to train only the
    projectors and the audio encoder. Decoders' VQ tokenizers are always frozen."""

    loss_weights: list[str] = field(default_factory=list)
    """Per-loss weights as "name=weight" (names: text, gen_image); unnamed losses weigh 1."""

    moe_aux_loss_weight: float = 0.001
    """Weight of the MoE load-balancing loss (Qwen3-MoE's router_aux_loss_coef)."""

    encoder_activation_checkpoint: Literal["none", "full", "op", "attention"] = "none"
    """Activation checkpointing of encoder and decoder blocks ([activation_checkpoint] covers
    the LLM): "full" recomputes each block in backward, "op" saves the outputs of its matrix
    products and attention and recomputes the rest (TorchTitan's selective per-op AC),
    "attention" saves only the attention's outputs (as selective_ac_option "attention")."""

    encoder_checkpoint_min_tokens: int = 0
    """Encoder and decoder blocks checkpointed above (or by their parallelism.parts table) run
    a call without the checkpoint when its input has fewer rows (patches, frames, tokens) than
    this: small inputs save little memory, and recomputing them is mostly kernel-launch time
    (0: checkpoint every call). The results are the same either way. Set where no encoder or
    decoder is checkpointed, it has nothing to act on, and start-up warns so."""

    encoder_order: Literal["model", "work"] = "model"
    """The order the encoders run in each micro-batch: "model" (default) the model spec's;
    "work" by increasing FLOPs of their media summed over the ranks (agreed in the step's one
    host all-reduce), the lightest, most launch-bound encoder first and the heaviest last,
    right before the LLM. The results are the same either way. On one H200 (the 8B shape cut
    to 16 LLM layers, realistic rows, compiled) "work" ran at 0.91x by medians, and at 0.92x
    on two (the whole 8B, float8): the default stays "model" (docs/performance.md). Refused
    with non-colocated encoders (their ranks replay the model's order)."""

    activation_offload: bool = False
    """Keep the LLM blocks' saved activations in pinned host memory between forward and
    backward (torchtitan_omni.distributed.activation_offload): longer sequences fit on the GPU,
    steps slow down by the host copies."""

    float8_encoders: bool = False
    """With float8 model.converters: the encoders' linears in float8 too (their blocks and
    projectors; TorchTitan's rule still skips dimensions not divisible by 16; each matmul's
    inner dimension padded to 16, as the media's row counts need; tensorwise scales, weights
    gathered in bf16; a quantize.linear.float8.recipe_name is refused). Off: float8 covers the
    foundation's blocks only. Decoders, the text head and MoE routers stay bf16. On the
    realistic rows on 2x H200 it was slower (0.94x): the default stays off."""

    init_seed: int = 0
    """Seed of the layout-invariant random initialization of weights that are not loaded."""

    llm_layers: int = 0
    """Keep only the foundation's first N blocks (0: the flavor's count). For memory and speed
    probes at a real layer shape on fewer GPUs (e.g. Qwen3-30B-A3B cut to 12 layers on 4).
    Weights of a full model do not load into a cut one (their extra blocks are reported)."""


@dataclass
class Data:
    """The omni data pipeline (see docs/data.md)."""

    format: Literal["auto", "jsonl", "parquet"] = "auto"
    """Sample file format; "auto" picks by file extension."""

    split: str = "train"
    """Split (file stem or sub-folder) read under training.dataset_path."""

    streaming: bool = False
    """Stream the corpus (files read in order, row by row) instead of indexing every file."""

    modalities: list[str] = field(default_factory=lambda: [ALL_MODALITIES])
    """Modalities to keep: "all" is every modality the model's encoders and decoders declare
    (a registered extra one included); a list keeps only those it names (empty: text only).
    Samples that need a modality not kept are skipped (and counted)."""

    mask_prompt_labels: bool = True
    """No loss on user/system turns (only on assistant turns and plain text)."""

    packing: bool = True
    """Pack documents into training.seq_len rows (attention never crosses documents)."""

    token_budget: int = 0
    """Dynamic batching: tokens per micro-batch (0 = training.local_batch_size rows of
    training.seq_len)."""

    pad_to_fixed_length: bool = False
    """Always pad rows to training.seq_len (static shapes, e.g. for torch.compile)."""

    bad_sample_policy: Literal["skip", "error"] = "skip"
    """A bad sample (a line that is not JSON, a row of no known shape or with nothing to
    train on, a missing or corrupt media file, an unknown placeholder, an over-long sample;
    docs/data.md lists the reasons) is skipped, logged once and counted ("skip"), or stops
    training ("error")."""

    gen_cfg_drop_prob: float = 0.1
    """Probability of dropping the caption of an image-generation sample (trains the
    unconditional branch used by classifier-free guidance)."""

    build_if_missing: bool = True
    """Build the bundled default dataset on first use when training.dataset is omni_default."""

    shuffle_seed: int = 0
    """Seed of the per-epoch order: a permutation of the rows (map-style) or of the files
    (streaming)."""

    shuffle: bool = True
    """Visit rows in a seeded random order each epoch (False: file order)."""

    buffer_docs: int = 64
    """Documents kept ahead for packing and dynamic batching (more: fuller rows)."""

    pad_multiple: int = 8
    """Rows are padded to a multiple of lcm(pad_multiple, parallelism.ulysses_degree), capped
    at training.seq_len (itself a multiple of the Ulysses degree); long rows to that times a
    power of two within 1/32 of their length, so few lengths occur (data/packing.py)."""

    split_long_text: bool = True
    """Plain-text rows longer than training.seq_len are cut into seq_len documents instead of
    being skipped as over-long (conversations and media samples are always skipped)."""


@dataclass
class Weights:
    """Per-part initial weights, loaded into the sharded model before training starts."""

    sources: list[str] = field(default_factory=list)
    """Entries "part=path": a Hugging Face safetensors folder or a DCP checkpoint folder for a
    part ("llm", "encoders.vision", "encoders.audio", "decoders.gen_image", ...). Parts without
    an entry keep their random initialization. Ignored when resuming from checkpoint.folder."""


#: the LLM's attention and feed-forward projections: the dense MLP's, or the MoE experts
#: (the router stays frozen)
DEFAULT_LORA_TARGETS = ("llm.layers.*.attention.*",
                        "llm.layers.*.feed_forward.*|llm.layers.*.moe.experts")


@dataclass
class Lora:
    """LoRA fine-tuning (docs/lora.md): low-rank adapters on chosen projections; every other
    weight is frozen (no gradient, no reduction, no optimizer state)."""

    enable: bool = False
    """Add adapters to the modules of ``target_modules`` and train only them (and
    ``train_modules``)."""

    rank: int = 8
    """Rank r of every adapter (>= 1)."""

    alpha: float = 16.0
    """Scale numerator: an adapter adds (alpha / rank) B A x (> 0)."""

    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1)."""

    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    """Modules that get adapters: nn.Linear modules and grouped MoE experts (per-expert
    adapters). Each entry is an fnmatch pattern over module names, matched per dotted segment
    ("*" never crosses a dot), or several separated by "|"; an entry must match at least one
    such module. E.g. ["llm.layers.*.attention.wq", "llm.layers.*.moe.experts",
    "encoders.vision.blocks.*.attn.qkv"]. Default: the LLM's attention and feed-forward
    projections."""

    train_modules: list[str] = field(default_factory=list)
    """Modules trained in full next to the adapters (same patterns), e.g. projectors new to
    the model: ["encoders.vision.merger", "encoders.audio.projector"]."""

    save_adapter_only: bool = False
    """Checkpoints hold only what trains (adapters, train_modules) and its optimizer state;
    the frozen base comes from weights.sources (or the seeded init) again on resume."""


@dataclass
class Generate:
    """``python -m torchtitan_omni.generate``: sampling from a trained checkpoint."""

    checkpoint: str = ""
    """A DCP checkpoint folder (step-N) or a checkpoint root (its newest complete step).
    Empty: <job.dump_folder>/<checkpoint.folder>."""

    mode: Literal["text", "image"] = "text"
    """"text": answer ``prompt`` (with media); "image": draw ``prompt`` as a caption."""

    prompt: str = ""
    """The user turn. Media placeholders (<image>, <video>, <audio>) take the files of
    ``media`` in order."""

    media: list[str] = field(default_factory=list)
    """Files for the prompt's placeholders, in placeholder order."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    """Sampling temperature; 0 decodes greedily."""

    top_k: int = 0
    """Sample among the k most likely tokens (0: all)."""

    cfg_scale: float = 5.0
    """Classifier-free guidance scale of image generation (1: no guidance)."""

    num_images: int = 1
    output: str = "generated"
    """Folder the images (PNG) and the text answer (answer.txt) are written to."""

    seed: int = 0


@dataclass
class Validation:
    """TorchTitan's ``[validation]`` with the held-out split to read (``docs/convergence.md``).

    ``dataset`` left at TorchTitan's default ("c4_validation") or equal to
    ``training.dataset`` means the training dataset (``validation.dataset_path``, if set,
    replaces its path); "omni_default" is the bundled dataset; a single file is read whole."""

    split: str = "val"
    """Split of the validation dataset folder (its files are found as for ``data.split``)."""


@dataclass
class JobConfig:
    """The sections torchtitan-omni adds or extends."""

    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    parallelism: Parallelism = field(default_factory=Parallelism)
    training: Training = field(default_factory=Training)
    omni: Omni = field(default_factory=Omni)
    data: Data = field(default_factory=Data)
    weights: Weights = field(default_factory=Weights)
    lora: Lora = field(default_factory=Lora)
    generate: Generate = field(default_factory=Generate)
    validation: Validation = field(default_factory=Validation)
