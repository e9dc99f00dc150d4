"""Held-out task scoring (``torchtitan_omni.eval.tasks``) on the bundled test split with a
randomly initialized llama_omni debug model (every modality and the image decoder)."""

import pytest
import torch

from tests.harness import REPO
from torchtitan_omni.eval import metrics as M
from torchtitan_omni.eval import tasks as T
from torchtitan_omni.protocols import batch as B

CONFIG = "train_configs/convergence/llama_omni_debug.toml"


@pytest.fixture(scope="module")
def setup():
    from torchtitan_omni.config.manager import parse_config
    from torchtitan_omni.job_model import model_on_meta, train_spec_of
    from torchtitan_omni.data.loader import dataset_root
    from torchtitan_omni.data.processors import build_processors
    from torchtitan_omni.data.tokenizer import build_omni_tokenizer
    from torchtitan_omni.generate import Generator

    cfg = parse_config(str(REPO / CONFIG), [])
    root = dataset_root(cfg)
    spec = train_spec_of(cfg)
    processors = build_processors(dict(spec.model_args[cfg.model.flavor].processing()))
    model = model_on_meta(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    gen = Generator(model, build_omni_tokenizer(cfg), processors, torch.device("cpu"))
    items = T.read_split(root, "test", limit=2)
    return gen, root, items, cfg


def test_read_split_kinds(setup):
    _, _, items, _ = setup
    kinds = {}
    for item in items:
        kinds.setdefault(item.task, set()).add(T.kind_of(item.sample))
    assert kinds == {"test-digits": {"image"}, "test-faces": {"image"}, "test-photos": {"image"},
                     "test-video": {"video"}, "test-speech": {"audio"},
                     "test-generate": {"generation"}, "test-text": {"text"}}
    assert all(len([i for i in items if i.task == t]) == 2 for t in kinds)  # limit per file


def test_rows_with_media_the_model_cannot_read_are_counted_not_scored(setup):
    # a vision-only model (Janus) on the bundled test split: the speech rows are left out and
    # counted; everything else is kept in order
    _, _, items, _ = setup
    kept, skipped = T.split_by_modalities(items, {B.IMAGE, B.GEN_IMAGE})
    assert skipped == {"test-speech": 2, "test-video": 2}
    assert kept == [i for i in items if i.task not in ("test-speech", "test-video")]
    assert T.split_by_modalities(items, set(setup[0].processors)) == (items, {})


def test_prompt_and_reference_cut_before_the_last_answer(setup):
    _, _, items, _ = setup
    speech = next(i for i in items if i.task == "test-speech")
    prompt, reference = T.prompt_and_reference(speech.sample)
    assert [t.role for t in prompt.turns] == ["user"] and reference == speech.sample.turns[-1].text
    text = next(i for i in items if i.task == "test-text")
    assert T.prompt_and_reference(text.sample) is None


def test_answers_are_scored_against_the_references(setup, monkeypatch):
    """The decoder is replaced by one that answers the first row of each file right and the
    second wrong: every accuracy is then 1/2, and the transcription word accuracy is the
    share of reference words kept."""
    gen, root, items, cfg = setup
    answered = []

    def answer(batch, *args, **kwargs):
        item = items[len(answered)]
        while T.kind_of(item.sample) in ("text", "generation"):
            answered.append(None)
            item = items[len(answered)]
        first = sum(1 for a in answered if a is not None and a.task == item.task) == 0
        answered.append(item)
        text = item.sample.turns[-1].text if first else "zzz"  # one word, never right
        return gen.tok.encode_text(text)

    monkeypatch.setattr(gen, "answer", answer)
    report = T.TaskEvaluator(gen, root, cfg.training.seq_len).answers(items)
    for key in ("image_answer_accuracy", "video_answer_accuracy", "audio_answer_accuracy",
                "answer_accuracy/test-digits", "answer_accuracy/test-speech"):
        assert report.metrics[key] == 0.5, (key, report.metrics)
    refs = [a["reference"] for a in report.answers if a["kind"] == "audio"]
    second = len(M.normalize_answer(refs[1]).split())
    words = sum(len(M.normalize_answer(r).split()) for r in refs)
    assert report.metrics["speech_token_accuracy"] == pytest.approx(1 - second / words)
    assert len(report.answers) == 10  # 2 rows of each of the 5 conversation files


def test_code_logits_line_up_with_the_training_loss(setup):
    """Cross-entropy of the evaluator's code logits and codes equals the model's own summed
    image-generation loss on the same document: same positions, same targets."""
    gen, root, items, cfg = setup
    evaluator = T.TaskEvaluator(gen, root, cfg.training.seq_len)
    rows = [i for i in items if T.kind_of(i.sample) == "generation"]
    for item in rows:
        logits, codes = evaluator.code_logits(item.sample)
        assert codes.numel() == gen.model.decoders[B.GEN_IMAGE].processing().num_tokens()
        ce = torch.nn.functional.cross_entropy(logits.float(), codes, reduction="sum")
        (tokens, meta, labels, media, _), = evaluator._batches(item.sample)
        with torch.no_grad():
            loss = gen.model(tokens, meta, labels, **media).losses[B.GEN_IMAGE]
        assert float(ce) == pytest.approx(float(loss), rel=1e-5)
    accuracy = evaluator.code_accuracy(items)
    assert 0.0 <= accuracy <= 1.0


def test_text_perplexity_is_the_exp_of_the_mean_text_loss(setup):
    gen, root, items, cfg = setup
    evaluator = T.TaskEvaluator(gen, root, cfg.training.seq_len)
    texts = [i for i in items if T.kind_of(i.sample) == "text"]
    nll = count = 0
    for item in texts:
        for tokens, meta, labels, media, _ in evaluator._batches(item.sample):
            with torch.no_grad():
                nll += float(gen.model(tokens, meta, labels, **media).losses["text"])
            count += int((labels != B.IGNORE_INDEX).sum())
    assert evaluator.text_perplexity(items) == pytest.approx(M.perplexity(nll, count))
