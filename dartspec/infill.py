"""Fill-in-the-middle prompts: the code between a prefix and a suffix, for models trained with FIM tokens.

Code models learn infilling as "prefix, suffix, middle" (PSM): ``<fim_prefix> prefix <fim_suffix> suffix <fim_middle>``
and the answer is the middle, ending with EOS. The tokens' names differ by family; a model without them was not
trained for it, and a prompt naming tokens it does not have would be text to it, so such a request is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from dartspec.errors import DartspecError
from dartspec.runtime import TargetRuntime

#: (prefix, suffix, middle) token names by family.
FIM_TOKENS: tuple[tuple[str, str, str], ...] = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
)


def fim_tokens(target: TargetRuntime) -> tuple[int, int, int] | None:
    """The ids of ``target``'s prefix, suffix and middle tokens, or None where it has no FIM tokens."""
    vocab = target.vocab
    for names in FIM_TOKENS:
        if all(name in vocab for name in names):
            return vocab[names[0]], vocab[names[1]], vocab[names[2]]
    return None


def infill_prompt(target: TargetRuntime, prefix: str | Sequence[int], suffix: str) -> list[int]:
    """The prompt whose answer is the middle between ``prefix`` (text, or its token ids) and ``suffix``, in the
    prefix-suffix-middle order (after the tokenizer's BOS where it adds one)."""
    ids = fim_tokens(target)
    if ids is None:
        raise DartspecError(
            f"{target.name} has no fill-in-the-middle tokens ({', '.join(n[0] for n in FIM_TOKENS)}): a suffix needs a "
            "model trained for infilling, such as qwen2.5-coder-0.5b"
        )
    fim_prefix, fim_suffix, fim_middle = ids
    bos = target.encode("", add_special_tokens=True)  # [BOS] where the tokenizer adds one, else nothing
    head = target.encode(prefix, add_special_tokens=False) if isinstance(prefix, str) else list(prefix)
    tail = target.encode(suffix, add_special_tokens=False)
    return [*bos, fim_prefix, *head, fim_suffix, *tail, fim_middle]
