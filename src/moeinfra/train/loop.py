"""Train the tiny DeepSeek-V3 with its MTP layer on the text the project ships, in one process or
with DualPipeV over ``P`` gloo ranks, and write the result as a checkpoint in DeepSeek's layout.

Data: ``moeinfra/engine/data/tiny_corpus.txt`` tokenised by the checkpoint's byte-level BPE; each step
draws ``num_chunks * micro_batch`` windows of ``seq_len + 2`` tokens (seeded by the step), so the main
model learns ``t_{i+1}`` and the MTP layer ``t_{i+2}`` at every position. Objective: DeepSeek-V3's
cross-entropy plus ``mtp_weight`` (its lambda) times the MTP cross-entropy, summed over micro-batches;
AdamW with linear warm-up and cosine decay; after every step each MoE layer's selection bias moves
by ``bias_rate`` towards balance (DeepSeek-V3's auxiliary-loss-free balancing).

The DualPipeV run and the one-process run draw the same data and start from the same weights: their
losses agree step by step (tests hold them within 1e-5), so the pipeline is checked on a real model.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import torch

from moeinfra.engine.hf_config import parse_config
from moeinfra.engine.tiny import _write_shards, tiny_config, write_tokenizer
from moeinfra.errors import InputError
from moeinfra.train.checkpoint import hf_state_dict
from moeinfra.train.model import Block, DeepSeekForTraining, mtp_loss, stages


@dataclass(frozen=True)
class TrainConfig:
    """What a training run does. ``ranks``: 1 (one process) or the DualPipeV ranks ``P`` (the
    model is cut into ``2P`` stages); ``num_chunks``: micro-batches per step (DualPipeV needs
    ``>= 2P``); ``micro_batch``: sequences per micro-batch."""

    steps: int = 300
    seq_len: int = 64
    micro_batch: int = 4
    num_chunks: int = 4
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.1
    mtp_weight: float = 0.3
    bias_rate: float = 1e-3
    seed: int = 0
    ranks: int = 2

    def __post_init__(self) -> None:
        for name in ("steps", "seq_len", "micro_batch", "num_chunks", "ranks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name}={value!r} must be a positive integer")
        if self.ranks > 1 and self.num_chunks < 2 * self.ranks:
            raise InputError(
                f"num_chunks={self.num_chunks} must be >= 2 x ranks (ranks={self.ranks}) for "
                "DualPipeV"
            )
        if not self.lr > 0:
            raise InputError(f"lr={self.lr!r} must be > 0")


def model_config(vocab_size: int) -> dict:
    """``config.json`` of the trained model: the built-in tiny checkpoint's shape with one MTP
    layer."""
    return tiny_config(vocab_size) | {"num_nextn_predict_layers": 1}


def corpus_ids(tokenizer_dir: Path) -> torch.Tensor:
    """The shipped corpus as ``[tokens]`` int64 ids of the tokenizer in ``tokenizer_dir``."""
    from tokenizers import Tokenizer

    text = resources.files("moeinfra.engine").joinpath("data/tiny_corpus.txt").read_text()
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return torch.tensor(tok.encode(text).ids, dtype=torch.int64)


def batch(ids: torch.Tensor, config: TrainConfig, step: int) -> tuple[torch.Tensor, ...]:
    """``(inputs, next_ids, labels, mtp_labels)``, each ``[num_chunks * micro_batch, seq_len]``:
    windows of the corpus at offsets drawn from ``(seed, step)``; ``next_ids`` (the MTP layer's
    input tokens) are the labels."""
    rows, width = config.num_chunks * config.micro_batch, config.seq_len + 2
    if ids.numel() < width:
        raise InputError(f"seq_len={config.seq_len} needs a corpus of >= {width} tokens")
    g = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    starts = torch.randint(0, ids.numel() - width + 1, (rows,), generator=g)
    windows = ids[starts[:, None] + torch.arange(width)]
    t = config.seq_len
    return windows[:, :t], windows[:, 1 : t + 1], windows[:, 1 : t + 1], windows[:, 2:]


def _learning_rate(config: TrainConfig, step: int) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(params, config: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay
    )


def _blocks(modules) -> list[Block]:
    return [m for module in modules for m in module.modules() if isinstance(m, Block)]


def train_single(config: TrainConfig, tokenizer_dir: Path, progress=None) -> tuple[dict, list]:
    """One-process training: ``(state_dict, losses)`` with ``losses[step] = (loss, main, mtp)``
    means over the step's micro-batches."""
    ids = corpus_ids(tokenizer_dir)
    model = DeepSeekForTraining(parse_config(model_config(_vocab(tokenizer_dir))), config.seed)
    optimizer = _optimizer(model.parameters(), config)
    losses = []
    for step in range(config.steps):
        inputs, next_ids, labels, mtp_labels = batch(ids, config, step)
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(config, step)
        optimizer.zero_grad(set_to_none=True)
        parts = []
        for chunk in range(config.num_chunks):
            rows = slice(chunk * config.micro_batch, (chunk + 1) * config.micro_batch)
            logits, mtp_logits = model(inputs[rows], next_ids[rows])
            loss = mtp_loss(logits, mtp_logits, labels[rows], mtp_labels[rows], config.mtp_weight)
            loss.backward()
            parts.append(loss.detach())
        optimizer.step()
        model.update_bias(config.bias_rate)
        losses.append(float(torch.stack(parts).mean()))
        if progress is not None:
            progress(step, losses[-1])
    return model.state_dict(), losses


def train_rank(config: TrainConfig, tokenizer_dir: str, updates=None) -> dict:
    """This rank's part of a DualPipeV run (inside an initialised gloo process group of
    ``config.ranks`` ranks): ``{"state": its stages' tensors, "losses": per step (rank 0)}``;
    rank 0 puts ``(step, loss)`` on ``updates`` (a queue) after every step."""
    import torch.distributed as dist

    from moeinfra.pipeline.runtime import DualPipeV

    tokenizer_dir = Path(tokenizer_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = corpus_ids(tokenizer_dir)
    mc = parse_config(model_config(_vocab(tokenizer_dir)))
    model = DeepSeekForTraining(mc, config.seed)
    cut = stages(model, 2 * world)
    mine = (cut[rank], cut[2 * world - 1 - rank])
    shape = (config.micro_batch, config.seq_len)
    specs = {
        s: [((*shape, mc.block.hidden_size), torch.float32), (shape, torch.int64)]
        for s in range(1, 2 * world)
    }
    runner = DualPipeV(mine, p2p_specs=specs)
    optimizer = _optimizer(runner.parameters(), config)

    def criterion(logits, mtp_logits, labels, mtp_labels):
        return mtp_loss(logits, mtp_logits, labels, mtp_labels, config.mtp_weight)

    losses = []
    for step in range(config.steps):
        inputs, next_ids, labels, mtp_labels = batch(ids, config, step)
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(config, step)
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            loss, _ = runner.step(
                inputs,
                next_ids,
                num_chunks=config.num_chunks,
                criterion=criterion,
                labels=(labels, mtp_labels),
            )
            losses.append(float(loss.mean()))
            if updates is not None:
                updates.put((step, losses[-1]))
        else:
            runner.step(num_chunks=config.num_chunks)
        optimizer.step()
        for block in _blocks(mine):
            block.update_bias(config.bias_rate)
    own = {t.data_ptr() for module in mine for t in module.state_dict().values()}
    # numpy arrays travel back by value (torch tensors would by shared memory, gone with the rank)
    state = {n: t.numpy().copy() for n, t in model.state_dict().items() if t.data_ptr() in own}
    return {"state": state, "losses": losses}


def _train_spawned(config: TrainConfig, tokenizer_dir: Path, timeout_s: float, progress):
    """DualPipeV over ``config.ranks`` spawned gloo ranks; rank 0's losses reach ``progress``
    as they come."""
    import threading

    import torch.multiprocessing as mp

    from moeinfra.moe.launch import launch

    updates = mp.get_context("spawn").Queue()

    def relay() -> None:
        while (item := updates.get()) is not None:
            if progress is not None:
                progress(*item)

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    try:
        args = (config, str(tokenizer_dir), updates)
        results = launch(config.ranks, train_rank, args, timeout_s=timeout_s)
    finally:
        updates.put(None)
        thread.join(timeout=5)
    state = {k: torch.from_numpy(v) for r in results for k, v in r["state"].items()}
    return state, results[0]["losses"]


def _vocab(tokenizer_dir: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()


def train(
    path: Path,
    config: TrainConfig | None = None,
    *,
    overwrite: bool = False,
    timeout_s: float = 3600.0,
    progress=None,
) -> tuple[Path, list[float]]:
    """Train (DualPipeV over ``config.ranks`` spawned gloo ranks, or one process) and write the
    checkpoint to ``path`` (config, safetensors, tokenizer, and ``training.json`` with the run's
    settings and per-step losses). Returns ``(path, losses)``."""
    config = config or TrainConfig()
    path = Path(path)
    if path.exists() and not overwrite and any(path.iterdir() if path.is_dir() else [path]):
        raise InputError(f"path={str(path)!r} exists and is not empty (pass overwrite)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        vocab = write_tokenizer(tmp, "bpe")
        if config.ranks == 1:
            state, losses = train_single(config, tmp, progress)
        else:
            state, losses = _train_spawned(config, tmp, timeout_s, progress)
        model = DeepSeekForTraining(parse_config(model_config(vocab)), config.seed)
        model.load_state_dict(state)
        _write_shards(tmp, hf_state_dict(model), 1)
        (tmp / "config.json").write_text(json.dumps(model_config(vocab), indent=2))
        generation = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        record = {"config": asdict(config), "losses": losses}
        (tmp / "training.json").write_text(json.dumps(record, indent=2))
        if path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path, losses
