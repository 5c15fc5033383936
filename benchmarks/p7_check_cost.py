"""P7: what ``--export-check`` costs a suite of transformers' models, first run and reruns.

Three generated suites of tiny models from transformers' configs, called as transformers' model
tests call them, each test building its model (as transformers' tests do), seeded from ``P7_SEED``:

* ``transformers``: a Llama, a GPT-2, a BERT classifier, a ViT, a T5 (20 tests, 6 groups): masks,
  bound constants (``output_hidden_states``, ``output_attentions``, ``return_dict=False``,
  ``use_cache``), labels, caches through ``generate()``;
* ``windowed``: vision models with windowed attention and patched layouts, the Swin shape (a Swin
  classifier and backbone, a DINOv2 with interpolated positions): window partitions and shifts,
  padding to the window, patch merging, at batch and image sizes the tests vary;
* ``small-groups``: many small groups in a short plain run: 12 encoder and decoder architectures,
  two tests each, a fraction of a second per test (the check's fixed cost per group shows).

Each suite runs in child processes ``python -m pytest -q -p no:cacheprovider``:

* plain: ``-p no:exportobs``;
* first: ``--export-check --export-observe transformers.PreTrainedModel`` into a fresh
  ``--export-dir`` (the check's cost on a first CI run);
* rerun: the same command on the same ``--export-dir``, nothing changed (a cached CI run);
* reseeded (the ``transformers`` suite): the same on that ``--export-dir`` with other weights (a
  suite that does not seed its models: the traced graphs are the same, the weights not).

Ratios are of wall time (what a team waits for), each side's median over the rounds, the CPU time
beside it; the sides of a round run in turn after one discarded warm-up of the plain side.  The
verdicts of the first run and of the rerun must be the same, or the benchmark fails.

    python benchmarks/p7_check_cost.py [--quick] [--reps N] [--suites transformers,windowed,small-groups]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _common import PYTHON, Samples, Timing, child_env, emit, log, run_child, verdict  # noqa: E402

SUITE = '''
import os
import pytest
import torch
import transformers

SEED = int(os.environ.get("P7_SEED", "0"))


def built(cls, config):
    torch.manual_seed(SEED)
    return cls(config).eval()


def ids(batch, seq, vocab=99):
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(batch * 100 + seq))


def llama():
    return built(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def gpt2():
    return built(transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2))


def bert():
    return built(transformers.BertForSequenceClassification, transformers.BertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, num_labels=3))


def vit():
    return built(transformers.ViTForImageClassification, transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, image_size=16,
        patch_size=4, num_labels=3))


def t5():
    return built(transformers.T5ForConditionalGeneration, transformers.T5Config(
        vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1))


@pytest.mark.parametrize("batch, seq", [(2, 7), (3, 5)])
def test_llama_forward(batch, seq):
    tokens = ids(batch, seq)
    assert llama()(tokens, attention_mask=torch.ones_like(tokens)).logits.shape == (batch, seq, 99)


@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
def test_llama_outputs(flag):
    tokens = ids(2, 6)
    llama()(tokens, attention_mask=torch.ones_like(tokens), **{flag: True})


def test_llama_as_tuple():
    tokens = ids(2, 6)
    assert isinstance(llama()(tokens, return_dict=False), tuple)


def test_llama_labels():
    tokens = ids(2, 6)
    assert llama()(tokens, labels=tokens).loss.dim() == 0


def test_llama_generate():
    assert llama().generate(ids(2, 5), max_new_tokens=3, do_sample=False).shape[0] == 2


@pytest.mark.parametrize("batch, seq", [(2, 7), (4, 3)])
def test_gpt2_forward(batch, seq):
    tokens = ids(batch, seq)
    gpt2()(tokens, attention_mask=torch.ones_like(tokens))


def test_gpt2_hidden_states():
    gpt2()(ids(2, 6), output_hidden_states=True)


def test_gpt2_generate():
    gpt2().generate(ids(3, 4), max_new_tokens=3, do_sample=False)


@pytest.mark.parametrize("batch, seq", [(2, 7), (3, 9)])
def test_bert_logits(batch, seq):
    tokens = ids(batch, seq)
    assert bert()(tokens, attention_mask=torch.ones_like(tokens)).logits.shape == (batch, 3)


def test_bert_labels():
    tokens = ids(3, 7)
    bert()(tokens, attention_mask=torch.ones_like(tokens), labels=torch.tensor([0, 2, 1]))


def test_bert_attentions():
    bert()(ids(2, 7), output_attentions=True)


@pytest.mark.parametrize("batch", [1, 3])
def test_vit(batch):
    vit()(torch.randn(batch, 3, 16, 16))


def test_vit_hidden_states():
    vit()(torch.randn(2, 3, 16, 16), output_hidden_states=True)


def test_t5_generate():
    t5().generate(ids(2, 6), max_new_tokens=3, do_sample=False)


def test_t5_forward():
    tokens = ids(2, 6)
    t5()(input_ids=tokens, decoder_input_ids=ids(2, 4), attention_mask=torch.ones_like(tokens))
'''

WINDOWED = '''
import os
import pytest
import torch
import transformers

SEED = int(os.environ.get("P7_SEED", "0"))


def built(cls, config):
    torch.manual_seed(SEED)
    return cls(config).eval()


def swin_config(**extra):
    return transformers.SwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[1, 2], num_heads=[2, 4],
                                   window_size=4, mlp_ratio=2.0, num_labels=3, **extra)


def images(batch, side, seed=0):
    return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(seed + batch * 100 + side))


@pytest.mark.parametrize("batch", [2, 3])
def test_swin_classifies(batch):
    model = built(transformers.SwinForImageClassification, swin_config())
    assert model(images(batch, 32)).logits.shape == (batch, 3)


def test_swin_hidden_states():
    model = built(transformers.SwinForImageClassification, swin_config())
    out = model(images(2, 32), output_hidden_states=True)
    assert len(out.hidden_states) == 3


def test_swin_pads_to_the_window():
    model = built(transformers.SwinForImageClassification, swin_config())
    assert model(images(2, 40)).logits.shape == (2, 3)


@pytest.mark.parametrize("side", [32, 48])
def test_swin_backbone_feature_maps(side):
    model = built(transformers.SwinBackbone, swin_config(out_features=["stage1", "stage2"]))
    maps = model(images(2, side)).feature_maps
    assert [tuple(m.shape[-2:]) for m in maps] == [(side // 2, side // 2), (side // 4, side // 4)]


def dinov2():
    return built(transformers.Dinov2Model, transformers.Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, image_size=30,
        patch_size=2))


@pytest.mark.parametrize("batch", [1, 3])
def test_dinov2_embeds(batch):
    assert dinov2()(images(batch, 30)).last_hidden_state.shape == (batch, 226, 32)


def test_dinov2_interpolates_positions():
    assert dinov2()(images(2, 42)).pooler_output.shape == (2, 32)
'''

SMALL_GROUPS = '''
import os
import pytest
import torch
import transformers

SEED = int(os.environ.get("P7_SEED", "0"))
SMALL = dict(vocab_size=99, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
             max_position_embeddings=64)
DECODER = dict(SMALL, num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ARCHITECTURES = {
    "bert": (transformers.BertModel, transformers.BertConfig, SMALL),
    "roberta": (transformers.RobertaModel, transformers.RobertaConfig, dict(SMALL, pad_token_id=1)),
    "electra": (transformers.ElectraModel, transformers.ElectraConfig, dict(SMALL, embedding_size=16)),
    "albert": (transformers.AlbertModel, transformers.AlbertConfig, dict(SMALL, embedding_size=8)),
    "distilbert": (transformers.DistilBertModel, transformers.DistilBertConfig,
                   dict(vocab_size=99, dim=16, n_layers=1, n_heads=2, hidden_dim=24, max_position_embeddings=64)),
    "mpnet": (transformers.MPNetModel, transformers.MPNetConfig, SMALL),
    "llama": (transformers.LlamaModel, transformers.LlamaConfig, DECODER),
    "mistral": (transformers.MistralModel, transformers.MistralConfig, DECODER),
    "qwen2": (transformers.Qwen2Model, transformers.Qwen2Config, DECODER),
    "gemma": (transformers.GemmaModel, transformers.GemmaConfig, dict(DECODER, head_dim=8)),
    "phi": (transformers.PhiModel, transformers.PhiConfig, DECODER),
    "gpt_neox": (transformers.GPTNeoXModel, transformers.GPTNeoXConfig, dict(SMALL, pad_token_id=0)),
}


def built(name):
    cls, config_cls, kwargs = ARCHITECTURES[name]
    torch.manual_seed(SEED)
    return cls(config_cls(**kwargs)).eval()


def ids(batch, seq):
    return torch.randint(3, 99, (batch, seq), generator=torch.Generator().manual_seed(batch * 100 + seq))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_hidden_states(name):
    tokens = ids(2, 7)
    out = built(name)(tokens, attention_mask=torch.ones_like(tokens))
    assert out.last_hidden_state.shape == (2, 7, 16)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_padded_batch(name):
    tokens = ids(3, 5)
    mask = torch.ones_like(tokens)
    mask[0, -2:] = 0
    assert built(name)(tokens, attention_mask=mask).last_hidden_state.shape == (3, 5, 16)
'''

SUITES = {"transformers": SUITE, "windowed": WINDOWED, "small-groups": SMALL_GROUPS}
CHECK = ["--export-check", "--export-observe", "transformers.PreTrainedModel"]
TARGETS = {"first": 3.0, "rerun": 1.3, "reseeded": 1.3}


def verdicts(report: Path) -> dict[str, str]:
    """The verdict of each group in a session's JSON report."""
    return {m["name"]: m["verdict"] for m in json.loads(report.read_text())["models"]}


def measure(name: str, source: str, directory: Path, rounds: int) -> dict[str, Any]:
    """One suite's sides over ``rounds``: plain, first, rerun (and reseeded, for ``transformers``)."""
    suite = directory / name
    suite.mkdir()
    (suite / "test_models.py").write_text(source)
    names = ("plain", "first", "rerun", "reseeded") if name == "transformers" else ("plain", "first", "rerun")
    sides = {side: Samples(side) for side in names}
    summaries: dict[str, str] = {}

    def pytest_run(*options: str, seed: int = 0) -> tuple[Timing, str]:
        """One pytest session of the suite: its timing and summary line (a failed group exits 1)."""
        timing, proc = run_child([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options],
                                 cwd=str(suite), env=child_env(P7_SEED=str(seed)), check=False)
        if proc.returncode not in (0, 1):
            raise RuntimeError(f"pytest {' '.join(options)} exited {proc.returncode}:\n{proc.stdout[-3000:]}")
        return timing, proc.stdout.strip().splitlines()[-1]

    pytest_run("-p", "no:exportobs")  # warm-up: imports and bytecode
    for index in range(rounds):
        export_dir = directory / f"export-{name}-{index}"
        check = [*CHECK, f"--export-dir={export_dir}", f"--export-report={suite / 'report.json'}"]
        runs = {"plain": pytest_run("-p", "no:exportobs"), "first": pytest_run(*check)}
        first = verdicts(suite / "report.json")
        runs["rerun"] = pytest_run(*check)
        if verdicts(suite / "report.json") != first:
            raise RuntimeError(f"{name}: the rerun's verdicts differ from the first run's")
        if "reseeded" in sides:
            runs["reseeded"] = pytest_run(*check, seed=index + 1)
        for side, (timing, summary) in runs.items():
            sides[side].add(timing)
            summaries[side] = summary
        shutil.rmtree(export_dir, ignore_errors=True)
        walls = ", ".join(f"{side} {samples.values[-1].wall:.1f} s" for side, samples in sides.items())
        log(f"{name} round {index + 1}/{rounds}: {walls}")
    plain = sides["plain"].median("wall")
    ratios = {side: sides[side].median("wall") / plain for side in names[1:]}
    lines = [f"P7 {name:12s} {side:8s} / plain: {ratio:5.2f}  ({sides[side].median('wall'):.1f} s / {plain:.1f} s "
             f"wall, CPU {sides[side].median('cpu'):.1f} s / {sides['plain'].median('cpu'):.1f} s)  "
             f"{verdict(ratio, TARGETS[side])}" for side, ratio in ratios.items()]
    lines += [f"    {side}: {summary}" for side, summary in summaries.items()]
    return {"ratios": ratios, "groups": len(first), "sides": {n: s.to_json() for n, s in sides.items()}, "lines": lines}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--reps", type=int, default=None, help="rounds (default 2, 1 with --quick)")
    parser.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated, among {', '.join(SUITES)}")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = parser.parse_args(argv)
    wanted = [name.strip() for name in args.suites.split(",") if name.strip()]
    if unknown := sorted(set(wanted) - SUITES.keys()):
        parser.error(f"unknown suite(s) {unknown}; choose among {', '.join(SUITES)}")
    rounds = args.reps or (1 if args.quick else 2)
    with tempfile.TemporaryDirectory() as tmp:
        measured = {name: measure(name, SUITES[name], Path(tmp), rounds) for name in wanted}
    ratios = {f"{name} {side}": ratio for name, found in measured.items() for side, ratio in found["ratios"].items()}
    emit({"id": "P7", "ratios": ratios, "targets": TARGETS, "suites": measured, "rounds": rounds,
          "lines": [line for found in measured.values() for line in found["lines"]]}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
