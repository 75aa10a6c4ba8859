"""The backprop baseline of `zosoma compare`: zosoma's LSTM trained with autograd and Adam
(PyTorch, the optional `backprop` extra), so a comparison can say what zero-order training costs.

A method is backprop when its train table says `optimizer = "backprop"`. It trains the same model
(torch's nn.Embedding + nn.LSTM + nn.Linear, loaded from zosoma's own initialisation: the layout
of zosoma.formats.torch_state) on the same batches (zosoma.corpus.BatchSampler, the run's seed,
expert 0's stream: the minibatches `zosoma train` draws), and it is scored by zosoma's own
evaluator: the trained weights go back into theta (float32) and are routed as a one-model
ensemble, exactly as a monolithic ZO run is. Torch runs on one thread (torch.set_num_threads(1)).

Budgets, accounted as the ZO methods' are: forward tokens B x T per step (one forward pass, where
SPSA runs 2P), and FLOPs of a step at 3x its forward (the backward pass counted at 2x the
forward, the usual estimate: Kaplan et al. 2020); the comparison measures every method's
CPU-seconds the same way (zosoma.experiments.compare).

The product's own training never imports torch: only this module does, and only when a
comparison has a backprop method.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import numpy as np

from zosoma.config import VOCAB, ModelConfig, TrainConfig
from zosoma.corpus import BatchSampler
from zosoma.errors import ConfigError
from zosoma.experiments.scoring import Scored
from zosoma.mixture.routing import Ensemble, Whole
from zosoma.model.params import Layout, init_params

BACKPROP = "backprop"
# The TrainConfig fields a backprop method reads: Adam's rate, betas and decoupled weight decay
# (AdamW), the rate's schedule, the batch shape. The others are the ZO estimator's.
KEYS = frozenset({"optimizer", "lr", "schedule", "warmup", "momentum", "beta2", "weight_decay", "batch", "seq_len"})
DEFAULTS = {"lr": 3e-3, "schedule": "constant", "warmup": 0}  # Adam's usual rate, held: a curve at every point
BACKWARD_FACTOR = 2  # a backward pass counted at 2x the forward's FLOPs
MISSING = "the backprop baseline needs PyTorch: pip install 'zosoma[backprop]'"


def is_backprop(cfg: TrainConfig) -> bool:
    return cfg.optimizer == BACKPROP


def flops_per_step(model: ModelConfig, cfg: TrainConfig) -> float:
    """Forward and backward FLOPs of one step: B x T tokens at (1 + BACKWARD_FACTOR) forwards."""
    return (1 + BACKWARD_FACTOR) * cfg.batch * cfg.seq_len * model.flops_per_token()


def resolve_backprop(model: ModelConfig, given: Mapping, shared: Mapping = {}) -> TrainConfig:
    """A backprop method's TrainConfig: DEFAULTS, then the shared table's fields it reads (the
    rest of a shared table is the ZO methods'), then its own, which must all be read (KEYS)."""
    unread = sorted(set(given) - KEYS)
    if unread:
        raise ConfigError(f"a backprop method reads only {', '.join(sorted(KEYS))}; not {', '.join(unread)}")
    cfg = dataclasses.replace(TrainConfig(optimizer=BACKPROP),
                              **{**DEFAULTS, **{k: v for k, v in shared.items() if k in KEYS}, **given})
    if cfg.schedule not in ("constant", "cosine"):
        raise ConfigError(f"schedule must be constant or cosine, got {cfg.schedule!r}")
    return cfg


def import_torch():
    """torch, or a ConfigError in one line saying how to install it."""
    try:
        import torch
    except ImportError:
        raise ConfigError(MISSING) from None
    return torch


def torch_device(ops):
    """Where torch trains beside the engine `ops`: its GPU (cuDNN) when the engine is on one."""
    torch = import_torch()
    if not ops.on_device:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {ops.device}: this PyTorch ({torch.__version__}) finds no CUDA device for the "
                          "backprop baseline")
    return torch.device("cuda")


def torch_model(theta: np.ndarray, layout: Layout, dtype=None):
    """torch's nn.Embedding + nn.LSTM(batch_first) + nn.Linear holding theta (d,): modules named
    embedding, lstm, linear (zosoma.formats.torch_state), in `dtype` (default float32)."""
    torch = import_torch()
    from zosoma.formats.torch_state import torch_state_arrays

    class ByteLSTM(torch.nn.Module):
        def __init__(self, config: ModelConfig):
            super().__init__()
            self.embedding = torch.nn.Embedding(VOCAB, config.embed)
            self.lstm = torch.nn.LSTM(config.embed, config.hidden, config.layers, batch_first=True)
            self.linear = torch.nn.Linear(config.hidden, VOCAB)

        def forward(self, tokens, state=None):
            """logits (B, T, V) of tokens (B, T) int64, and the final (h, c), each (L, B, H)."""
            out, state = self.lstm(self.embedding(tokens), state)
            return self.linear(out), state

    dtype = dtype or torch.float32
    model = ByteLSTM(layout.config).to(dtype)  # before loading, so float64 weights stay exact
    state = {k: torch.from_numpy(np.array(v, np.float64)).to(dtype) for k, v in torch_state_arrays(theta, layout).items()}
    model.load_state_dict(state, strict=True)
    return model


def theta_of(model, layout: Layout, dtype=np.float32) -> np.ndarray:
    """zosoma's theta (d,) of a torch_model's weights."""
    from zosoma.formats.torch_state import theta_from_torch_state

    return theta_from_torch_state({k: v.detach().double().cpu().numpy() for k, v in model.state_dict().items()}, layout,
                                  dtype)


def mean_loss(model, batch: np.ndarray):
    """The mean cross-entropy (nats/byte, a torch scalar) of a (B, T+1) byte batch: inputs
    [:, :-1], targets [:, 1:], as zosoma.model.reference.loss."""
    torch = import_torch()
    tokens = torch.from_numpy(batch.astype(np.int64)).to(next(model.parameters()).device)
    logits, _ = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def flat_grad(model, layout: Layout) -> np.ndarray:
    """The gradient held in the model's .grad, in zosoma's flat layout (d,) float64. zosoma's one
    bias b = b_ih + b_hh, so dL/db is dL/db_ih (equal to dL/db_hh), not their sum."""
    from zosoma.formats.torch_state import theta_from_torch_state

    grads = {k: p.grad.double().numpy() for k, p in model.named_parameters()}
    for layer in range(layout.config.layers):
        grads[f"lstm.bias_hh_l{layer}"] = np.zeros_like(grads[f"lstm.bias_hh_l{layer}"])
    return theta_from_torch_state(grads, layout, np.float64)


class BackpropRun(Scored):
    """One backprop run of a comparison, with what zosoma.experiments.study.JobRun offers its job:
    advance, step, totals, training, score.

    It keeps a checkpoint in its run folder (zosoma.formats.checkpoint, written atomically) at step
    0, wherever `advance` returns (a curve point, the end, a stop) and so before every curve point
    is recorded: theta, so `zosoma eval` and `info` read it, and, as optimizer state arrays, the
    torch weights (torch.<name>: theta's one LSTM bias is torch's two) and AdamW's state
    (adamw.<i>.<key>). A stopped or killed run resumes from it bit for bit: batches are a pure
    function of (seed, stream, step), and nothing draws from torch's generator."""

    def __init__(self, folder, spec, device: str = "cpu"):
        from zosoma.workers.placement import Placement
        from zosoma.training.stepper import stream
        from zosoma.runs.run import engine
        from zosoma.runs.single import data_record, load_data

        torch = import_torch()
        torch.set_num_threads(1)  # one core, as each ZO worker's one BLAS thread
        torch.manual_seed(spec.train.seed)  # nothing draws from it; any later use stays seeded
        self.folder, self.spec, self.cfg = folder, spec, spec.train
        self.ops, self.layout = engine(Placement(device=device)), Layout(spec.model)
        train_corpus, self.heldout = load_data(None, None)
        self.data = data_record(train_corpus)  # the shipped corpus, as a single ZO run's checkpoint records it
        self.sampler, self.stream = BatchSampler(train_corpus, self.cfg.seq_len + 1), stream(0, 0)
        self.model = torch_model(init_params(spec.model, self.cfg.seed), self.layout).to(torch_device(self.ops))
        c = self.cfg
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=c.lr, betas=(c.momentum, c.beta2),
                                           weight_decay=c.weight_decay)
        self.step, self.tokens, self.wall_s, self.last_loss = 0, 0, 0.0, None
        self.diverged = False  # a NaN loss stops it
        if folder.has_checkpoint:  # the study checked it is this job's (zosoma.experiments.study.check_job)
            self._resume(folder.read_checkpoint(set_aside=True))
        else:
            folder.make()
            folder.clear_curve()  # points an older zosoma's attempt left, which kept no checkpoint
            self.checkpoint()

    @property
    def checkpoint_steps(self) -> list[int]:
        return [self.step]

    def checkpoint(self) -> None:
        from zosoma.formats.checkpoint import Checkpoint

        state = {f"torch.{name}": t.detach().numpy().copy() for name, t in self.model.state_dict().items()}
        for i, kept in self.optimizer.state_dict()["state"].items():
            state.update({f"adamw.{i}.{key}": t.numpy().copy() for key, t in kept.items()})
        extra = {"seed": self.cfg.seed, "data": self.data, "tokens": self.tokens, "wall_s": self.wall_s,
                 "last_loss": self.last_loss, "diverged": self.diverged}
        self.folder.write_checkpoint(Checkpoint(self.spec.model, self.cfg, self.theta(), self.step, state, extra))

    def _resume(self, ckpt) -> None:
        torch = import_torch()
        arrays = {name: torch.from_numpy(np.asarray(a)) for name, a in ckpt.optimizer.items()}
        self.model.load_state_dict({n.removeprefix("torch."): t for n, t in arrays.items() if n.startswith("torch.")})
        saved = self.optimizer.state_dict()
        for name, t in arrays.items():
            if name.startswith("adamw."):
                _, i, key = name.split(".", 2)
                saved["state"].setdefault(int(i), {})[key] = t
        self.optimizer.load_state_dict(saved)
        e = ckpt.extra
        self.step, self.tokens, self.wall_s = ckpt.step, int(e["tokens"]), float(e["wall_s"])
        self.last_loss, self.diverged = e["last_loss"], bool(e["diverged"])

    def advance(self, target: int, stopping: Callable[[], bool]) -> bool:
        """Train to step `target` (or until stopping() or a non-finite loss), then checkpoint; False
        when asked to stop."""
        at = self.step
        going_on = self._train(target, stopping)
        if self.step != at:
            self.checkpoint()
        return going_on

    def _train(self, target: int, stopping: Callable[[], bool]) -> bool:
        import time

        from zosoma.strategies.base import learning_rate

        c = self.cfg
        while self.step < min(target, c.steps) and not self.diverged:
            if stopping():
                return False
            t0 = time.perf_counter()
            batch = self.sampler.batch(c.seed, self.stream, self.step, c.batch)
            for group in self.optimizer.param_groups:
                group["lr"] = learning_rate(self.step, c.lr, c.steps, c.warmup, c.schedule)
            self.optimizer.zero_grad(set_to_none=True)
            loss = mean_loss(self.model, batch)
            loss.backward()
            self.optimizer.step()
            self.last_loss = loss.item()
            self.diverged = not np.isfinite(self.last_loss)
            self.step += 1
            self.tokens += c.batch * c.seq_len
            self.wall_s += time.perf_counter() - t0
        return not stopping()

    def totals(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "wall_s": self.wall_s,
                "flops": float(self.tokens) * (1 + BACKWARD_FACTOR) * self.spec.model.flops_per_token()}

    def training(self) -> dict:
        divergence = [{"expert": 0, "step": self.step, "verdict": "non-finite loss"}] if self.diverged else None
        return {"skipped_steps": 0, "divergence": divergence, "restarts": [], "dropped": [],
                "final_train_loss": self.last_loss}

    def theta(self) -> np.ndarray:
        return theta_of(self.model, self.layout)

    def ensemble(self, top_k: int | None = None) -> Ensemble:
        return Ensemble(((self.theta(), self.layout),), Whole())

