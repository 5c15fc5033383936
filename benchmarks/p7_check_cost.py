"""P7: what ``--export-check`` costs a transformers-style suite, first run and reruns.

A generated suite of tiny models from transformers' configs (a Llama, a GPT-2, a BERT
classifier, a ViT, a T5), called as transformers' model tests call them: masks, bound constants
(``output_hidden_states``, ``output_attentions``, ``return_dict=False``, ``use_cache``), labels,
caches through ``generate()``; each test builds its model (as transformers' tests do), seeded from
``P7_SEED``.  The suite runs in child processes ``python -m pytest -q -p no:cacheprovider``:

* plain: ``-p no:exportobs``;
* first: ``--export-check --export-observe transformers.PreTrainedModel`` into a fresh
  ``--export-dir`` (the check's cost on a first CI run);
* rerun: the same command on the same ``--export-dir``, nothing changed (a cached CI run);
* reseeded: the same on that ``--export-dir`` with other weights (a suite that does not seed its
  models: the traced graphs are the same, the weights not).

Ratios are of wall time (what a team waits for), each side's median over the rounds, the CPU time
beside it; the sides of a round run in turn after one discarded warm-up of the plain side.

    python benchmarks/p7_check_cost.py [--quick] [--reps N]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

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

CHECK = ["--export-check", "--export-observe", "transformers.PreTrainedModel"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--reps", type=int, default=None, help="rounds (default 2, 1 with --quick)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = parser.parse_args(argv)
    rounds = args.reps or (1 if args.quick else 2)
    with tempfile.TemporaryDirectory() as tmp:
        suite = Path(tmp) / "suite"
        suite.mkdir()
        (suite / "test_models.py").write_text(SUITE)
        sides = {name: Samples(name) for name in ("plain", "first", "rerun", "reseeded")}
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
            export_dir = Path(tmp) / f"export-{index}"
            runs = {"plain": pytest_run("-p", "no:exportobs"),
                    "first": pytest_run(*CHECK, f"--export-dir={export_dir}"),
                    "rerun": pytest_run(*CHECK, f"--export-dir={export_dir}"),
                    "reseeded": pytest_run(*CHECK, f"--export-dir={export_dir}", seed=index + 1)}
            for name, (timing, summary) in runs.items():
                sides[name].add(timing)
                summaries[name] = summary
            shutil.rmtree(export_dir, ignore_errors=True)
            log(f"round {index + 1}/{rounds}: " + ", ".join(f"{n} {s.values[-1].wall:.1f} s" for n, s in sides.items()))
    plain = sides["plain"].median("wall")
    ratios = {name: sides[name].median("wall") / plain for name in ("first", "rerun", "reseeded")}
    targets = {"first": 3.0, "rerun": 1.3, "reseeded": 1.3}
    lines = [f"P7 {name:9s} / plain: {ratio:5.2f}  ({sides[name].median('wall'):.1f} s / {plain:.1f} s wall, "
             f"CPU {sides[name].median('cpu'):.1f} s / {sides['plain'].median('cpu'):.1f} s)  "
             f"{verdict(ratio, targets[name])}" for name, ratio in ratios.items()]
    lines += [f"    {name}: {summary}" for name, summary in summaries.items()]
    emit({"id": "P7", "ratios": ratios, "targets": targets, "sides": {n: s.to_json() for n, s in sides.items()},
          "rounds": rounds, "lines": lines}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
