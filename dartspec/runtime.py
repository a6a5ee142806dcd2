"""The seam between the engine and whatever runs the target model.

Two protocols say what the rest of dartspec may use:

- :class:`TargetRuntime`: what the engine loop needs (prefill, verify a tree, commit the accepted path,
  cache length, context size, EOS ids, the tokenizer face);
- :class:`FeatureSource`: what feature-based drafters (DART, EAGLE-3) read (hidden features of chosen
  layers, the input embedding, the LM head).

:class:`CausalRuntime` implements everything both protocols share over one abstract forward, so a runtime
only writes how it runs q new tokens against its KV cache. Two exist: :class:`dartspec.target.Target`
(transformers' modules, any architecture) and :class:`dartspec.lean.LeanTarget` (a hand-written forward
for the Llama / Qwen2 / Qwen3 / Gemma 3 families with quantized weight formats).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dartspec.errors import ContextLengthError, DartspecError
from dartspec.kv_cache import TreeKVCache
from dartspec.tree import Tree

if TYPE_CHECKING:
    from dartspec.constraint import TokenTexts
    from dartspec.cuda_graphs import StepGraphs
    from dartspec.prefix_cache import PrefixCache

# Decoding ends at any of these when the tokenizer knows them: chat models close a turn with an
# end-of-turn token that is not always the config's eos_token_id (e.g. Qwen2.5's <|im_end|>).
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>")

PREFILL_CHUNK = 512


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The layers whose *input* hidden states feed the drafters: low, middle, high (DART, EAGLE-3)."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


@dataclass(frozen=True)
class TargetOutput:
    """What one target forward returns.

    Attributes:
        logits: ``(rows, vocab)`` float32 logits for the requested rows.
        features: ``(q, len(feature_layers) * hidden)`` hidden states entering the feature layers for
            every input position, or None when features were not requested.
        hidden: the final-norm hidden states the logits come from (whole-sequence scoring; the training
            feature cache stores them instead of the logits).
        argmax: ``(rows,)`` int64, each row's ``logits.argmax(-1)``, where the runtime took it with the logits
            (the lean runtime's C head on a CPU); None elsewhere.
    """

    logits: torch.Tensor
    features: torch.Tensor | None
    hidden: torch.Tensor | None = None  # final-norm hidden states (scoring whole sequences only)
    argmax: torch.Tensor | None = None


@runtime_checkable
class TargetRuntime(Protocol):
    """What the engine needs from a target: KV caches driven by prefill / verify / commit.

    Every cache operation takes the sequence's ``cache`` (:meth:`new_cache`); without one it acts on the runtime's
    own (one sequence at a time, as the single-stream API and the tools use it). :meth:`verify_many` scores many
    sequences' trees in one step (continuous batching)."""

    name: str
    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]
    cache: TreeKVCache  # the runtime's own, for one sequence at a time
    prefix_cache: PrefixCache | None  # shared prompt prefixes (None: off or unsupported)
    share_prefix_attention: bool  # batched steps read common prefix pages once

    @property
    def device(self) -> torch.device: ...

    @property
    def cached(self) -> int: ...

    @property
    def vocab(self) -> dict[str, int]: ...

    def enable_prefix_cache(self, max_bytes: int) -> PrefixCache: ...

    def new_cache(self, capacity: int = 256) -> TreeKVCache: ...

    def reset(self) -> None: ...

    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        features: bool = False,
        cache: TreeKVCache | None = None,
        all_logits: bool = False,
    ) -> TargetOutput: ...

    def verify(self, tree: Tree, *, features: bool = False, cache: TreeKVCache | None = None) -> TargetOutput: ...

    def verify_many(
        self, items: Sequence[tuple[Tree, TreeKVCache]], *, features: bool = False
    ) -> list[TargetOutput]: ...

    def commit(self, base: int, nodes: Sequence[int], cache: TreeKVCache | None = None) -> None: ...

    def truncate(self, length: int) -> None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(
        self,
        messages: Sequence[dict[str, str]],
        template_args: Mapping[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]: ...

    def encode_chats(
        self,
        conversations: Sequence[Sequence[dict[str, str]]],
        template_args: Mapping[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[list[int]]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    @property
    def token_texts(self) -> TokenTexts: ...


@runtime_checkable
class FeatureSource(Protocol):
    """What feature-based drafters read from a target (and the trainers, which also score whole sequences)."""

    name: str
    config: Any
    num_layers: int
    hidden_size: int
    vocab_size: int
    feature_layers: tuple[int, ...]
    fast_linear: bool
    tokenizer: Any
    eos_token_ids: frozenset[int]

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def set_feature_layers(self, layers: Sequence[int] | None) -> None: ...

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor: ...

    def lm_head_weight(self) -> torch.Tensor: ...

    def score_sequence(self, token_ids: Sequence[int] | torch.Tensor) -> TargetOutput: ...

    def score_batch(self, sequences: Sequence[Sequence[int] | torch.Tensor]) -> TargetOutput: ...


def tree_mask(tree: Tree) -> torch.Tensor | None:
    """A tree's ancestor mask ``(q, q)``, or None for a chain (plain causal)."""
    return None if bool(np.array_equal(tree.depth, np.arange(tree.size))) else torch.from_numpy(tree.ancestors)


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device`` without stopping the host: a host tensor goes to a GPU from pinned memory,
    asynchronously (a copy from pageable memory waits until the device has run everything queued before it, which
    in a training step is the target's whole forward)."""
    device = torch.device(device)
    if tensor.device == device:
        return tensor
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def host_values(tensor: torch.Tensor) -> list:
    """The values of a tensor that lives on the host (checked), as Python numbers: a read that waits for no
    device, where ``tolist()`` on a device tensor would (tests/host_reads.py tells the two apart by this call)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"host_values reads host tensors; this one is on {tensor.device}")
    return tensor.tolist()


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A host tensor's memory as a numpy array (checked: no device to wait for; tests/host_reads.py tells this call
    apart from a read of a device tensor)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"host_array views host tensors; this one is on {tensor.device}")
    return tensor.numpy()


def pad_sequences(sequences: Sequence[Sequence[int] | torch.Tensor], device: torch.device) -> torch.Tensor:
    """Token ids of many sequences as one ``(B, T)`` tensor, right-padded with id 0 to the longest."""
    if not sequences:
        raise DartspecError("no sequences to score")
    rows = [torch.as_tensor(ids, dtype=torch.long).reshape(-1) for ids in sequences]
    return to_device(torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), device)


def describe(target: Any) -> str:
    """``lean/exact``, ``lean/exact-a16+kv16`` (an fp16 KV cache) or ``hf/float32``: the runtime and weight format,
    for logs, caches and benchmark rows."""
    quant = getattr(target, "weight_format", None) or getattr(target, "quant", None)
    if quant is not None:
        kv = "+kv16" if getattr(target, "kv_cache", "fp32") == "fp16" else ""
        return f"lean/{quant}{kv}" + ("+graphs" if getattr(target, "step_graphs", None) is not None else "")
    return f"hf/{str(target.dtype).removeprefix('torch.')}"


#: SDPA's kernels for attention on a GPU, cuDNN's left out. cuDNN builds an execution graph for every new shape and
#: caches it by shape: the H200 window's profile measured ~25 us a call once built, and 62 ms of host time a call
#: where a training step's new widths made it build its backward. Here shapes change at every step (a KV cache grows
#: by a token, each training batch has its own widths), so it would build one a step (the window's data phase, all new
#: shapes, ran ~62 ms a decode step against the warm profile's 13). Flash and memory-efficient attention run any shape
#: without building anything; the math kernel is the fallback for what neither takes.
GPU_ATTENTION = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def attention_kernels(device: torch.device) -> AbstractContextManager[Any]:
    """The context to run a forward's attention in on ``device`` (:data:`GPU_ATTENTION` on a GPU, else SDPA's own
    choice): one per forward, not per layer (entering it costs ~10-20 us of host time)."""
    return sdpa_kernel(list(GPU_ATTENTION)) if device.type == "cuda" else nullcontext()


def on_cpu(device: Any) -> bool:
    """Whether ``device`` (a ``torch.device`` or its name) is the CPU: the defaults that depend on what a verified
    row costs (tree sizes, budgets, batch rows, the drafters) ask this one question."""
    return str(getattr(device, "type", device)) == "cpu"


def sync(device: torch.device) -> None:
    """Wait for queued GPU work so wall-clock timings are honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CausalRuntime(ABC):
    """Shared body of the runtimes: cache bookkeeping, context checks, chunked prefill, text.

    Subclasses implement :meth:`_run` (q new tokens at given positions against the cache), :meth:`logits`,
    :meth:`embed`, :meth:`lm_head_weight` and :meth:`score_sequence`.
    """

    #: Captured decode / verify steps (:mod:`dartspec.cuda_graphs`, the lean runtime on a GPU), or None.
    step_graphs: StepGraphs | None = None
    #: The KV caches' dtype (None: that of the keys the forward computes; the lean runtime's ``--kv-cache fp16``).
    kv_dtype: torch.dtype | None = None

    def __init__(
        self,
        *,
        config: Any,
        tokenizer: Any,
        name: str,
        generation_config: Any = None,
        feature_layers: Sequence[int] | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.name = name
        self.num_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.max_context = int(getattr(config, "max_position_embeddings", 2048))
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.eos_token_ids = self._find_eos_ids(generation_config)
        self.cache = self.new_cache()
        #: Rows per prefill forward (a runtime whose rows are computed independently may pick its fastest).
        self.prefill_chunk = PREFILL_CHUNK
        #: Shared prompt-prefix KV (:mod:`dartspec.prefix_cache`), on runtimes that support it once enabled.
        self.prefix_cache: PrefixCache | None = None
        #: Whether a batched step's sequences on the same prefix pages attend to them together (the lean runtime).
        self.share_prefix_attention = False
        self.feature_layers: tuple[int, ...] = ()
        self.set_feature_layers(feature_layers)

    @functools.cached_property
    def vocab(self) -> dict[str, int]:
        """The tokenizer's vocabulary (token -> id), listed once: the EOS ids, a drafter's target check and its n-gram
        file's check all read it, and listing it takes 0.05 s (SmolLM2) to 0.25 s (Gemma 3) each time."""
        return self.tokenizer.get_vocab() if self.tokenizer is not None else {}

    @functools.cached_property
    def token_texts(self) -> TokenTexts:
        """The bytes each token adds to a decoded text, listed once (on the first constrained request: 0.2 s for
        SmolLM2's 49K tokens, 1 s for Gemma 3's 262K)."""
        from dartspec.constraint import TokenTexts

        return TokenTexts.of(self.decode, self.vocab_size, self.eos_token_ids, anchor=self.encode("a")[-1])

    def _find_eos_ids(self, generation_config: Any) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.config, generation_config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        vocab = self.vocab
        ids.update(vocab[t] for t in _END_OF_TURN_TOKENS if t in vocab)
        return frozenset(ids)

    # --- features ----------------------------------------------------------------------------

    def set_feature_layers(self, layers: Sequence[int] | None) -> None:
        """Return features from these decoder layers' inputs from now on (None: 2, N//2, N-3).

        Drafters call this with their checkpoint's layers before each generation, so drafters trained on
        other layers can share one target.
        """
        wanted = tuple(int(i) for i in layers) if layers is not None else default_feature_layers(self.num_layers)
        if wanted == self.feature_layers:
            return
        for i in wanted:
            if not 0 <= i < self.num_layers:
                raise DartspecError(f"feature layer {i} is out of range for a {self.num_layers}-layer target")
        self._use_feature_layers(wanted)
        self.feature_layers = wanted

    def _use_feature_layers(self, layers: tuple[int, ...]) -> None:  # noqa: B027 (an optional hook)
        """Hook for runtimes that must rewire something when the feature layers change."""

    # --- state -------------------------------------------------------------------------------

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @property
    def cached(self) -> int:
        """Number of positions whose keys and values are in the runtime's own cache."""
        return self.cache.length

    def new_cache(self, capacity: int = 256) -> TreeKVCache:
        """An empty KV cache for another sequence (pass it as ``cache`` to prefill / verify / commit), of
        :attr:`kv_dtype`."""
        return TreeKVCache(self.num_layers, capacity, dtype=self.kv_dtype)

    def reset(self) -> None:
        """Forget the cached sequence (the buffers are kept for reuse), shared prefix pages included (a prefix
        cache's prefill may have started the runtime's own cache with them)."""
        self.cache.reset()

    def truncate(self, length: int) -> None:
        """Drop cached positions from ``length`` on."""
        self.cache.truncate(length)

    # --- forwards ----------------------------------------------------------------------------

    def enable_prefix_cache(self, max_bytes: int) -> PrefixCache:
        """Share prompt prefixes' KV among requests, up to ``max_bytes`` (:mod:`dartspec.prefix_cache`)."""
        raise DartspecError(
            f"{type(self).__name__} has no prefix cache: it needs the lean runtime's exact-a16 kernels on a CPU"
        )

    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        features: bool = False,
        cache: TreeKVCache | None = None,
        all_logits: bool = False,
    ) -> TargetOutput:
        """Append ``token_ids`` to ``cache`` (default: the runtime's own; chunked causal forwards); logits of the last
        position only, or with ``all_logits`` of every position (row i predicts the token after ``token_ids[i]``:
        scoring a prompt)."""
        cache = self.cache if cache is None else cache
        if len(token_ids) == 0:
            raise DartspecError("the prompt is empty")
        if cache.length + len(token_ids) > self.max_context:
            raise ContextLengthError(
                f"the prompt is {len(token_ids)} tokens but {self.name} has a context window of "
                f"{self.max_context} tokens"
            )
        outs = []
        for start in range(0, len(token_ids), self.prefill_chunk):
            chunk = list(token_ids[start : start + self.prefill_chunk])
            n = len(chunk)
            last = start + n == len(token_ids)
            rows = None if all_logits else [n - 1] if last else []
            outs.append(self._forward(chunk, torch.arange(n), None, cache, logit_rows=rows, features=features))
        feats = torch.cat([o.features for o in outs]) if features else None
        if not all_logits:
            return TargetOutput(outs[-1].logits, feats, argmax=outs[-1].argmax)
        argmax = None if any(o.argmax is None for o in outs) else torch.cat([o.argmax for o in outs])  # type: ignore[misc]
        return TargetOutput(torch.cat([o.logits for o in outs]), feats, argmax=argmax)

    def verify(self, tree: Tree, *, features: bool = False, cache: TreeKVCache | None = None) -> TargetOutput:
        """Score every node of ``tree`` in one forward against ``cache`` (default: the runtime's own); logits row i
        predicts the token after node i."""
        cache = self.cache if cache is None else cache
        self._check_room(cache, tree)
        return self._forward(
            tree.tokens.tolist(),
            torch.from_numpy(tree.depth),
            tree_mask(tree),
            cache,
            logit_rows=None,
            features=features,
        )

    def verify_many(self, items: Sequence[tuple[Tree, TreeKVCache]], *, features: bool = False) -> list[TargetOutput]:
        """:meth:`verify` of each ``(tree, cache)`` of many sequences; runtimes that score them in one forward
        override it (the lean runtime on a CPU), the results are the same."""
        return [self.verify(tree, features=features, cache=cache) for tree, cache in items]

    def _check_room(self, cache: TreeKVCache, tree: Tree) -> None:
        if cache.length + tree.size > self.max_context:
            raise ContextLengthError(f"the sequence reached {self.name}'s context window of {self.max_context} tokens")

    @torch.inference_mode()
    def commit(self, base: int, nodes: Sequence[int], cache: TreeKVCache | None = None) -> None:
        """After a verify at cache length ``base``, keep the entries of ``nodes`` (the accepted path) in ``cache``
        (default: the runtime's own)."""
        cache = self.cache if cache is None else cache
        n = len(nodes)
        if list(nodes) == list(range(n)):
            cache.truncate(base + n)
        elif self.step_graphs is None or not self.step_graphs.commit(base, nodes, cache):
            cache.keep(base, torch.as_tensor(nodes, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def _forward(
        self,
        token_ids: list[int],
        offsets: torch.Tensor,
        local_mask: torch.Tensor | None,
        cache: TreeKVCache,
        *,
        logit_rows: list[int] | None,
        features: bool,
    ) -> TargetOutput:
        """q new tokens at positions ``cache.length + offsets`` that see the whole cache plus ``local_mask``
        (None: causal among themselves)."""
        base = cache.length
        device = self.device
        try:
            graphs = self.step_graphs
            graphed = graphs.run(token_ids, offsets, local_mask, features, cache) if graphs is not None else None
            if graphed is not None:
                hidden, feats = graphed
            else:
                ids = torch.tensor(token_ids, dtype=torch.long, device=device)
                positions = offsets.to(device=device, dtype=torch.long) + base
                hidden, feats = self._run(ids, positions, local_mask, features, cache)
        except BaseException:
            # A failed forward must not leave half-written entries that later steps would attend to.
            cache.truncate(base)
            raise
        rows = hidden if logit_rows is None else hidden[logit_rows]
        logits, argmax = self._project(rows)
        return TargetOutput(logits, feats, argmax=argmax)

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits of final-norm ``hidden`` rows, and their argmax where the runtime takes it on the way (else
        None: the verifier takes it)."""
        return self.logits(hidden), None

    def _allowed(self, base: int, q: int, local_mask: torch.Tensor | None) -> torch.Tensor:
        """``(q, base + q)`` boolean: which cached and new positions each new token may attend to."""
        allowed = torch.ones(q, base + q, dtype=torch.bool, device=self.device)
        local = torch.ones(q, q, dtype=torch.bool).tril_() if local_mask is None else local_mask
        allowed[:, base:] = local.to(self.device)
        return allowed

    @torch.inference_mode()
    def forward_batch(
        self, ids: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor, cache: TreeKVCache
    ) -> torch.Tensor:
        """One forward of a batch of sequences against their own batched ``cache`` (not the runtime's), for
        static-batch decoding (:mod:`dartspec.batch_decode`): ``ids`` and ``positions`` ``(B, q)``;
        ``key_positions`` ``(B, cache.length + q)`` the position of every cached and new slot, -1 for padding.
        A row attends to the slots at or before its position; a padding row only to itself, which keeps it
        finite. Returns the final-norm hidden states ``(B, q, hidden)``."""
        if key_positions.shape[1] > self.max_context:
            raise ContextLengthError(f"a batch reached {self.name}'s context window of {self.max_context} tokens")
        q, slots = ids.shape[1], key_positions.shape[1]
        keys = key_positions[:, None, :]
        allowed = (keys >= 0) & (keys <= positions[:, :, None])
        new = torch.arange(q, device=ids.device)
        allowed[:, new, slots - q + new] = True
        try:
            return self._run_batch(ids, positions.clamp_min(0), key_positions, allowed, cache)
        except BaseException:
            cache.truncate(slots - q)
            raise

    def decode_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        key_positions: torch.Tensor,
        column: int,
        cache: TreeKVCache,
    ) -> torch.Tensor:
        """One new token for each row of a static batch (:mod:`dartspec.batch_decode`): ``tokens`` and ``positions``
        ``(B,)``, written to slot ``column`` of the batch's ``cache``; ``key_positions`` ``(B, slots)`` the position of
        every slot of every row (column ``column`` already set, later ones -1). Returns the final-norm hidden states
        ``(B, hidden)``: :meth:`forward_batch` of that column, or the same step as a CUDA graph."""
        if self.step_graphs is not None:
            hidden = self.step_graphs.run_batch(tokens, positions, key_positions, column, cache)
            if hidden is not None:
                return hidden
        return self.forward_batch(tokens[:, None], positions[:, None], key_positions[:, : column + 1], cache)[:, -1]

    @abstractmethod
    def _run_batch(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        key_positions: torch.Tensor,
        allowed: torch.Tensor,
        cache: TreeKVCache,
    ) -> torch.Tensor:
        """:meth:`forward_batch` with its ``(B, q, slots)`` boolean mask built."""

    @abstractmethod
    def _run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        local_mask: torch.Tensor | None,
        features: bool,
        cache: TreeKVCache,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``ids`` at ``positions``, appending their keys/values to ``cache``; ``(final hidden (q, H),
        features (q, F*H) or None)``."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on final-norm hidden states ``(rows, H)``; ``(rows, vocab)`` in float32 or wider."""

    @abstractmethod
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's input embeddings of ``token_ids`` (what drafters pair with features)."""

    @abstractmethod
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's weight ``(vocab, H)`` (drafters initialise theirs from it)."""

    @abstractmethod
    def score_sequence(self, token_ids: Sequence[int] | torch.Tensor) -> TargetOutput:
        """Features and logits for every position of a whole sequence (training; the cache is untouched)."""

    def score_batch(self, sequences: Sequence[Sequence[int] | torch.Tensor]) -> TargetOutput:
        """:meth:`score_sequence` of each sequence, right-padded with zeros to the longest: features
        ``(B, T, F*H)`` and logits ``(B, T, vocab)``. Runtimes that run a batch in one forward override it."""
        outs = [self.score_sequence(ids) for ids in sequences]
        width = max(out.logits.shape[0] for out in outs)

        def stack(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack([F.pad(t, (0, 0, 0, width - t.shape[0])) for t in parts])

        hidden = stack([o.hidden for o in outs]) if all(o.hidden is not None for o in outs) else None
        return TargetOutput(stack([o.logits for o in outs]), stack([o.features for o in outs]), hidden)

    # --- text --------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_chat(
        self,
        messages: Sequence[dict[str, str]],
        template_args: Mapping[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Apply the model's chat template (with the assistant turn opened) and tokenize; ``template_args``: more
        variables for the template (e.g. Qwen3's ``enable_thinking``; vLLM's ``chat_template_kwargs``).
        ``add_generation_prompt=False``: the assistant turn is not opened; ``continue_final_message``: the last
        message (the assistant's) is left open, for the answer to go on from it (both as transformers' and vLLM's)."""
        return self.encode_chats(
            [messages],
            template_args,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )[0]

    def encode_chats(
        self,
        conversations: Sequence[Sequence[dict[str, str]]],
        template_args: Mapping[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[list[int]]:
        """:meth:`encode_chat` of many conversations, tokenized in one batch (the tokenizer's own threads: data
        generation encodes a thousand at a time). Templates render to text with their special tokens, which the
        tokenizer reads back as such; nothing is added around them (what ``apply_chat_template`` does)."""
        if not self.has_chat_template:
            raise DartspecError(f"{self.name} has no chat template; pass a plain prompt without --chat")
        if continue_final_message and add_generation_prompt:
            raise DartspecError("continue_final_message goes on with the last message: add no generation prompt")
        extra = dict(template_args or {})
        if continue_final_message:
            extra["continue_final_message"] = True
        opened = add_generation_prompt
        texts = [
            self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=opened, tokenize=False, **extra)
            for messages in conversations
        ]
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        return [[int(t) for t in row] for row in ids]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids (with the tokenizer's own BOS where it adds one, unless ``add_special_tokens`` is
        False: a piece of text inside another, such as a bad word)."""
        return [int(t) for t in self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """``token_ids``' text, without the special tokens' unless ``skip_special_tokens`` is False."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
