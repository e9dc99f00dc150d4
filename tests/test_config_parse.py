"""Parsing a config: torchtitan-omni's sections merged into TorchTitan's, a user's extension on
top, and the start-up warning about a missing tokenizer folder only where nothing creates it."""

import logging

import pytest

from tests.harness import REPO
from torchtitan_omni.config.manager import ConfigError, parse_config, parse_job_config
from torchtitan_omni.config.merge import merge_config_classes, omni_config_class

JANUS = str(REPO / "train_configs" / "janus_debug.toml")
SYNTHETIC = str(REPO / "tests" / "configs" / "synthetic.toml")


def _missing_assets_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "does not exist!" in r.getMessage()]


def test_sections_merge_key_by_key():
    cfg = omni_config_class()()
    assert cfg.parallelism.ulysses_degree == 1  # ours
    assert cfg.parallelism.data_parallel_shard_degree == -1  # TorchTitan's, same section
    assert cfg.training.steps == 10000 and cfg.lora.rank > 0


def test_merge_keeps_fields_of_both_and_the_extension_wins():
    from dataclasses import dataclass, field, fields

    @dataclass
    class Inner:
        a: int = 1
        b: int = 2

    @dataclass
    class Base:
        inner: Inner = field(default_factory=Inner)
        x: int = 0

    @dataclass
    class InnerExt:
        b: int = 20
        c: int = 30

    @dataclass
    class Ext:
        inner: InnerExt = field(default_factory=InnerExt)
        y: str = "y"

    merged = merge_config_classes(Base, Ext)()
    assert (merged.inner.a, merged.inner.b, merged.inner.c, merged.x, merged.y) == (
        1, 20, 30, 0, "y")
    assert [f.name for f in fields(Base)] == ["inner", "x"]  # the inputs are left as they were


@pytest.mark.parametrize("form", ["pair", "equals"])
def test_the_last_config_file_named_wins(form):
    # TorchTitan's own parse reads the first one named: it must see only the last
    moe = str(REPO / "train_configs" / "qwen3_moe_omni_debug.toml")
    again = ["--job.config_file", moe] if form == "pair" else [f"--job.config-file={moe}"]
    cfg = parse_config(JANUS, [*again, "--training.steps", "30"])
    assert cfg.model.name == "qwen3_moe_omni" and cfg.training.steps == 30
    assert cfg.job.config_file == moe


def test_a_users_extension_goes_on_top_of_ours():
    cfg = parse_config(JANUS, ["--job.custom_config_module", "tests.fixtures.extra_config",
                               "--extra.level", "5", "--omni.note", "hi"])
    assert cfg.extra.level == 5 and cfg.omni.note == "hi"
    assert cfg.omni.init_seed is not None and cfg.parallelism.ulysses_degree == 1


def test_an_extension_that_cannot_be_imported_is_one_line():
    with pytest.raises(ConfigError, match="job.custom_config_module 'no.such_module'") as e:
        parse_job_config(["--job.config_file", JANUS, "--job.custom_config_module",
                          "no.such_module"])
    assert "\n" not in str(e.value)


def test_a_tokenizer_folder_built_on_first_use_is_not_warned_about(caplog, tmp_path):
    caplog.set_level(logging.WARNING)
    cfg = parse_config(JANUS, ["--model.hf_assets_path", str(tmp_path / "tokenizer")])
    assert cfg.training.dataset == "omni_default" and cfg.data.build_if_missing
    assert _missing_assets_warnings(caplog) == []


def test_a_missing_tokenizer_folder_nothing_creates_is_warned_about_once(caplog):
    caplog.set_level(logging.WARNING)
    parse_config(SYNTHETIC)  # its own dataset, and hf_assets_path ./tests/assets/none
    assert _missing_assets_warnings(caplog) == [
        "HF assets path ./tests/assets/none does not exist!"]
