"""export_patches: a model observed through ``generate()`` exports with torch.onnx.export as
recorded, and the ONNX model matches eager."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

from pytest_exportobs import InputObserver, export_patches, register_flattening_functions  # noqa: E402

from models import cache_argument  # noqa: E402

DYN = torch.export.Dim.DYNAMIC


@pytest.fixture(scope="module")
def observed_generate(tiny_llama):
    """The tiny Llama and an observer of ``generate()``: a prefill of 5 tokens, two decode steps."""
    torch.manual_seed(1)
    observer = InputObserver()
    with observer(tiny_llama):
        tiny_llama.generate(torch.randint(0, 100, (2, 5)), max_new_tokens=3, do_sample=False)
    return tiny_llama, observer


def export(model, observer, kwargs):
    """As the peers' examples export: one block registering the caches and patching transformers."""
    with register_flattening_functions(patch_transformers=True):
        return torch.onnx.export(
            model, (), kwargs=kwargs, dynamic_shapes=observer.infer_dynamic_shapes(), dynamo=True, verbose=False
        )


def test_generate_records_extra_keywords_torch_needs_patches_for(observed_generate):
    _, observer = observed_generate
    with register_flattening_functions():
        shapes = observer.infer_dynamic_shapes()
    expected = {
        "input_ids": {1: DYN}, "position_ids": {1: DYN}, cache_argument(): [{2: DYN}] * 4,
        "use_cache": None, "logits_to_keep": None, "kwargs": {"return_dict": None},
    }
    if transformers.__version__ < "5":  # 4.57 also passes the mask and the cache positions
        expected.update(attention_mask={1: DYN}, cache_position={0: DYN})
    assert shapes == expected


@pytest.mark.slow
def test_export_from_the_default_arguments_succeeds_and_matches_the_decode_steps(observed_generate):
    model, observer = observed_generate
    program = export(model, observer, observer.infer_arguments())
    rows = observer.check_discrepancies(program)
    # The example is a decode step of one token: torch specializes the sequence to 1..2 there
    # (a matmul decomposition guards on it), so the 5-token prefill cannot run; see README.
    assert [row["SUCCESS"] for row in rows] == [False, True, True]
    assert max(row["abs"] for row in rows[1:]) < 1e-4


@pytest.mark.slow
def test_export_from_the_prefill_matches_every_recorded_call(observed_generate):
    model, observer = observed_generate
    program = export(model, observer, observer.infer_arguments(0))
    rows = observer.check_discrepancies(program)
    assert [row["SUCCESS"] for row in rows] == [True, True, True]
    assert [row["n_empty"] for row in rows] == [4, 0, 0]  # the prefill's cache stand-in is empty
    assert max(row["abs"] for row in rows) < 1e-4


def test_the_patches_are_undone_after_the_block():
    import transformers.masking_utils as masking_utils
    from torch.export import _trace
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def current():
        return _trace._get_range_constraints, masking_utils._ignore_causal_mask_sdpa, ALL_ATTENTION_FUNCTIONS["sdpa"]

    originals = current()
    with export_patches():
        patched = current()
    assert all(p is not o for p, o in zip(patched, originals))
    assert current() == originals
    assert "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping


def test_llava_image_features_are_one_tensor_within_the_block_and_a_list_after():
    from transformers.models.llava import modeling_llava

    features = torch.randn(3, 4, 8)
    with export_patches():
        assert [t.shape for t in modeling_llava.list(features)] == [(12, 8)]
        assert modeling_llava.list(range(3)) == [0, 1, 2]
    assert "list" not in vars(modeling_llava)
