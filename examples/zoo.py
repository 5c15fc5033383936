"""The models of the realistic suite: tiny untrained transformers models built from configs, and a
few hand-written torch modules of the kinds teams have (a UNet, a GRU tagger, a pooling head...).

Every builder seeds torch, so that two tests asking for one model get identical weights.
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 1000
PAD, BOS, EOS = 0, 1, 2


def seeded(build, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build().eval()


def decoder_config(cls: type, **extra) -> transformers.PretrainedConfig:
    """A 2-layer decoder configuration with grouped-query attention."""
    values = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
    )
    return cls(**{**values, **extra})


def llama() -> torch.nn.Module:
    return seeded(lambda: transformers.LlamaForCausalLM(decoder_config(transformers.LlamaConfig)))


def static_llama() -> torch.nn.Module:
    """A Llama configured for a StaticCache, built by pytest_exportobs' own helper."""
    from pytest_exportobs import get_untrained_model_with_inputs

    torch.manual_seed(0)
    return get_untrained_model_with_inputs(
        transformers.LlamaConfig(), model_kwargs=dict(cache_implementation="static"),
        inputs_kwargs=dict(cls_cache="StaticCache"),
    )["model"]


def qwen2() -> torch.nn.Module:
    return seeded(lambda: transformers.Qwen2ForCausalLM(decoder_config(transformers.Qwen2Config)))


def mistral() -> torch.nn.Module:
    """Mistral as configured by default: a sliding attention window (here 16 tokens)."""
    config = decoder_config(transformers.MistralConfig, sliding_window=16)
    return seeded(lambda: transformers.MistralForCausalLM(config))


def gemma() -> torch.nn.Module:
    config = decoder_config(transformers.GemmaConfig, head_dim=16)
    return seeded(lambda: transformers.GemmaForCausalLM(config))


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
    )
    return seeded(lambda: transformers.GPT2LMHeadModel(config))


def opt() -> torch.nn.Module:
    config = transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
        max_position_embeddings=256, word_embed_proj_dim=64, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
    )
    return seeded(lambda: transformers.OPTForCausalLM(config))


def qwen2_moe() -> torch.nn.Module:
    """A mixture-of-experts decoder, experts as transformers configures them by default."""
    config = decoder_config(
        transformers.Qwen2MoeConfig, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
    )
    return seeded(lambda: transformers.Qwen2MoeForCausalLM(config))


def roberta() -> torch.nn.Module:
    config = transformers.RobertaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=130, pad_token_id=1,
    )
    return seeded(lambda: transformers.RobertaModel(config, add_pooling_layer=False))


def bert_classifier() -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=128, num_labels=3,
    )
    return seeded(lambda: transformers.BertForSequenceClassification(config))


def t5() -> torch.nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=PAD, pad_token_id=PAD, eos_token_id=EOS,
    )
    return seeded(lambda: transformers.T5ForConditionalGeneration(config))


def whisper() -> torch.nn.Module:
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
        max_source_positions=32, max_target_positions=64, pad_token_id=PAD, bos_token_id=BOS,
        eos_token_id=EOS, decoder_start_token_id=BOS,
    )
    return seeded(lambda: transformers.WhisperForConditionalGeneration(config))


def vit() -> torch.nn.Module:
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, num_labels=10,
    )
    return seeded(lambda: transformers.ViTForImageClassification(config))


def resnet() -> torch.nn.Module:
    """transformers' ResNet: convolutions with BatchNorm."""
    config = transformers.ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=10,
    )
    return seeded(lambda: transformers.ResNetForImageClassification(config))


class SmallCNN(torch.nn.Module):
    """A classifier with BatchNorm, as a team writes one."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        )
        self.head = torch.nn.Linear(32, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(images))


class TinyUNet(torch.nn.Module):
    """Down by 2, up by 2, concatenated with the skip connection: the latent side must be even."""

    def __init__(self, channels: int = 4):
        super().__init__()
        self.enc = torch.nn.Conv2d(channels, 16, 3, padding=1)
        self.down = torch.nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.up = torch.nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.dec = torch.nn.Conv2d(32, channels, 3, padding=1)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        skip = torch.relu(self.enc(latents))
        up = self.up(torch.relu(self.down(skip)))
        return self.dec(torch.cat([up, skip], dim=1))


class GRUTagger(torch.nn.Module):
    """Token ids → one tag per token."""

    def __init__(self, vocab: int = 500, tags: int = 9):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 32)
        self.gru = torch.nn.GRU(32, 32, batch_first=True)
        self.out = torch.nn.Linear(32, tags)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.gru(self.embed(tokens))
        return self.out(hidden)


class MaskedMeanPool(torch.nn.Module):
    """Projects features and averages them over the sequence, over the valid positions when a mask
    is given."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.proj(x))
        if mask is None:
            return h.mean(dim=1)
        weights = mask.unsqueeze(-1).to(h.dtype)
        return (h * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


class TextEncoder(torch.nn.Module):
    """A small transformer encoder over token ids; ``token_type_ids`` are optional."""

    def __init__(self, vocab: int = 300, dim: int = 32):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, dim)
        self.types = torch.nn.Embedding(2, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tokens(input_ids)
        if token_type_ids is not None:
            h = h + self.types(token_type_ids)
        return self.encoder(h)


class GatedScorer(torch.nn.Module):
    """Picks a head from the values of its input: fine in eager, not capturable by torch.export."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.positive = torch.nn.Linear(8, 1)
        self.negative = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.proj(x))
        return self.positive(h) if x.mean() > 0 else self.negative(h)


class RepeatUntilCount(torch.nn.Module):
    """Repeats a refinement as many times as its ``steps`` input says (a value read in Python)."""

    def __init__(self):
        super().__init__()
        self.step = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        for _ in range(int(steps)):
            x = torch.tanh(self.step(x))
        return x


class PairwiseHead(torch.nn.Module):
    """Compares the first two rows of a batch when there are at most two, else pools: eager accepts
    any batch, but the branch taken on the observed batch pins it."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if h.shape[0] <= 2:
            return (h[:1] - h[-1:]).expand(h.shape[0], -1)
        return h - h.mean(dim=0, keepdim=True)


class FixedBatchNorm(torch.nn.Module):
    """Reshapes to the batch it was written for: eager accepts batch 4 only."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).reshape(4, 2, 4).softmax(-1).reshape(4, 8)
