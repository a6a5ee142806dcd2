"""Tiny random targets shared by the unit tests (float64, so argmax ties and rounding never flake)."""

from __future__ import annotations

import pytest
import torch

from dartspec.target import Target

VOCAB = 96


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", unk_token="t0")


def tiny_model(arch: str, seed: int = 0, layers: int = 6, max_positions: int = 512, head_dim: int = 8, **config):
    """A tiny random float64 model of ``arch``; ``config``: more fields of its configuration (or other values of
    these, e.g. ``num_attention_heads``)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = (
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max_positions,
            eos_token_id=1,
            tie_word_embeddings=True,
        )
        | config
    )
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif arch == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif arch == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=head_dim, **common))
    elif arch == "gemma3":
        cfg = tf.Gemma3TextConfig(
            head_dim=8,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * (layers // 3),
            query_pre_attn_scalar=8,
            **common,
        )
        model = tf.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    model.config._attn_implementation = "sdpa"
    return model.to(torch.float64).eval()


def tiny_target(arch: str = "llama", seed: int = 0, layers: int = 6, fast_linear: bool = True, **kw) -> Target:
    return Target(tiny_model(arch, seed, layers, **kw), tiny_tokenizer(), name=f"tiny-{arch}", fast_linear=fast_linear)


ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]


@pytest.fixture(scope="module", params=ARCHS)
def any_target(request: pytest.FixtureRequest) -> Target:
    return tiny_target(request.param)


@pytest.fixture(scope="module")
def llama_target() -> Target:
    return tiny_target("llama")
