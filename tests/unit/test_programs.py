"""The ExportedProgram the plugin saves (``--export-target torch``) loads in a fresh process with
``load_program`` and serves inputs the tests never used, a transformers cache among them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pytest_exportobs.core.caches import make_dynamic_cache  # noqa: E402
from pytest_exportobs.core.vocabulary import Target  # noqa: E402
from pytest_exportobs.engine.base.settings import CheckSettings  # noqa: E402
from pytest_exportobs.engine.check import check_model  # noqa: E402
from pytest_exportobs.observe.store import ObserveOptions, SessionStore  # noqa: E402
from pytest_exportobs.shapes.spec import spec_api  # noqa: E402

from models import tiny_llama_config  # noqa: E402

# Run in a new interpreter: nothing of transformers imported but what `import transformers` does.
FRESH = '''
import json, sys
import torch, transformers
from pytest_exportobs import load_program, make_dynamic_cache, register_flattening_functions

path, config = sys.argv[1], json.loads(sys.argv[2])
try:
    torch.export.load(path)
except RuntimeError as e:  # CausalLMOutputWithPast is not registered yet: lazy transformers
    print("plain torch.export.load:", str(e).split(".")[0])
program = load_program(path)  # before any model class is touched
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
ids = torch.randint(0, 100, (3, 4))  # batch 3, 4 new tokens after 6 cached: no test used them
past = [(torch.randn(3, 2, 6, 16), torch.randn(3, 2, 6, 16)) for _ in range(2)]
mask = torch.ones(3, 10, dtype=torch.int64)
with register_flattening_functions():
    got = program.module()(input_ids=ids, attention_mask=mask, past_key_values=make_dynamic_cache(past))
    expected = model(input_ids=ids, attention_mask=mask, past_key_values=make_dynamic_cache(past))
print((got.logits - expected.logits).abs().max().item())
broken = torch.ones(3, 11, dtype=torch.int64)  # 6 cached + 4 new is 10
try:
    with register_flattening_functions():
        program.module()(input_ids=ids, attention_mask=broken, past_key_values=make_dynamic_cache(past))
    print("accepted a mask longer than past + new tokens")
except Exception as e:
    print("rejected:", type(e).__name__, str(e).splitlines()[0][:60])
'''


@pytest.mark.slow
def test_a_saved_program_of_a_cached_decoder_loads_in_a_fresh_process_and_serves_new_sizes(tmp_path: Path) -> None:
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    store = SessionStore()
    with store.observe(model, "llama", ObserveOptions(), "test_programs.py::test") as group:
        for batch, past, new in ((2, 5, 1), (1, 7, 2)):
            cache = make_dynamic_cache([(torch.randn(batch, 2, past, 16), torch.randn(batch, 2, past, 16))] * 2)
            model(input_ids=torch.randint(0, 100, (batch, new)),
                  attention_mask=torch.ones(batch, past + new, dtype=torch.int64), past_key_values=cache)
    result = check_model(group, CheckSettings(export_dir=tmp_path, examples=0, targets=(Target.TORCH,)))
    assert result.verdict == "passed", result.reason
    (path,) = [graph.program_path for graph in result.graphs] or [result.program_path]
    assert path.endswith(".pt2") and Path(path).exists()

    run = subprocess.run([sys.executable, "-c", FRESH, path, json.dumps(tiny_llama_config().to_dict())],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    refused, served, broken = run.stdout.splitlines()
    assert refused == "plain torch.export.load: We ran into an error when deserializing the saved file"
    assert float(served) < 1e-4
    if spec_api() is not None:  # a ShapesSpec export states total_seq = past_seq + seq and checks it
        assert broken.startswith("rejected: RuntimeError Runtime assertion failed"), broken
