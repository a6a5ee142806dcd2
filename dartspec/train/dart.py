"""Online training of a DART drafter against a frozen target.

Each step the target scores a few regenerated sequences without gradients (features + logits, nothing
cached to disk), and the drafter is trained on many anchor blocks per sequence in one forward
(:mod:`dartspec.train.dart_loss`). AdamW, cosine schedule with warmup, gradient clipping. Checkpoints
are written atomically and hold everything needed to continue exactly: drafter, optimizer,
scheduler, data position and RNG states.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dartspec import atomic
from dartspec.drafters.dart_model import DartConfig, DartModel, init_head_from_target
from dartspec.errors import DartspecError
from dartspec.train.evaluate import Objective, batch_loss, depth_accuracy, model_objective

STATE_FILE = "train_state.pt"
#: ``fit_schedule`` measures the step time over at least this many steps (and the warmup) before planning, and
#: plans for this fraction of the time left (evaluations and the last checkpoint take the rest).
PLAN_AFTER_STEPS = 10
PLAN_EVERY_STEPS = 50  # then re-planned this often on the speed since the last plan
PLAN_MARGIN = 0.93
LOG_FILE = "train_log.jsonl"
PRECISIONS = ("auto", "bf16", "fp32", "bf16-drafter")


@dataclass(frozen=True)
class Sample:
    """One training sequence: prompt + regenerated answer token ids."""

    tokens: np.ndarray
    prompt_len: int
    index: int = -1


@dataclass
class TrainConfig:
    """Hyper-parameters; also read from ``--config train.yaml`` (same keys)."""

    depth: int = 8
    num_layers: int = 1
    feature_layers: list[int] | None = None  # target layers whose inputs are fused (None: 2, N//2, N-3)
    draft_vocab_size: int = 8192
    lr: float = 5e-4
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 50
    epochs: float = 1.0
    max_steps: int = 0  # 0 = derived from epochs
    grad_clip: float = 0.5
    max_seq_len: int = 1024
    seqs_per_step: int = 4
    # Sequences per batched forward: 0 = auto (the whole step's batch on CUDA; one at a time on CPU, where
    # `dartspec bench train` measured packing slower: 0.62x, the padded attention outweighs the saved calls).
    pack: int = 0
    # bf16 (autocast over the target's scoring and the drafter), fp32, or bf16-drafter (autocast over the drafter's
    # training forward only: the target's features and logits stay what the runtime serves); auto: see
    # resolve_precision (bf16 on CUDA; bf16-drafter on a CPU with bf16 instructions, measured 1.27x; else fp32).
    precision: str = "auto"
    # A folder for the fp16 feature cache (train/feature_cache.py): epochs after the first skip the target.
    # Empty: off (the default; the cache rounds the target's values to fp16, which the online path does not).
    feature_cache: str = ""
    # Sequences of similar length share a step: each epoch's shuffled order is cut into windows of this many steps,
    # each window sorted by length and its steps shuffled, so that a packed forward pads little (on the committed
    # data 92% of its slots are real tokens at 16, 48% in the plain order). 0 = auto: 16 where a step is packed into
    # one forward (CUDA), 1 (the plain shuffled order) where sequences run one at a time and never pad (CPU).
    length_sort_steps: int = 0
    anchors_per_seq: int = 128
    loss: str = "kl"
    depth_decay: float = 0.6
    checkpoint_every: int = 50
    eval_every: int = 100
    eval_samples: int = 48
    seed: int = 0
    init: str | None = None  # start from this drafter checkpoint (warm start) instead of a fresh network
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.loss not in ("kl", "ce"):
            raise DartspecError(f"training option loss must be kl or ce, got {self.loss!r}")
        if self.precision not in PRECISIONS:
            raise DartspecError(
                f"training option precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
            )
        for name in ("pack", "length_sort_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise DartspecError(f"training option {name} must be an integer >= 0, got {getattr(self, name)!r}")
        for name in (
            "depth",
            "num_layers",
            "draft_vocab_size",
            "seqs_per_step",
            "anchors_per_seq",
            "max_seq_len",
            "checkpoint_every",
            "eval_every",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise DartspecError(f"training option {name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("lr", "grad_clip", "depth_decay"):
            if not getattr(self, name) > 0:
                raise DartspecError(f"training option {name} must be positive, got {getattr(self, name)!r}")
        if self.max_steps < 0 or self.epochs <= 0 or self.warmup_steps < 0 or self.eval_samples < 0:
            raise DartspecError("training options max_steps, warmup_steps and eval_samples must be >= 0, epochs > 0")
        if self.feature_layers is not None and (
            not self.feature_layers or not all(isinstance(i, int) and i >= 0 for i in self.feature_layers)
        ):
            raise DartspecError(f"training option feature_layers must list layer numbers, got {self.feature_layers!r}")

    @classmethod
    def from_file(cls, path: str | Path) -> TrainConfig:
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise DartspecError(f"cannot read training config {path}: {err}") from None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DartspecError(f"{path}: unknown training options {unknown}; known: {sorted(known)}")
        if "betas" in data:
            data["betas"] = tuple(data["betas"])
        for f in fields(cls):
            # YAML 1.1 reads 2e-5 (no dot) as a string.
            if f.type == "float" and isinstance(data.get(f.name), str):
                try:
                    data[f.name] = float(data[f.name])
                except ValueError:
                    raise DartspecError(f"{path}: {f.name} must be a number, got {data[f.name]!r}") from None
        try:
            return cls(**data)
        except TypeError as err:  # e.g. a string where a number belongs
            raise DartspecError(f"{path}: a training option has the wrong type ({err})") from None


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX): without it, bf16 matrix products are emulated
    and slower than fp32 (measured 2.5-4.5x slower on an AVX2-only CPU). torch's probes are private: a missing one
    counts as no."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def resolve_precision(precision: str, device: torch.device) -> str:
    """What ``precision: auto`` means on ``device``: bf16 autocast on CUDA; on a CPU with bf16 instructions
    ``bf16-drafter`` (the drafter's training forward only, 1.27x on 2 cores, the target's values untouched);
    otherwise fp32. Explicit settings are returned as they are."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16"
    return "bf16-drafter" if device.type == "cpu" and cpu_has_bf16() else "fp32"


def choose_draft_vocab(samples: Sequence[Sample], size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent answer tokens (sorted ids) and the share of answer tokens they cover."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in samples:
        np.add.at(counts, s.tokens[s.prompt_len :].astype(np.int64), 1)
    size = min(size, vocab_size)
    top = np.argsort(-counts, kind="stable")[:size]
    coverage = float(counts[top].sum() / max(counts.sum(), 1))
    return torch.from_numpy(np.sort(top)).long(), coverage


def held_out_coverage(samples: Sequence[Sample], draft_ids: torch.Tensor) -> float:
    """Share of answer tokens of ``samples`` inside the draft vocabulary."""
    keep = np.zeros(int(draft_ids.max()) + 1 if len(draft_ids) else 1, dtype=bool)
    keep[draft_ids.numpy()] = True
    answers = np.concatenate([s.tokens[s.prompt_len :].astype(np.int64) for s in samples]) if samples else np.zeros(0)
    inside = answers[answers < len(keep)]
    return float(keep[inside].sum() / max(len(answers), 1))


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class DartTrainer:
    """Trains a DART drafter for ``target`` on regenerated samples; resumable at step granularity.

    Subclasses train other drafters on the same data, loop and checkpoints by replacing ``model_cls``
    (the objective follows the model's kind, :func:`~dartspec.train.evaluate.model_objective`; see
    :mod:`dartspec.train.eagle3`).
    """

    name = "dart"
    model_cls: type[DartModel] = DartModel

    def __init__(
        self,
        target: Any,
        train: Sequence[Sample],
        dev: Sequence[Sample],
        out: str | Path,
        cfg: TrainConfig,
        log: Callable[[str], None] = print,
    ) -> None:
        if not train:
            raise DartspecError("no training samples: regenerate data first (dartspec data regenerate)")
        self.target = target
        self.train = train
        self.dev = list(dev)[: cfg.eval_samples]
        self.out = Path(out)
        self.cfg = cfg
        self.log = log
        self._feature_cache: Any = None
        self._fingerprint = self.data_fingerprint()
        self.steps_per_epoch = math.ceil(len(train) / cfg.seqs_per_step)
        self.total_steps = cfg.max_steps or max(1, int(cfg.epochs * self.steps_per_epoch))
        self.step = 0
        self.epoch = 0
        self.position = 0  # samples consumed in the current epoch's permutation
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.sort_steps = cfg.length_sort_steps or (16 if self._pack(cfg.seqs_per_step) > 1 else 1)
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its sample order), made once per epoch
        self.model: DartModel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        target.set_feature_layers(cfg.feature_layers)

    # --- setup -----------------------------------------------------------------------------------

    def build(self) -> None:
        """A fresh network (or the ``init`` checkpoint's) and optimizer: what step 0 of :meth:`fit` starts from."""
        if self.cfg.init:
            self._build_from(self.cfg.init)
            return
        draft_ids, coverage = choose_draft_vocab(self.train, self.cfg.draft_vocab_size, self.target.vocab_size)
        mcfg = DartConfig.for_target(
            self.target, draft_vocab_size=len(draft_ids), depth=self.cfg.depth, num_layers=self.cfg.num_layers
        )
        mcfg.extra["draft_vocab_coverage"] = round(coverage, 5)
        if self.dev:
            dev_cov = held_out_coverage(self.dev, draft_ids)
            mcfg.extra["draft_vocab_dev_coverage"] = round(dev_cov, 5)
            self.log(f"draft vocabulary covers {dev_cov:.2%} of dev answer tokens")
        torch.manual_seed(self.cfg.seed)
        model = self.model_cls(mcfg).to(self.target.device)
        init_head_from_target(model, self.target, draft_ids)
        self.model = model
        self.optimizer = self._optimizer(model)
        self.log(f"draft vocabulary: {len(draft_ids)} tokens covering {coverage:.2%} of answer tokens")

    def _build_from(self, folder: str) -> None:
        """Warm start: the network and draft vocabulary of an existing checkpoint, a fresh optimizer."""
        model = self.load_init(folder)
        if self.cfg.feature_layers is not None and list(model.cfg.feature_layers) != list(self.cfg.feature_layers):
            raise DartspecError(
                f"--init {folder} reads target layers {list(model.cfg.feature_layers)}; the training config asks "
                f"for {list(self.cfg.feature_layers)}"
            )
        self.target.set_feature_layers(model.cfg.feature_layers)
        if model.cfg.depth != self.cfg.depth or model.cfg.num_layers != self.cfg.num_layers:
            raise DartspecError(
                f"--init {folder} has depth {model.cfg.depth} and {model.cfg.num_layers} layer(s); the training "
                f"config asks for depth {self.cfg.depth} and {self.cfg.num_layers}"
            )
        if self.dev:
            dev_cov = held_out_coverage(self.dev, model.d2t.cpu())
            self.log(f"draft vocabulary (from {folder}) covers {dev_cov:.2%} of dev answer tokens")
        self.model = model
        self.optimizer = self._optimizer(model)

    def _optimizer(self, model: DartModel) -> torch.optim.Optimizer:
        # Fused on a GPU: one kernel for all parameters, its step counters kept on the device (the default keeps
        # them on the host and reads them every step).
        return torch.optim.AdamW(
            model.parameters(),
            lr=self.cfg.lr,
            betas=self.cfg.betas,
            weight_decay=self.cfg.weight_decay,
            fused=self.target.device.type == "cuda" or None,
        )

    def load_init(self, folder: str) -> DartModel:
        """The network to warm-start from (float32, on the target's device; checked against the target)."""
        return self.model_cls.load(folder, device=self.target.device, dtype=torch.float32, target=self.target)

    def _permutation(self, epoch: int) -> np.ndarray:
        """The order of the samples in ``epoch``: shuffled, then sorted by length within windows of
        ``sort_steps`` steps whose steps are shuffled again (see ``TrainConfig.length_sort_steps``)."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        rng = np.random.default_rng(self.cfg.seed + 1000 * epoch)
        order = rng.permutation(len(self.train))
        k = self.cfg.seqs_per_step
        if self.sort_steps > 1:
            lengths = np.array([min(len(s.tokens), self.cfg.max_seq_len) for s in self.train])
            parts = []
            for first in range(0, len(order), self.sort_steps * k):
                window = order[first : first + self.sort_steps * k]
                window = window[np.argsort(lengths[window], kind="stable")]
                steps = [window[i : i + k] for i in range(0, len(window), k)]
                parts += [steps[i] for i in rng.permutation(len(steps))]
            order = np.concatenate(parts)
        self._order = (epoch, order)
        return order

    # --- checkpoints -----------------------------------------------------------------------------

    def data_fingerprint(self) -> str:
        """What identifies the training data: every sample's tokens and prompt length, in order."""
        digest = hashlib.sha256()
        for sample in self.train:
            digest.update(np.asarray(sample.tokens, dtype=np.int64).tobytes())
            digest.update(int(sample.prompt_len).to_bytes(8, "little"))
        return digest.hexdigest()[:16]

    def save(self) -> None:
        """One atomic checkpoint: ``train_state.pt`` holds everything a resume needs (the network's fp32 weights,
        optimizer, data position, RNG, config, data fingerprint) and is replaced in one rename after an fsync, so
        a crash leaves the previous checkpoint or the new one, never a mix. The drafter is then exported beside it
        (``config.json`` + ``model.safetensors``, what ``--drafter-path`` loads); resume never reads the export."""
        assert self.model is not None and self.optimizer is not None
        state = {
            "step": self.step,
            "epoch": self.epoch,
            "position": self.position,
            "sort_steps": self.sort_steps,
            "total_steps": self.total_steps,
            "model_config": self.model.cfg.to_json(),
            "model": {k: v.detach().to("cpu", torch.float32).clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "generator": self.gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "config": json.dumps(asdict(self.cfg)),
            "data": self._fingerprint,
        }
        with atomic.atomic_path(self.out / STATE_FILE) as tmp:
            torch.save(state, tmp)
        self.model.save(self.out, dtype=torch.float32)

    def resume(self, *, new_data: bool = False) -> None:
        """Continue exactly from ``train_state.pt``; ``new_data`` allows other training data than the run's."""
        path = self.out / STATE_FILE
        if not path.is_file():
            raise DartspecError(f"nothing to resume in {self.out} ({STATE_FILE} not found)")
        try:
            state = torch.load(path, weights_only=True)
        except Exception as err:  # torch raises many types for a damaged file
            raise DartspecError(f"{path} is corrupted ({type(err).__name__}); start again without --resume") from None
        needed = ("step", "epoch", "position", "total_steps", "optimizer", "generator", "torch_rng", "config")
        missing = [k for k in needed if k not in state]
        if missing:
            raise DartspecError(f"{path} is incomplete (no {', '.join(missing)}); start again without --resume")
        saved = json.loads(state["config"])
        saved["betas"] = tuple(saved["betas"])
        now = asdict(self.cfg)
        # Settings that change speed, not what is learned, may differ (older runs did not record them).
        free = ("extra", "checkpoint_every", "eval_every", "pack", "precision", "feature_cache", "length_sort_steps")
        changed = [k for k in now if k not in free and saved.get(k) != now[k]]
        # The data order goes on as the run made it (runs from before length sorting: the plain order); auto
        # takes it, a number must match it.
        sort_steps = int(state.get("sort_steps", 1))
        if self.cfg.length_sort_steps not in (0, sort_steps):
            changed.append("length_sort_steps")
        if changed:
            raise DartspecError(f"the checkpoint in {self.out} was trained with different settings: {changed}")
        self.sort_steps, self._order = sort_steps, None
        if state.get("data") not in (None, self._fingerprint) and not new_data:
            raise DartspecError(
                f"the run in {self.out} was trained on other data (fingerprint {state['data']}, now "
                f"{self._fingerprint}): pass --new-data to continue it on this data"
            )
        if "model" in state:
            cfg = DartConfig.from_json(state["model_config"], str(path), self.model_cls.FORMAT)
            self.model = self.model_cls(cfg)
            self.model.load_state_dict(state["model"])
            self.model.to(self.target.device)
        else:  # checkpoints written before the state carried the weights
            self.model = self.model_cls.load(
                self.out, device=self.target.device, dtype=torch.float32, target=self.target
            )
        self.model.check_target(self.target)
        self.target.set_feature_layers(self.model.cfg.feature_layers)
        self.optimizer = self._optimizer(self.model)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.epoch, self.position = state["step"], state["epoch"], state["position"]
        self.total_steps = state["total_steps"]
        self.gen.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        self.log(f"resumed from step {self.step} (epoch {self.epoch}, sample {self.position})")

    def _cut_log(self, step: int) -> None:
        """Drop log lines of steps after ``step`` (logged before a crash, then redone by the resume)."""
        path = self.out / LOG_FILE
        if not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a torn last line
        atomic.write_text(path, "".join(f"{x}\n" for x in kept))

    # --- steps -----------------------------------------------------------------------------------

    def _batch(self) -> list[Sample]:
        batch = []
        while len(batch) < self.cfg.seqs_per_step:
            perm = self._permutation(self.epoch)
            if self.position >= len(perm):
                self.epoch += 1
                self.position = 0
                continue
            batch.append(self.train[int(perm[self.position])])
            self.position += 1
        return batch

    def objective(self, anchors: int) -> Objective:
        """The loss of one scored sequence: the model kind's objective (DART: ``anchors`` anchor blocks)."""
        assert self.model is not None
        return model_objective(self.model, anchors=anchors, decay=self.cfg.depth_decay, kind=self.cfg.loss)

    def _pack(self, batch: int) -> int:
        """Sequences per forward for a batch of ``batch`` (see ``TrainConfig.pack``)."""
        if self.cfg.pack:
            return self.cfg.pack
        return batch if self.target.device.type == "cuda" else 1

    def _autocast(self, *, drafter_only: bool = False) -> contextlib.AbstractContextManager:
        """bf16 autocast where ``precision`` asks for it: ``bf16`` (``auto`` on CUDA) over the target's scoring and
        the drafter's forward; ``bf16-drafter`` over the drafter's training forward only (``drafter_only``)."""
        device = self.target.device
        precision = resolve_precision(self.cfg.precision, device)
        bf16 = precision == "bf16" or (precision == "bf16-drafter" and drafter_only)
        return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def _drafter_autocast(self, objective: Objective) -> Objective:
        """``objective`` under :meth:`_autocast` for the drafter's training forward (the backward follows the
        forward's dtypes; the fp32 master weights and AdamW's state are untouched)."""

        def run(*args: Any) -> Any:
            with self._autocast(drafter_only=True):
                return objective(*args)

        return run

    def scorer(self) -> Any:
        """What scores the training sequences: the target, or the feature cache in front of it."""
        if not self.cfg.feature_cache:
            return self.target
        if self._feature_cache is None:
            from dartspec.train.feature_cache import FeatureCache

            self._feature_cache = FeatureCache(self.target, self.cfg.feature_cache)
        return self._feature_cache

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over ``seqs_per_step`` sequences; returns the logged metrics."""
        assert self.model is not None and self.optimizer is not None
        self.model.train()
        start = time.perf_counter()
        lr = lr_at(self.step, self.cfg, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        losses, tokens, scored_seqs = [], 0, 0
        batch = self._batch()
        objective = self._drafter_autocast(self.objective(self.cfg.anchors_per_seq))
        pack = self._pack(len(batch))
        for first in range(0, len(batch), pack):
            chunk = [(s.tokens[: self.cfg.max_seq_len], s.prompt_len) for s in batch[first : first + pack]]
            with self._autocast():
                scored = batch_loss(self.scorer(), chunk, objective, self.gen)
            if scored is None:
                continue
            res, n = scored
            # Each sequence's loss weighs 1/len(batch), however the step's sequences were packed.
            (res.loss * (n / len(batch))).backward()
            losses.append(res.loss.detach() * n)
            scored_seqs += n
            tokens += sum(len(t) for t, _ in chunk)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.step += 1
        # The step's one read of the device, once the host has queued all of it: a read mid-step (each float(),
        # .tolist() or copy from pageable memory) holds the host until the device has caught up, and on a GPU the
        # device then idles while the host queues the rest (tests/test_host_reads.py counts them).
        loss = torch.stack(losses).sum() / scored_seqs if losses else grad_norm.new_full((), float("nan"))
        loss_value, grad_value = torch.stack([loss.float(), grad_norm.float()]).tolist()
        elapsed = time.perf_counter() - start
        return {
            "step": self.step,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": grad_value,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "seconds": elapsed,
            "epoch": self.epoch + self.position / len(self.train),
        }

    def evaluate(self) -> dict[str, Any]:
        """Per-depth top-1 agreement with the target on the dev split (64 fixed anchors each), and chain tau."""
        assert self.model is not None
        self.model.eval()
        with self._autocast():
            acc = depth_accuracy(
                self.target,
                ((s.tokens, s.prompt_len) for s in self.dev),
                self.objective(64),
                depth=self.cfg.depth,
                max_seq_len=self.cfg.max_seq_len,
                batch=self._pack(self.cfg.seqs_per_step),
            )
        return acc.as_dict("dev_")

    def _fit_to_time(self, per_step: float, left: float, cap: int) -> int | None:
        """``fit_schedule``: the schedule's new length (also the last step) for ``left`` seconds at ``per_step``
        seconds a step, or None to keep it. Never past ``cap``, the data's schedule (``epochs`` / ``max_steps``):
        a plan may shorten it, a later one lengthen it back up to that."""
        # Two steps' time kept in hand besides the margin, so that the planned end comes before the time does.
        fits = max(self.step + 1, self.step + int(min(PLAN_MARGIN * left, left - 2 * per_step) / per_step))
        fits = min(fits, cap)
        if fits == self.total_steps:
            return None
        self.total_steps = fits
        self.log(f"schedule fitted to the time: {fits} steps ({per_step:.2f} s a step)")
        return fits

    # --- loop ------------------------------------------------------------------------------------

    def fit(
        self,
        resume: bool = False,
        stop_after: int | None = None,
        max_seconds: float | None = None,
        new_data: bool = False,
        fit_schedule: bool = False,
    ) -> dict[str, Any]:
        """Train until ``total_steps`` (or ``stop_after`` more steps, or the first step that ends ``max_seconds``
        after the start: GPU windows are short); checkpoint and log as configured, and at the stop.

        ``fit_schedule`` (with ``max_seconds``): once the warmup is over, shorten the schedule to the steps that
        fit in the time left at the speed measured so far, and re-plan every ``PLAN_EVERY_STEPS`` steps on the
        speed since, so that the learning rate has decayed when time is up (a stop at full learning rate leaves
        the drafter where the last noisy steps put it). The length is saved with the run, so ``--resume`` goes
        on with it exactly."""
        started = time.monotonic()
        self.out.mkdir(parents=True, exist_ok=True)
        if resume:
            self.resume(new_data=new_data)
            self._cut_log(self.step)
        else:
            if (self.out / STATE_FILE).exists():
                raise DartspecError(f"{self.out} already holds a training run: pass --resume or choose another --out")
            self.build()
            self.save()
        log_path = self.out / LOG_FILE
        stop_at = self.step + (stop_after or 0)
        end = self.total_steps if stop_after is None else min(self.total_steps, stop_at)
        metrics: dict[str, Any] = {}
        from tqdm import tqdm

        with (
            tqdm(total=self.total_steps, initial=self.step, desc=f"train {self.name}", unit="step") as bar,
            open(log_path, "a") as log_file,
        ):
            plan_at = self.step + max(self.cfg.warmup_steps, PLAN_AFTER_STEPS)
            since, since_step, cap = time.monotonic(), self.step, self.total_steps
            while self.step < end:
                metrics = self.train_step()
                if fit_schedule and max_seconds is not None and self.step == plan_at:
                    now = time.monotonic()
                    planned = self._fit_to_time(
                        (now - since) / (self.step - since_step), max_seconds - (now - started), cap
                    )
                    if planned is not None:
                        end = planned if stop_after is None else min(planned, stop_at)
                        bar.total = self.total_steps
                    # Re-plan on the speed of the steps since this plan: the first steps (allocator, kernel
                    # selection) run slow on a GPU, and a plan made on them alone left a window's minutes unused.
                    since, since_step = now, self.step
                    # ... and before the planned end, however near it is (a slow start plans short), but not in
                    # its last steps, where each plan would add the step that the margin keeps in hand.
                    left_steps = end - self.step
                    plan_at = self.step + min(PLAN_EVERY_STEPS, left_steps // 2) if left_steps >= 4 else -1
                if max_seconds is not None and time.monotonic() - started >= max_seconds:
                    end = self.step  # out of time: this step is the last, evaluated and checkpointed below
                if self.step % self.cfg.eval_every == 0 or self.step in (self.total_steps, end):
                    metrics.update(self.evaluate())
                    self.log(f"step {self.step}: dev top-1 per depth {metrics['dev_top1']}")
                log_file.write(json.dumps(metrics) + "\n")
                log_file.flush()
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
                bar.update(1)
                if self.step % self.cfg.checkpoint_every == 0 or self.step == end:
                    self.save()
        return metrics
