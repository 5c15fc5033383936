"""Fixtures of a team's model tests: each builds a tiny untrained model, seeded."""

from __future__ import annotations

import pytest
import zoo


@pytest.fixture
def llama():
    return zoo.llama()


@pytest.fixture
def static_llama():
    return zoo.static_llama()


@pytest.fixture
def qwen2():
    return zoo.qwen2()


@pytest.fixture
def mistral():
    return zoo.mistral()


@pytest.fixture
def gemma():
    return zoo.gemma()


@pytest.fixture
def gpt2():
    return zoo.gpt2()


@pytest.fixture
def opt():
    return zoo.opt()


@pytest.fixture
def qwen2_moe():
    return zoo.qwen2_moe()


@pytest.fixture
def roberta():
    return zoo.roberta()


@pytest.fixture
def bert():
    return zoo.bert_classifier()


@pytest.fixture
def t5():
    return zoo.t5()


@pytest.fixture
def whisper():
    return zoo.whisper()


@pytest.fixture
def vit():
    return zoo.vit()


@pytest.fixture
def resnet():
    return zoo.resnet()


@pytest.fixture
def small_cnn():
    return zoo.seeded(zoo.SmallCNN)


@pytest.fixture
def unet():
    return zoo.seeded(zoo.TinyUNet)


@pytest.fixture
def tagger():
    return zoo.seeded(zoo.GRUTagger)


@pytest.fixture
def pooler():
    return zoo.seeded(zoo.MaskedMeanPool)


@pytest.fixture
def text_encoder():
    return zoo.seeded(zoo.TextEncoder)
