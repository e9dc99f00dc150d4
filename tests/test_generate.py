"""Generation end to end from a saved checkpoint (janus debug: image understanding + image
generation), with KV-cached decoding checked against a no-cache recomputation (slow: a model is
trained first), and the message when there is no checkpoint."""

import os

import pytest
import torch
from PIL import Image

from tests.harness import REPO, run_train
from torchtitan_omni.modules.attention import KVCache
from torchtitan_omni.protocols import batch as B
from torchtitan_omni.protocols.modules import AttentionMeta

CONFIG = "train_configs/janus_debug.toml"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    dump = tmp_path_factory.mktemp("janus_gen")
    run = run_train(CONFIG, 1, "--training.steps", "3", "--lr_scheduler.warmup_steps", "3",
                    "--checkpoint.enable",
                    "--checkpoint.interval", "3", "--job.dump_folder", str(dump))
    assert run.returncode == 0, run.output[-3000:]
    return dump


@pytest.fixture(scope="module")
def generator(trained):
    """The generator in this (pytest's) process; its process group and the environment it
    sets for it are undone afterwards, so later tests in the process see neither."""
    import torch.distributed as dist

    from torchtitan_omni.config.manager import parse_config
    from torchtitan_omni.distributed.process_group import init_process_group
    from torchtitan_omni.generate import Generator

    environment = dict(os.environ)
    init_process_group()
    cfg = parse_config(str(REPO / CONFIG), ["--job.dump_folder", str(trained)])
    yield Generator.from_config(cfg)
    dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)


def _full_forward_last(gen, h):
    """Last hidden state of a full (no cache) forward over embeddings ``[n, s, dim]``."""
    n, s = h.shape[:2]
    cu = torch.arange(0, (n + 1) * s, s, dtype=torch.int32)
    pos = torch.arange(s).expand(n, s)
    return gen.model.llm(h, AttentionMeta(cu, s, pos))[:, -1]


def _image_path():
    folder = REPO / "data" / "omni_default"
    for root, _, files in os.walk(folder):
        for f in sorted(files):
            if f.endswith(".png"):
                return os.path.join(root, f)
    raise AssertionError("the bundled dataset has no png image")


@torch.no_grad()
@pytest.mark.slow  # trains a model first
def test_text_generation_matches_no_cache_reference(generator):
    gen = generator
    prompt, media = "What is in this picture? <image>", [_image_path()]
    ids = gen.text(prompt, media, max_new_tokens=6, temperature=0)
    # Reference: greedy decoding that recomputes the whole sequence at every step; the cached
    # hidden states must match it at every step (not only the argmax).
    batch = gen.prompt_batch(prompt, media)
    h, _ = gen.model.embed(batch[B.INPUT], batch)
    cache = KVCache()
    cached = gen._forward(h, cache)[:, -1]
    ref = []
    stops = {gen.tok.special.end_of_turn, gen.tok.special.eos}
    for _ in range(6):
        last = _full_forward_last(gen, h)
        torch.testing.assert_close(cached, last, rtol=1e-4, atol=1e-5)
        nxt = int(gen.model.llm.output(last).argmax(-1))
        if nxt in stops:
            break
        ref.append(nxt)
        step = gen.model.llm.tok_embeddings(torch.tensor([[nxt]]))
        h = torch.cat([h, step], dim=1)
        cached = gen._forward(step, cache)[:, -1]
    assert ids == ref


@torch.no_grad()
@pytest.mark.slow  # trains a model first
def test_image_generation_with_cfg_matches_no_cache_reference(generator):
    gen = generator
    decoder = gen.model.decoders[B.GEN_IMAGE]
    scale, steps = 3.0, 5
    caption = "a handwritten digit seven"
    codes = gen.image_codes(caption, num_images=1, cfg_scale=scale, temperature=0)
    assert codes.shape == (1, decoder.processing().num_tokens())
    from torchtitan_omni.data.template import generation_prompt

    rows = [
        generation_prompt(gen.tok, caption),
        generation_prompt(gen.tok, caption, unconditional=True),
    ]
    h = gen.model.llm.tok_embeddings(torch.tensor(rows))
    cache = KVCache()
    cached = gen._forward(h, cache)[:, -1]
    for j in range(steps):
        last = _full_forward_last(gen, h)
        torch.testing.assert_close(cached, last, rtol=1e-4, atol=1e-5)
        logits = decoder.logits(last).float()
        nxt = (logits[1] + scale * (logits[0] - logits[1])).argmax()
        assert int(nxt) == int(codes[0, j])
        step = decoder.lm_embed(nxt.repeat(2))[:, None]
        h = torch.cat([h, step], dim=1)
        cached = gen._forward(step, cache)[:, -1]


@pytest.mark.slow  # trains a model first
def test_cli_writes_png_and_text(trained, tmp_path):
    from torchtitan_omni.generate import main

    out = tmp_path / "out"
    main(["--job.config_file", str(REPO / CONFIG), "--job.dump_folder", str(trained),
          "--generate.mode", "image", "--generate.prompt", "a handwritten digit three",
          "--generate.num_images", "2", "--generate.output", str(out)])
    pngs = sorted(out.glob("image_*.png"))
    assert len(pngs) == 2
    size = Image.open(pngs[0]).size
    assert size[0] == size[1] > 0
    main(["--job.config_file", str(REPO / CONFIG), "--job.dump_folder", str(trained),
          "--generate.prompt", "Describe <image>", "--generate.media", _image_path(),
          "--generate.max_new_tokens", "5", "--generate.output", str(out)])
    assert (out / "answer.txt").exists()


def test_without_a_checkpoint_the_error_says_where_it_looked_and_how_to_get_one(tmp_path):
    from torchtitan_omni.config.manager import ConfigError, parse_config
    from torchtitan_omni.generate import Generator, checkpoint_to_load

    cfg = parse_config(str(REPO / CONFIG), ["--job.dump_folder", str(tmp_path)])
    with pytest.raises(ConfigError) as e:
        Generator.from_config(cfg)  # before anything is built
    line = str(e.value)
    assert "\n" not in line and str(tmp_path / cfg.checkpoint.folder) in line
    assert "[checkpoint] enable = true" in line and "checkpoint.enable = false" in line
    assert "--generate.checkpoint" in line
    with pytest.raises(ConfigError, match=str(tmp_path / "elsewhere")):
        checkpoint_to_load(cfg, str(tmp_path / "elsewhere"))
    (tmp_path / cfg.checkpoint.folder / "saving-3.tmp").mkdir(parents=True)
    # an interrupted save is a checkpoint folder: loading says what is wrong with it
    assert checkpoint_to_load(cfg) == str(tmp_path / cfg.checkpoint.folder)
