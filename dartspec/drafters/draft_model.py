"""A smaller model of the target's family as the drafter: classic speculative decoding (Leviathan et al. 2023; what
llama.cpp's ``--model-draft``, vLLM's draft models and transformers' assistant models do).

The draft model runs on a dartspec runtime of its own (the lean runtime on a CPU) with a KV cache of its own per
sequence, and drafts one chain greedily, one forward a token, while its top token is likely enough (``p_min``, as
llama.cpp's ``--draft-p-min``): a token the draft model itself doubts is rarely the target's, and on a CPU each
drafted token costs a forward of the draft model and a verified row of the target. Nodes the chain leaves in the
budget go to runner-up tokens along it (their probability times the chain's up to there), which cost no forward.

No training and no target features: any model with the target's tokenizer works (Qwen2.5-Coder-0.5B for
Qwen2.5-Coder-1.5B or 7B). What it buys is set by the ratio of the two models' step times: on a memory-bound CPU that
is the ratio of their weight bytes, so a draft model a tenth of the target's size pays where one half its size
barely does (Qwen2.5-Coder-0.5B's step is 0.49 of 1.5B's on the 2-core Intel Xeon; BENCHMARKS.md).

Catching up costs no extra forward: the draft model's cache keeps the chain it drafted, the next proposal cuts it
back to what the target accepted (the longest common prefix with the committed tokens) and feeds the rest, at most
the last drafted token and the target's own next token, in the same forward that drafts the next chain's first
token. A new request whose prompt extends the last one's (a chat's next turn) reuses the draft model's cache the same
way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dartspec.drafters.base import DraftBudget, DrafterBase
from dartspec.drafters.options import DrafterOptions
from dartspec.errors import DartspecError
from dartspec.runtime import CausalRuntime
from dartspec.tree import Proposal, Tree
from dartspec.verify import sample

#: The chain stops before a token the draft model gives less than this probability (its first token is always
#: drafted: the forward that scores it is paid already, and a verified row costs less than a draft forward).
#: Qwen2.5-Coder-0.5B drafting for 1.5B at 4 nodes (2-core Intel Xeon, 18 development prompts, ShareGPT 14000+, 96
#: new tokens, interleaved): medians 1.10x plain decoding at 0.3, 1.16x at 0.5, 1.18-1.19x at 0.7, 1.15x at 0.8 and
#: 0.9; 3 nodes 1.11-1.16x, 6 nodes 1.08x.
DRAFT_P_MIN = 0.7


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelDrafter(DrafterBase):
    """Greedy chains of a draft model (a :class:`~dartspec.runtime.CausalRuntime` with the target's tokenizer),
    runner-ups along them in the nodes left. For a sampled request with ``--sampled-drafts`` each chain token is drawn
    from the draft model at the request's temperature and the verifier tests it by rejection against the target's
    distribution, classic speculative sampling (kept with probability min(1, p/q))."""

    name = "draft-model"

    def __init__(self, model: CausalRuntime, target: CausalRuntime, p_min: float = DRAFT_P_MIN) -> None:
        """``model`` drafts for ``target``, whose tokenizer it must have (a draft model's padded rows past the
        target's ids are never drafted). ``p_min``: the chain stops before a token the draft model gives less than
        this probability."""
        if not 0.0 <= p_min < 1.0:
            raise ValueError(f"p_min must be in [0, 1) (got {p_min})")
        if model.vocab != target.vocab:
            raise DartspecError(
                f"the draft model {model.name} does not share the target's tokenizer ({target.name}): a draft model "
                "must give every token the id the target gives it"
            )
        self.model = model
        self.vocab_limit = min(int(target.vocab_size), int(model.vocab_size))
        self.p_min = p_min
        self._ids = np.arange(self.vocab_limit)  # a sampled draw's support: every token id
        self.forwards = 0  # the draft model's forwards in this generation
        self.positions = 0  # and the positions they fed
        self._own_state()

    def _own_state(self) -> None:
        self.cache = self.model.new_cache()
        self.cached: list[int] = []  # the tokens whose keys and values are in self.cache

    def begin(self, prompt_ids: Sequence[int]) -> None:
        # The cache is kept: the first proposal keeps whatever prefix the new prompt shares with what it holds.
        self.forwards = self.positions = 0

    def report(self) -> dict:
        return {"draft_model_forwards": self.forwards, "draft_model_positions": self.positions}

    def _feed(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Append ``token_ids`` to the draft model's cache; the logits of the token after the last one."""
        out = self.model.prefill(list(token_ids), cache=self.cache)
        self.cached.extend(int(t) for t in token_ids)
        self.forwards += 1
        self.positions += len(token_ids)
        return out.logits[-1, : self.vocab_limit].float()

    def propose(self, tokens: Sequence[int], budget: DraftBudget) -> Tree:
        root = int(tokens[-1])
        depth_cap = min(budget.max_depth, budget.max_nodes - 1)
        if depth_cap < 1 or len(tokens) + depth_cap > self.model.max_context:
            return Tree.root_only(root)  # no room (a full batch's share, the draft model's context)
        # Keep what the target accepted, feed the rest (the root at least: its row drafts the first token).
        keep = shared_prefix(self.cached, tokens[:-1])
        self.cache.truncate(keep)
        del self.cached[keep:]
        logits = self._feed(tokens[keep:])  # within the context: checked above for the whole chain
        sampling = budget.sampling
        chain: list[int] = []
        proposals: dict[int, Proposal] = {}  # chain node d -> what its child was drawn from (sampled drafts)
        runner_ups: list[tuple[float, list[int]]] = []  # (estimated chance, path)
        reach = 1.0  # the draft model's probability of the chain so far
        while True:
            probs = torch.softmax(logits, dim=-1)
            top = torch.topk(probs, 2)
            (p1, p2), (t1, t2) = top.values.tolist(), top.indices.tolist()
            if chain and p1 < self.p_min:  # doubted: scored, so it may still take a node left over
                runner_ups.append((reach * p1, [*chain, t1]))
                runner_ups.append((reach * p2, [*chain, t2]))
                break
            token = t1
            if sampling is not None:  # drawn at the request's temperature, tested by rejection (Leviathan et al.)
                row = logits.double().cpu().numpy() / sampling.temperature
                q = np.exp(row - row.max())
                q /= q.sum()
                token = sample(torch.from_numpy(q), sampling.rng.random())
                proposals[len(chain)] = Proposal(self._ids, q, (len(chain) + 1,), (token,))
            other = t2 if token == t1 else t1
            runner_ups.append((reach * float(probs[other]), [*chain, other]))
            chain.append(token)
            reach *= float(probs[token])
            if len(chain) == depth_cap:
                break
            logits = self._feed([token])
        room = budget.max_nodes - 1 - len(chain)
        best = sorted(runner_ups, key=lambda item: -item[0])[: max(room, 0)]
        tree = Tree.from_paths(root, [chain, *(path for _, path in best)], max_nodes=budget.max_nodes)
        # The chain went in first, so its node at depth d is node d.
        return Tree(tree.tokens, tree.parents, proposals) if proposals else tree


def build(target: Any, options: DrafterOptions) -> DraftModelDrafter:
    """The registry's builder of ``draft-model``: ``options.checkpoint`` (``--drafter-path``) names the draft model
    as ``--model`` names a target (a known name, a folder or a ``.gguf`` file); it loads on the target's device in the
    target's dtype, with the runtime and weight format its defaults pick there, and must have the target's
    tokenizer."""
    if not options.checkpoint:
        raise DartspecError(
            "the draft-model drafter needs a draft model: pass --drafter-path MODEL, or in a benchmark row "
            "draft-model:path=MODEL (a smaller model with the target's tokenizer, named as --model names one, e.g. "
            "qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)"
        )
    from dartspec.targets import load_target

    model = load_target(str(options.checkpoint), device=target.device, dtype=target.dtype)
    return DraftModelDrafter(model, target)
