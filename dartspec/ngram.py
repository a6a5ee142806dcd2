"""N-gram models that score draft continuations: a compact static one and an online one.

DART's rule (method.md section 3): p(t | ctx) = count(ctx' t) / count(ctx') at the *longest* suffix ctx'
of the context (up to order-1 tokens) for which ``ctx' t`` was seen; 0 if t was never seen.

The static model is built from token corpora (the target's regenerated answers) and stored as sorted
packed keys with counts, one table per order: queries are vectorised ``searchsorted`` calls, and the
file is a flat binary with a JSON header so it loads with ``np.memmap`` (no parsing, no copy).
The online model counts the current prompt and everything generated so far.
"""

from __future__ import annotations

import functools
import json
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dartspec import atomic
from dartspec.errors import DartspecError

MAGIC = b"DSNGRAM1"
ALIGN = 64


@dataclass(frozen=True)
class BuildStats:
    tokens: int
    entries: int
    bytes: int
    seconds: float


def tokenizer_identity(tokenizer, vocab: dict[str, int] | None = None) -> str:
    """A short id of a tokenizer's vocabulary (``vocab`` where already listed): an n-gram of token ids is meaningless
    under another one."""
    import hashlib

    vocab = tokenizer.get_vocab() if vocab is None else vocab
    h = hashlib.sha256()
    for tok, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}:{tok}\n".encode())
    return f"{len(vocab)}-{h.hexdigest()[:12]}"


def _find(table: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Index of each key in the sorted ``table``, -1 where it is absent."""
    if len(table) == 0:
        return np.full(keys.shape, -1)
    idx = np.minimum(np.searchsorted(table, keys), len(table) - 1)
    return np.where(table[idx] == keys, idx, -1)


@functools.cache
def _c_prob():
    """The C kernel of :meth:`NgramModel.prob` (``ngram.c``), or None where dartspec's kernels cannot be built."""
    from dartspec import exact

    return exact.kernel("dartspec_ngram_prob")


def _address(a: np.ndarray) -> int:
    """Where a C-contiguous array's data starts."""
    return a.__array_interface__["data"][0]


def _pack(windows: np.ndarray, vocab: int) -> np.ndarray:
    """Pack rows of token ids into one uint64 key each (base-``vocab`` number)."""
    key = np.zeros(len(windows), dtype=np.uint64)
    for j in range(windows.shape[1]):
        key = key * np.uint64(vocab) + windows[:, j].astype(np.uint64)
    return key


class NgramModel:
    """Static n-gram counts: for each order n, sorted packed n-gram keys, their counts, and context totals."""

    def __init__(self, order: int, vocab: int, arrays: dict[str, np.ndarray], tokenizer: str = "") -> None:
        if order < 1:
            raise ValueError("order must be >= 1")
        if vocab**order >= 2**63:
            raise DartspecError(f"order {order} with a {vocab}-token vocabulary does not fit 64-bit keys")
        self.order, self.vocab, self.tokenizer = order, vocab, tokenizer
        self.arrays = arrays

    # --- building --------------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        sequences: Iterable[Sequence[int] | np.ndarray],
        *,
        order: int = 3,
        vocab: int,
        tokenizer: str = "",
        min_count: int = 1,
    ) -> tuple[NgramModel, BuildStats]:
        """Count all 1..order grams of ``sequences`` (each counted within its own sequence).

        ``min_count`` drops n-grams (n >= 2) seen fewer times; context totals still count them, so the
        probabilities of the kept n-grams are unchanged and the file shrinks several-fold.
        """
        if min_count < 1:
            raise DartspecError(f"min_count must be >= 1, got {min_count}")
        start = time.perf_counter()
        keys: dict[int, list[np.ndarray]] = {n: [] for n in range(1, order + 1)}
        total = 0
        pending: list[np.ndarray] = []
        pending_len = 0

        def flush() -> None:
            # Reduce each batch to (unique keys, counts) right away so memory stays bounded.
            nonlocal pending, pending_len
            for n in range(1, order + 1):
                parts = [np.lib.stride_tricks.sliding_window_view(s, n) for s in pending if len(s) >= n]
                if parts:
                    u, c = np.unique(_pack(np.concatenate(parts), vocab), return_counts=True)
                    keys[n].append(np.stack([u, c.astype(np.uint64)]))
            pending, pending_len = [], 0

        for seq in sequences:
            arr = np.asarray(seq, dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() >= vocab):
                raise DartspecError(f"token ids must be in [0, {vocab}); got {arr.min()}..{arr.max()}")
            pending.append(arr)
            pending_len += len(arr)
            total += len(arr)
            if pending_len >= 2_000_000:
                flush()
        flush()
        arrays: dict[str, np.ndarray] = {}
        for n in range(1, order + 1):
            if keys[n]:
                merged = np.concatenate(keys[n], axis=1)
                u, inv = np.unique(merged[0], return_inverse=True)
                c = np.zeros(len(u), dtype=np.uint64)
                np.add.at(c, inv, merged[1])
            else:
                u, c = np.zeros(0, np.uint64), np.zeros(0, np.uint64)
            # Context totals: n-grams sharing a context are contiguous in sorted key order.
            ctx = u // np.uint64(vocab)
            cu, first = np.unique(ctx, return_index=True)
            ctxsum = np.add.reduceat(c, first).astype(np.uint64) if len(c) else np.zeros(0, np.uint64)
            if n >= 2 and min_count > 1:
                keep = c >= min_count
                u, c = u[keep], c[keep]
                used = np.isin(cu, u // np.uint64(vocab))
                cu, ctxsum = cu[used], ctxsum[used]
            arrays[f"keys{n}"] = u
            arrays[f"counts{n}"] = c.astype(np.uint32)
            arrays[f"ctx{n}"] = cu
            arrays[f"ctxsum{n}"] = ctxsum
        model = cls(order, vocab, arrays, tokenizer)
        entries = sum(len(arrays[f"keys{n}"]) for n in range(1, order + 1))
        nbytes = sum(a.nbytes for a in arrays.values())
        return model, BuildStats(total, entries, nbytes, time.perf_counter() - start)

    # --- storage ---------------------------------------------------------------------------------

    def save(self, path: str | Path) -> int:
        """Write atomically; returns the file size in bytes."""
        path = Path(path)
        specs, offset = [], 0
        for name, arr in self.arrays.items():
            offset = -(-offset // ALIGN) * ALIGN
            specs.append({"name": name, "dtype": arr.dtype.str, "length": len(arr), "offset": offset})
            offset += arr.nbytes
        header = json.dumps(
            {"order": self.order, "vocab": self.vocab, "tokenizer": self.tokenizer, "arrays": specs}
        ).encode()
        head_len = -(-(len(MAGIC) + 8 + len(header)) // ALIGN) * ALIGN
        with atomic.atomic_path(path) as tmp, open(tmp, "wb") as f:
            f.write(MAGIC + len(header).to_bytes(8, "little") + header)
            f.write(b"\0" * (head_len - f.tell()))
            for spec, arr in zip(specs, self.arrays.values(), strict=True):
                f.write(b"\0" * (head_len + spec["offset"] - f.tell()))
                f.write(np.ascontiguousarray(arr).tobytes())
        return path.stat().st_size

    @classmethod
    def load(cls, path: str | Path, *, tokenizer: str | None = None) -> NgramModel:
        """Memory-map a saved model; a damaged file or another tokenizer raises DartspecError."""
        path = Path(path)
        try:
            with open(path, "rb") as f:
                magic = f.read(len(MAGIC))
                if magic != MAGIC:
                    raise DartspecError(f"{path} is not a dartspec n-gram file")
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            size = path.stat().st_size
            head_len = -(-(len(MAGIC) + 8 + n) // ALIGN) * ALIGN
            arrays = {}
            for spec in header["arrays"]:
                dtype = np.dtype(spec["dtype"])
                end = head_len + spec["offset"] + spec["length"] * dtype.itemsize
                if end > size:
                    raise DartspecError(f"{path} is truncated ({size} bytes, needs {end}); rebuild it")
                arrays[spec["name"]] = (
                    np.memmap(path, dtype=dtype, mode="r", offset=head_len + spec["offset"], shape=(spec["length"],))
                    if spec["length"]
                    else np.zeros(0, dtype)
                )
        except (OSError, ValueError, KeyError, UnicodeDecodeError) as err:
            raise DartspecError(f"{path} is not a readable n-gram file ({type(err).__name__}); rebuild it") from None
        if tokenizer is not None and header.get("tokenizer") and header["tokenizer"] != tokenizer:
            raise DartspecError(f"{path} was built for another tokenizer ({header['tokenizer']}, not {tokenizer})")
        return cls(int(header["order"]), int(header["vocab"]), arrays, header.get("tokenizer", ""))

    # --- queries ---------------------------------------------------------------------------------

    def _lookup(self, table: str, keys: np.ndarray) -> np.ndarray:
        return _find(self.arrays[table], keys)

    @functools.cached_property
    def _joined(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every order's tables in one sorted array each, so that a query searches once, not once per order:
        order n's n-gram keys (< V^n) are shifted by V + ... + V^(n-1) and its context keys (< V^(n-1)) by
        1 + V + ... + V^(n-2), which puts each order in a range of its own (the sums stay below 2^64 wherever a
        model's keys fit 63 bits). Returns (keys, counts, contexts, context totals, key shift, context shift),
        the shifts per order, longest first."""
        V = np.uint64(self.vocab)
        key_shift = [np.uint64(0)] * (self.order + 1)
        ctx_shift = [np.uint64(0)] * (self.order + 1)
        for n in range(2, self.order + 1):
            key_shift[n] = key_shift[n - 1] + V ** np.uint64(n - 1)
            ctx_shift[n] = ctx_shift[n - 1] + V ** np.uint64(n - 2)
        orders = range(1, self.order + 1)
        a = self.arrays
        keys = np.concatenate([a[f"keys{n}"].astype(np.uint64) + key_shift[n] for n in orders])
        ctx = np.concatenate([a[f"ctx{n}"].astype(np.uint64) + ctx_shift[n] for n in orders])
        counts = np.concatenate([a[f"counts{n}"] for n in orders]).astype(np.float64)
        totals = np.concatenate([a[f"ctxsum{n}"] for n in orders]).astype(np.float64)
        longest_first = slice(self.order, 0, -1)
        return keys, counts, ctx, totals, np.array(key_shift[longest_first]), np.array(ctx_shift[longest_first])

    def prob(self, contexts: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        """DART's longest-context probability for a batch: for each candidate, ``c(ctx, t) / c(ctx)`` with the
        longest context of at most ``order - 1`` preceding tokens under which ``(ctx, t)`` was counted.

        Args:
            contexts: ``(B, order-1)`` preceding token ids (use -1 for missing positions; fewer columns are
                missing positions on the left).
            candidates: ``(B, K)`` token ids.
        Returns:
            ``(B, K)`` probabilities (0 where the token was never seen).
        """
        cand = np.asarray(candidates, dtype=np.int64)
        B, width = len(cand), self.order - 1
        given = np.asarray(contexts, dtype=np.int64).reshape(B, -1)
        ctx = np.full((B, width), -1, dtype=np.int64)
        take = min(width, given.shape[1])
        if take:
            ctx[:, width - take :] = given[:, given.shape[1] - take :]
        keys, _, _, totals, _, _ = self._joined
        if not len(keys) or not len(totals):  # nothing was counted
            return np.zeros(cand.shape)
        kernel = _c_prob()
        if kernel is None:
            return self._prob_numpy(ctx, cand)
        cand = np.ascontiguousarray(cand)
        out = np.empty(cand.shape)
        kernel(*self._c_tables, _address(ctx), _address(cand), B, cand.shape[1], _address(out))
        return out

    @functools.cached_property
    def _c_tables(self) -> tuple[int, ...]:
        """The joined tables as the C kernel's first arguments (addresses, taken once: ``.ctypes`` costs ~5 us)."""
        keys, counts, ctx_keys, totals, key_shift, ctx_shift = self._joined
        a = _address
        return (
            a(keys),
            a(counts),
            len(keys),
            a(ctx_keys),
            a(totals),
            len(ctx_keys),
            a(key_shift),
            a(ctx_shift),
            self.order,
            self.vocab,
        )

    def _prob_numpy(self, ctx: np.ndarray, cand: np.ndarray) -> np.ndarray:
        """:meth:`prob` in numpy (where the C kernels cannot be built; the reference they are tested against):
        ``ctx`` ``(B, order-1)`` padded with -1 on the left, ``cand`` ``(B, K)``, tables not empty (:meth:`prob`
        answers zeros for those)."""
        B = len(cand)
        keys, counts, ctx_keys, totals, key_shift, ctx_shift = self._joined
        width = self.order - 1
        V = np.uint64(self.vocab)
        # Context keys per order, longest first: the last n-1 tokens packed (order 1: the empty context, 0).
        packed = np.zeros((self.order, B), dtype=np.uint64)
        valid = np.ones((self.order, B), dtype=bool)
        scale = np.uint64(1)
        for j in range(1, self.order):  # the j-th token back is in the contexts of orders j + 1 and up
            token = ctx[:, width - j]
            packed[: self.order - j] += np.where(token < 0, 0, token).astype(np.uint64) * scale
            valid[: self.order - j] &= token >= 0
            scale *= V
        full = (packed * V + key_shift[:, None])[:, :, None] + cand.astype(np.uint64)
        hit = _find(keys, full)
        ctx_hit = _find(ctx_keys, packed + ctx_shift[:, None])
        use = (hit >= 0) & ((ctx_hit >= 0) & valid)[:, :, None]
        first = np.argmax(use, axis=0)  # the longest order that saw (ctx, t)
        rows = np.arange(B)[:, None]
        chosen_hit = hit[first, rows, np.arange(cand.shape[1])]
        chosen_ctx = ctx_hit[first, rows]
        p = counts[np.maximum(chosen_hit, 0)] / np.maximum(totals[np.maximum(chosen_ctx, 0)], 1)
        return np.where(use.any(axis=0), p, 0.0)

    def prob_interpolated(self, contexts: np.ndarray, candidates: np.ndarray, smoothing: float) -> np.ndarray:
        """The smoothed variant: interpolate every order that saw the context (Jelinek-Mercer).

        ``p_n = (1 - smoothing) * c(ctx_n, t) / c(ctx_n) + smoothing * p_{n-1}``, from a uniform ``p_0``
        up to the longest context; an order whose context was never seen passes ``p_{n-1}`` through.
        Unlike the longest-context rule, unseen tokens keep a small probability.
        """
        if not 0.0 < smoothing < 1.0:
            raise DartspecError(f"n-gram smoothing must be in (0, 1), got {smoothing}")
        contexts = np.asarray(contexts, dtype=np.int64).reshape(len(candidates), -1)
        cand = np.asarray(candidates, dtype=np.int64)
        out = np.full(cand.shape, 1.0 / self.vocab)
        V = np.uint64(self.vocab)
        for n in range(1, self.order + 1):
            k = n - 1
            if k > contexts.shape[1]:
                break
            if len(self.arrays[f"keys{n}"]) == 0:  # nothing of this order was counted
                continue
            ctx_tokens = contexts[:, contexts.shape[1] - k :] if k else contexts[:, :0]
            valid = (ctx_tokens >= 0).all(axis=1) if k else np.ones(len(cand), dtype=bool)
            ctx_key = (
                _pack(np.where(ctx_tokens < 0, 0, ctx_tokens), self.vocab) if k else np.zeros(len(cand), np.uint64)
            )
            hit = self._lookup(f"keys{n}", ctx_key[:, None] * V + cand.astype(np.uint64))
            ctx_hit = self._lookup(f"ctx{n}", ctx_key)
            seen = valid & (ctx_hit >= 0)
            counts = np.where(hit >= 0, self.arrays[f"counts{n}"][np.where(hit >= 0, hit, 0)], 0).astype(np.float64)
            totals = self.arrays[f"ctxsum{n}"][np.where(ctx_hit >= 0, ctx_hit, 0)].astype(np.float64)
            mixed = (1 - smoothing) * counts / np.maximum(totals[:, None], 1) + smoothing * out
            out = np.where(seen[:, None], mixed, out)
        return out


class SmoothedNgram:
    """A static n-gram scored with :meth:`NgramModel.prob_interpolated` (same interface as the others)."""

    def __init__(self, model: NgramModel, smoothing: float) -> None:
        if not 0.0 < smoothing < 1.0:
            raise DartspecError(f"n-gram smoothing must be in (0, 1), got {smoothing}")
        self.model, self.smoothing, self.order = model, smoothing, model.order

    def prob(self, contexts: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        return self.model.prob_interpolated(contexts, candidates, self.smoothing)


class OnlineNgram:
    """Counts over the current prompt and generated text, updated token by token."""

    def __init__(self, order: int = 3) -> None:
        self.order = order
        self.counts: dict[tuple[int, ...], dict[int, int]] = defaultdict(dict)
        self.totals: dict[tuple[int, ...], int] = defaultdict(int)
        self.history: list[int] = []

    def reset(self) -> None:
        self.counts.clear()
        self.totals.clear()
        self.history = []

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            t = int(t)
            h = self.history
            for k in range(0, min(self.order - 1, len(h)) + 1):
                ctx = tuple(h[len(h) - k :]) if k else ()
                row = self.counts[ctx]
                row[t] = row.get(t, 0) + 1
                self.totals[ctx] += 1
            h.append(t)

    def prob(self, contexts: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        """Same rule and shapes as :meth:`NgramModel.prob`."""
        cand = np.asarray(candidates, dtype=np.int64)
        out = np.zeros(cand.shape)
        for b, ctx_row in enumerate(np.asarray(contexts, dtype=np.int64).reshape(len(cand), -1)):
            ctx_row = [int(x) for x in ctx_row if x >= 0]
            rows = []
            for k in range(min(self.order - 1, len(ctx_row)), -1, -1):
                ctx = tuple(ctx_row[len(ctx_row) - k :]) if k else ()
                if ctx in self.counts:
                    rows.append((self.counts[ctx], self.totals[ctx]))
            for j, t in enumerate(cand[b].tolist()):
                for row, total in rows:
                    c = row.get(t)
                    if c:
                        out[b, j] = c / total
                        break
        return out


class MergedNgram:
    """Static and online n-grams together: the larger of the two probabilities.

    The max (rather than a mixture) lets a continuation copied from the prompt score as high as the
    online counts say, without diluting what the static corpus knows elsewhere.
    """

    def __init__(self, static: NgramModel | SmoothedNgram | None, online: OnlineNgram | None) -> None:
        self.static, self.online = static, online
        self.order = max(m.order for m in (static, online) if m is not None)

    def prob(self, contexts: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        parts = [m.prob(contexts, candidates) for m in (self.static, self.online) if m is not None]
        return np.maximum.reduce(parts) if len(parts) > 1 else parts[0]
