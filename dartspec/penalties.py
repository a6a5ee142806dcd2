"""Penalties and logit bias on a draft tree's logits, each node with its own history.

A penalty depends on what came before a position, so in a tree every node sees a different history: the committed
tokens, then the draft tokens on its path from the root. Row i of a verify forward predicts the token after node i,
so it is adjusted as plain decoding would adjust it after committing that path: the committed history's part is one
vector for all rows, and each row's path adds at most its depth (token, count) corrections. The verifier then walks
the adjusted rows as it walks raw ones, so speculative decoding under penalties commits exactly what plain decoding
under them would (:class:`dartspec.sampling.Penalties` says what each penalty does).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dartspec.sampling import Penalties
from dartspec.tree import Tree


class PenaltyState:
    """One sequence's penalties and the history they read (prompt and answer), kept as vectors over the vocabulary
    once the first logits show its width and device."""

    def __init__(self, penalties: Penalties, prompt_ids: Sequence[int]) -> None:
        self.penalties = penalties
        self._pending: list[list[int]] = [list(prompt_ids), []]  # prompt, answer: until the vectors exist
        self._width = 0
        # Bad words of one token are always impossible (in the bias vector); longer ones are looked for at the end of
        # each row's history, of which the answer's last tokens are kept
        self._bad_ends = [(seq[:-1], seq[-1]) for seq in penalties.bad_words if len(seq) > 1]
        self._keep = max((len(start) for start, _ in self._bad_ends), default=0)
        self._tail: list[int] = []

    def _build(self, logits: torch.Tensor) -> None:
        width, device = logits.shape[-1], logits.device
        prompt, answer = self._pending
        # float64: the penalties are then computed as exactly as a float64 reference does, and cast to the rows' dtype
        self.counts = torch.zeros(width, dtype=torch.float64, device=device)  # answer occurrences
        self.seen = torch.zeros(width, dtype=torch.bool, device=device)  # in the prompt or the answer
        self.seen[torch.tensor(prompt, dtype=torch.long, device=device)] = True
        self.bias = None
        single = [seq[0] for seq in self.penalties.bad_words if len(seq) == 1]
        if self.penalties.logit_bias or self.penalties.allowed is not None or single:
            self.bias = torch.zeros(width, dtype=torch.float64, device=device)
        if self.penalties.logit_bias:
            ids, values = zip(*self.penalties.logit_bias, strict=True)
            self.bias[torch.tensor(ids, device=device)] = torch.tensor(values, dtype=torch.float64, device=device)
        if self.penalties.allowed is not None:
            # -inf for the tokens allowed_token_ids leaves out: every later step (a repetition penalty's product or
            # quotient, the frequency and presence subtractions) keeps it -inf, so it is the mask applied last
            banned = torch.ones(width, dtype=torch.bool, device=device)
            banned[torch.tensor(self.penalties.allowed, device=device)] = False
            self.bias[banned] = float("-inf")
        if single:  # -inf, as allowed_token_ids' mask: nothing later makes it finite
            self.bias[torch.tensor(single, device=device)] = float("-inf")
        self._width = width
        self._add(answer)

    def _add(self, tokens: Sequence[int]) -> None:
        index = torch.tensor(list(tokens), dtype=torch.long, device=self.counts.device)
        self.counts.index_add_(0, index, torch.ones(len(tokens), dtype=self.counts.dtype, device=self.counts.device))
        self.seen[index] = True

    def commit(self, tokens: Sequence[int]) -> None:
        """``tokens`` joined the answer."""
        if self._keep:
            self._tail = (self._tail + list(tokens))[-self._keep :]
        if self._width:
            self._add(tokens)
        else:
            self._pending[1].extend(tokens)

    def _base_penalty(self, counts: torch.Tensor) -> torch.Tensor:
        """What the frequency and presence penalties subtract for these answer counts."""
        p = self.penalties
        return p.frequency * counts + p.presence * (counts > 0).to(counts.dtype)

    def _repeat(self, values: torch.Tensor) -> torch.Tensor:
        r = self.penalties.repetition
        return torch.where(values < 0, values * r, values / r)

    def __call__(self, logits: torch.Tensor, tree: Tree | None = None) -> torch.Tensor:
        """``logits`` ``(rows, vocab)`` adjusted (a new tensor, float32 or wider, as transformers' ``generate``):
        row i as after node i of ``tree`` (None: rows after the committed history alone)."""
        if not self._width:
            self._build(logits)
        p = self.penalties
        x = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
        if self.bias is not None:
            x += self.bias.to(x.dtype)
        if p.repetition != 1:
            seen = self.seen.nonzero()[:, 0]
            x[:, seen] = self._repeat(x[:, seen])
        if self._bad_ends:
            self._ban_word_ends(x, tree)
        rows, tokens, extra = _path_counts(tree, x.shape[-1])
        if rows is None:
            if p.frequency or p.presence:
                x -= self._base_penalty(self.counts).to(x.dtype)
            return x
        rows_t = torch.from_numpy(rows).to(x.device)
        tokens_t = torch.from_numpy(tokens).to(x.device)
        # The path's tokens: the repetition penalty where the committed history lacks them, then the frequency and
        # presence penalties of the count with the path's occurrences (the vector below has only the history's).
        before = x[rows_t, tokens_t]
        if p.repetition != 1:
            before = torch.where(self.seen[tokens_t], before, self._repeat(before))
        if p.frequency or p.presence:
            x -= self._base_penalty(self.counts).to(x.dtype)
            counts = self.counts[tokens_t] + torch.from_numpy(extra).to(x.device, self.counts.dtype)
            before = before - self._base_penalty(counts).to(x.dtype)
        x[rows_t, tokens_t] = before
        return x

    def _ban_word_ends(self, x: torch.Tensor, tree: Tree | None) -> None:
        """-inf for each bad word's last token in the rows whose history (the answer, then the row's path below the
        root) ends with the rest of the word."""
        rows, cols = [], []
        for row in range(x.shape[0]):
            history = self._tail
            if tree is not None and tree.size > 1:
                path = np.nonzero(tree.ancestors[row, 1:])[0] + 1  # nodes come after their parents
                history = history + tree.tokens[path].tolist()
            for start, last in self._bad_ends:
                if len(history) >= len(start) and tuple(history[len(history) - len(start) :]) == start:
                    rows.append(row)
                    cols.append(last)
        if rows:
            x[torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device)] = float("-inf")


def _path_counts(tree: Tree | None, width: int) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """For each row of ``tree`` and token on the row's path below the root (the root is committed), the times it
    occurs there: ``(rows, tokens, counts)``, each (row, token) once; rows None where no row has a path."""
    if tree is None or tree.size == 1:
        return None, np.empty(0, np.int64), np.empty(0, np.int64)
    rows, nodes = np.nonzero(tree.ancestors[:, 1:])
    keys, counts = np.unique(rows * width + tree.tokens[nodes + 1], return_counts=True)
    return keys // width, keys % width, counts
