"""train-draft: self-distillation data, then a training loop over the frozen target's hidden
states (computed online), with accelerate (bf16 on CUDA, fp32 on CPU; several GPUs through
``accelerate launch`` with no change), gradient accumulation, a cosine schedule with warmup,
gradient clipping, checkpoints and an exact ``--resume``.

The run lives in a hidden work folder beside OUT (``.OUT.partial``) and is renamed to OUT
only when finished, so OUT is never half-written. OUT then holds:
  model.safetensors        the draft's weights only
  config.json              method, sizes, the target's identity (target.py), training summary
  dataset.jsonl            the training sequences (token ids + prompt length)
  checkpoint-STEP/         heads, optimizer, scheduler, RNG states, step and data position
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from .data import DraftSequence, build_dataset, read_dataset, write_dataset
from .methods import DRAFT_METHODS
from .target import load_target, same_target, target_identity

METHODS = tuple(DRAFT_METHODS)
_STATE = "trainer_state.json"


@dataclass
class DraftConfig:
    """What train-draft does. target: folder, alias or hub id; out: the output folder;
    method: medusa (num_heads heads) or eagle (one decoder layer over features; num_heads unused).
    num_prompts: prompts to generate or read at most; max_steps: optimizer steps;
    batch_size: sequences per micro-batch (per process); grad_accum: micro-batches per step;
    seq_len: tokens per sequence at most (prompt + answer); answer_tokens: answer tokens at
    most; warmup_steps: None = 5% of max_steps; checkpoint_every / eval_every: in steps;
    holdout: sequences kept out of training to measure each head's top-1 accuracy;
    resume: a checkpoint-STEP folder to continue from (same data, held-out split, schedule and RNG).
    dataset: a dataset.jsonl an earlier run wrote (OUT/dataset.jsonl): train on those sequences
    instead of writing new ones (another method, or longer, on the same self-distilled answers).
    init_from: the OUT folder of an earlier train-draft run of the same method and sizes whose
    weights start this run (a fresh optimizer and schedule): a draft trained further, on more
    data, or moved to another target (say, from the unquantized target to its AWQ checkpoint).
    time_limit: seconds the whole run may take (data included): after a few steps the step time
    is measured and, if max_steps would not fit, the cosine schedule is planned for the steps
    that do (the learning rate still decays to zero); past the limit training stops and the draft
    is written from where it is."""

    target: str
    out: Path
    method: str = "medusa"  # or "eagle", "eagle3"
    num_heads: int = 4
    ttt_steps: int = 5  # eagle3: training-time-test steps: depths trained (serving's default depth; paper: 7)
    draft_vocab: int | None = None  # eagle3: the draft's vocabulary, the most used answer tokens (None: all)
    # eagle, eagle3: "soft" (the default: the target's next-token distribution, over the draft's
    # vocabulary, as EAGLE's paper and SpecForge's training take it) or "hard" (the data's next token)
    labels: str | None = None
    num_prompts: int = 256
    max_steps: int = 1000
    prompts: Path | None = None
    dataset: Path | None = None
    lr: float = 1e-3
    weight_decay: float = 0.0
    batch_size: int = 8
    grad_accum: int = 1
    seq_len: int = 512
    answer_tokens: int = 256
    answer_temperature: float = 0.0
    warmup_steps: int | None = None
    max_grad_norm: float = 1.0
    checkpoint_every: int = 200
    eval_every: int = 50
    # 4 sequences (~1000 tokens) put the same EAGLE-3 draft at 0.767 and at 0.847 depth-1 top-1 in two
    # runs (docs/BENCHMARKS.md, twenty-eighth session); at most a fifth of the data either way
    holdout: int = 64
    resume: Path | None = None
    init_from: Path | None = None
    device: str = "auto"
    seed: int = 0
    overwrite: bool = False
    time_limit: float | None = None
    # Magpie: the written user turns start with these (speculative.data.TASK_OPENERS, say), cycled
    openers: tuple[str, ...] = ()
    # Magpie: written turns that overlap one of these (a run of 8 words) are dropped: the cli passes `optllm eval`'s
    # held-out prompts, so a draft never trains on what its evaluation asks
    exclude_prompts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.openers, self.exclude_prompts = tuple(self.openers), tuple(self.exclude_prompts)
        self.prompts = Path(self.prompts) if self.prompts is not None else None
        self.resume = Path(self.resume) if self.resume is not None else None
        self.dataset = Path(self.dataset) if self.dataset is not None else None
        self.init_from = Path(self.init_from) if self.init_from is not None else None
        if self.init_from is not None and self.resume is not None:
            raise UserError("init_from is not allowed with resume; allowed: one of them (a checkpoint restores the "
                            "weights, optimizer and schedule; init_from only the weights)")
        if self.dataset is not None and (self.prompts is not None or self.resume is not None):
            raise UserError("dataset is not allowed with prompts or resume; allowed: one source of training data "
                            "(a dataset.jsonl, a prompt file, or the run a checkpoint belongs to)")
        if self.method not in METHODS:
            raise UserError(f"unknown method {self.method!r}; allowed: {', '.join(METHODS)}")
        for name in ("num_heads", "num_prompts", "max_steps", "batch_size", "grad_accum", "answer_tokens",
                     "checkpoint_every", "eval_every", "ttt_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"{name}={v!r} is not allowed; allowed: an integer >= 1")
        if self.draft_vocab is not None and (isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int)
                                             or self.draft_vocab < 2):
            raise UserError(f"draft_vocab={self.draft_vocab!r} is not allowed; allowed: an integer >= 2 or None")
        if self.draft_vocab is not None and self.method != "eagle3":
            raise UserError(f"draft_vocab is an eagle3 option; --method {self.method} drafts over the whole vocabulary")
        if self.labels is not None and self.method not in ("eagle", "eagle3"):
            raise UserError(f"labels is an eagle / eagle3 option; --method {self.method} trains on the data's "
                            "next tokens")
        if self.labels not in (None, "soft", "hard"):
            raise UserError(f"labels={self.labels!r} is not allowed; allowed: soft, hard")
        if self.method in ("eagle", "eagle3") and self.labels is None:
            self.labels = "soft"
        # the farthest target a draft position learns: num_heads + 1 tokens ahead (Medusa), 2 (EAGLE);
        # EAGLE-3's step j counts positions from j on
        least, least_text = ((self.num_heads + 3, "num_heads + 3") if self.method == "medusa" else
                             (self.ttt_steps + 2, "ttt_steps + 2") if self.method == "eagle3" else (3, "3"))
        if not isinstance(self.seq_len, int) or self.seq_len < least:
            raise UserError(f"seq_len={self.seq_len!r} is not allowed; allowed: an integer >= {least_text}")
        if not (self.lr > 0):
            raise UserError(f"lr={self.lr!r} is not allowed; allowed: a number > 0")
        if self.warmup_steps is not None and not (0 <= self.warmup_steps <= self.max_steps):
            raise UserError(f"warmup_steps={self.warmup_steps!r} is not allowed; allowed: 0..max_steps")
        if self.time_limit is not None and not (self.time_limit > 0):
            raise UserError(f"time_limit={self.time_limit!r} is not allowed; allowed: seconds > 0")
        if self.holdout < 0:
            raise UserError(f"holdout={self.holdout!r} is not allowed; allowed: an integer >= 0")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise UserError(f"device={self.device!r} is not allowed; allowed: auto, cpu, cuda")


@dataclass
class TrainResult:
    """losses: (step, mean loss of that step) for every step this run took; accuracy: the
    last held-out top-1 accuracy per head (empty without held-out sequences)."""

    out: Path
    step: int
    losses: list[tuple[int, float]] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)


def train_draft(cfg: DraftConfig, log: Callable[[str], None] = print) -> TrainResult:
    """Train a draft for cfg.target into cfg.out (see the module docstring for the layout)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    t0 = time.monotonic()
    out = cfg.out
    work = out.parent / f".{out.name}.partial"
    if out.exists() and not cfg.overwrite:
        raise UserError(f"{out} exists; pass --overwrite to replace it")
    if cfg.prompts is not None and not cfg.prompts.is_file():
        raise UserError(f"prompt file {cfg.prompts} not found")
    given = None  # a --dataset's sequences, read and checked before any folder is made
    if cfg.dataset is not None:
        if not cfg.dataset.is_file():
            raise UserError(f"dataset file {cfg.dataset} not found")
        given = _read_checked(cfg.dataset)
    if cfg.resume is not None and not (cfg.resume / _STATE).is_file():
        raise UserError(f"--resume {cfg.resume}: not a checkpoint folder (no {_STATE})")
    if cfg.resume is not None and not (cfg.resume.parent / "dataset.jsonl").is_file():
        raise UserError(f"--resume {cfg.resume}: its run folder has no dataset.jsonl to continue on")
    resuming_here = cfg.resume is not None and cfg.resume.resolve().parent == work.resolve()
    init = _read_init(cfg.init_from, cfg.method) if cfg.init_from is not None else None  # before any data is written

    use_cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise UserError(f"device={cfg.device!r} was asked for but CUDA is not available; use --device cpu")
    acc = Accelerator(cpu=not use_cuda, mixed_precision="bf16" if use_cuda else "no")
    set_seed(cfg.seed)

    if acc.is_main_process:
        if work.exists() and not resuming_here:
            if not cfg.overwrite:
                raise UserError(f"an unfinished run is in {work}; continue it with --resume {_latest(work) or work} "
                                "or start over with --overwrite")
            shutil.rmtree(work)
        work.mkdir(parents=True, exist_ok=True)
        if cfg.resume is not None:
            if not resuming_here:
                shutil.copyfile(cfg.resume.parent / "dataset.jsonl", work / "dataset.jsonl")
        elif cfg.dataset is not None:
            shutil.copyfile(cfg.dataset, work / "dataset.jsonl")
        else:
            try:
                seqs = build_dataset(cfg.target, cfg.num_prompts, cfg.prompts, seed=cfg.seed,
                                     device="cuda" if use_cuda else "cpu", max_len=cfg.seq_len,
                                     answer_tokens=cfg.answer_tokens, answer_temperature=cfg.answer_temperature,
                                     log=log, openers=cfg.openers, exclude=cfg.exclude_prompts)
                write_dataset(seqs, work / "dataset.jsonl")
            except BaseException:  # a bad prompt file, an interrupt: no data, so nothing to resume
                shutil.rmtree(work, ignore_errors=True)
                raise
    acc.wait_for_everyone()
    seqs = given if given is not None else _read_checked(work / "dataset.jsonl")
    # a resume continues its run's split: the checkpoint's holdout (4 before it was kept there)
    holdout = _checkpoint_holdout(cfg.resume) if cfg.resume is not None else cfg.holdout
    train, held = _split(seqs, holdout, cfg.seed)

    target, folder = load_target(cfg.target, "bfloat16" if use_cuda else "float32", acc.device)
    vocab = target.get_input_embeddings().weight.shape[0]
    top = max((max(s.token_ids) for s in seqs if s.token_ids), default=-1)
    if top >= vocab:
        if acc.is_main_process and cfg.resume is None:
            shutil.rmtree(work, ignore_errors=True)  # a run that never trained leaves nothing behind
        raise UserError(f"the training data has token id {top}, past the target's vocabulary of {vocab}: "
                        f"{cfg.dataset or 'dataset.jsonl'} was written for another model; allowed: data of this target")
    method = DRAFT_METHODS[cfg.method]
    if cfg.resume is not None and cfg.method in ("eagle", "eagle3"):  # a resume continues its run's labels too
        cfg.labels = _checkpoint_labels(cfg.resume)
    heads = method.build(target, cfg.num_heads, cfg)
    if hasattr(method, "fit"):
        method.fit(heads, train)
    if init is not None:
        try:
            _apply_init(cfg.init_from, *init, heads, folder, log)
        except UserError:
            if acc.is_main_process:
                shutil.rmtree(work, ignore_errors=True)  # a run that never trained leaves nothing behind
            raise
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else cfg.max_steps // 20
    plan = _Cosine(warmup, cfg.max_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, plan)  # its state_dict keeps plan's total (a resume too)

    step, position = 0, 0
    rng = None
    if cfg.resume is not None:
        step, position, rng = _load_checkpoint(cfg.resume, heads, opt, sched)
        log(f"resumed from {cfg.resume} at step {step}")
    # The scheduler stays ours: accelerate's wrapper would step it once per process.
    heads, opt = acc.prepare(heads, opt)
    if rng is not None:
        _set_rng(rng)

    result = TrainResult(out, step)
    if step == 0 and held:
        result.accuracy = _evaluate(acc, target, method, heads, held, cfg.batch_size)
        log(f"step 0/{plan.total}  held-out top-1 {_fmt(result.accuracy)}")
    first, padded, t_prev = step, 0, None
    step_times: list[float] = []  # seconds of each step after the first (the first compiles and warms up)
    pad_to = _PAD_MULTIPLE if acc.device.type == "cuda" else 1
    log(f"training on {acc.device}{_memory_note(acc.device)}")
    while step < plan.total:
        heads.train()
        total = 0.0
        for _ in range(cfg.grad_accum):
            ids, attn, mask = _collate(_micro_batch(train, position * acc.num_processes + acc.process_index,
                                                    cfg.batch_size, cfg.seed), acc.device, pad_to)
            position += 1
            padded += ids.numel()
            hidden = method.features(acc.unwrap_model(heads), target, ids, attn)
            with acc.autocast():
                loss = method.loss(heads, hidden.float(), ids, mask)
            acc.backward(loss / cfg.grad_accum)
            total += loss.detach() / cfg.grad_accum
        acc.clip_grad_norm_(heads.parameters(), cfg.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        total = float(total)  # read once a step, after its work is queued (not a wait per micro-batch)
        step += 1
        result.losses.append((step, total))
        if cfg.time_limit is not None:
            now = time.monotonic()  # one reading a step: its time includes the evaluation and saving after it
            if t_prev is None:
                padded = 0
            else:
                step_times.append(now - t_prev)
            t_prev = now
            probed = len(step_times)
            if probed == _PROBE_STEPS or (probed > _PROBE_STEPS and probed % _REPLAN_EVERY == 0):
                # the first steps at each new padded length cost several times a steady one (kernel
                # selection, allocator growth): the probe plans on their median; later checks on
                # the mean of every step since, which by then holds the length mix of the data
                later = step_times[_PROBE_STEPS:]
                per_step = statistics.median(step_times) if not later else sum(later) / len(later)
                if probed == _PROBE_STEPS:
                    log(f"{per_step * 1e3:.1f} ms a step (median of steps {first + 2}-{step}; mean "
                        f"{sum(step_times) / probed * 1e3:.1f}), {padded / probed:.0f} padded tokens a step"
                        f"{_memory_note(acc.device)}")
                left = cfg.time_limit - (now - t0) - _SAVE_RESERVE_S
                fit = _agree(acc, step + max(0, int(left / per_step)))
                if fit < plan.total:
                    log(f"time limit {cfg.time_limit:g} s: {per_step * 1e3:.1f} ms a step, {fit} of {plan.total} "
                        "steps fit; the schedule now ends there")
                    plan.shrink(max(step, fit))
            if _agree(acc, int(now - t0 > cfg.time_limit - _SAVE_RESERVE_S)) and step < plan.total:
                log(f"time limit {cfg.time_limit:g} s reached at step {step}; stopping there")
                plan.shrink(step)
        last = step == plan.total
        if held and (step % cfg.eval_every == 0 or last):
            result.accuracy = _evaluate(acc, target, method, heads, held, cfg.batch_size)
        line = f"step {step}/{plan.total}  loss {total:.4f}  lr {sched.get_last_lr()[0]:.2e}"
        if held and (step % cfg.eval_every == 0 or last):
            line += f"  held-out top-1 {_fmt(result.accuracy)}"
        log(line)
        if step % cfg.checkpoint_every == 0 or last:
            acc.wait_for_everyone()
            if acc.is_main_process:
                _save_checkpoint(work / f"checkpoint-{step}", acc.unwrap_model(heads), opt, sched, step, position,
                                 holdout, cfg.labels)
    result.step = step

    acc.wait_for_everyone()
    if acc.is_main_process:
        model = acc.unwrap_model(heads)
        _save_draft(work, model, method.config(model), cfg, folder, target, len(seqs), result,
                    torch.bfloat16 if use_cuda else torch.float32)
        if out.exists():
            shutil.rmtree(out)
        os.replace(work, out)
        log(f"draft written to {out}")
    return result


# --------------------------------------------------------------------------- data


def _read_checked(path: Path) -> list[DraftSequence]:
    """The sequences of a dataset.jsonl; one that is not train-draft's format is one clear error."""
    try:
        seqs = read_dataset(path)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"dataset {path}: not a train-draft dataset.jsonl ({type(e).__name__}: {e}); "
                        "allowed: lines {\"token_ids\": [...], \"num_prompt_tokens\": N}") from None
    bad = next((i for i, s in enumerate(seqs) if not 0 <= s.num_prompt_tokens < len(s.token_ids)
                or min(s.token_ids) < 0), None)
    if not seqs or bad is not None:
        where = "no sequences" if not seqs else f"sequence {bad + 1} has no answer token or a negative id"
        raise UserError(f"dataset {path}: {where}; allowed: each line's token_ids non-negative, "
                        "longer than its num_prompt_tokens")
    return seqs


def _split(seqs: list[DraftSequence], holdout: int, seed: int) -> tuple[list[DraftSequence], list[DraftSequence]]:
    n_held = min(holdout, max(1, len(seqs) // 5)) if len(seqs) > 1 else 0
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(seed)).tolist()
    held = [seqs[i] for i in order[:n_held]]
    return [seqs[i] for i in order[n_held:]], held


def _micro_batch(seqs: list[DraftSequence], index: int, batch_size: int, seed: int) -> list[DraftSequence]:
    """Micro-batch `index` of the stream: each epoch is a seeded permutation, so a position
    (micro-batches taken so far) is all a resumed run needs to continue the same stream."""
    bs = min(batch_size, len(seqs))
    per_epoch = len(seqs) // bs
    epoch, i = divmod(index, per_epoch)
    perm = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(seed * 100003 + epoch)).tolist()
    return [seqs[j] for j in perm[i * bs:(i + 1) * bs]]


def _collate(batch: list[DraftSequence], device, pad_to: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids [B, T], attention_mask [B, T], loss_mask [B, T] bool: answer tokens),
    T the longest sequence rounded up to a multiple of pad_to."""
    t = -(-max(len(s.token_ids) for s in batch) // pad_to) * pad_to
    ids = torch.zeros(len(batch), t, dtype=torch.long)
    attn = torch.zeros(len(batch), t, dtype=torch.long)
    mask = torch.zeros(len(batch), t, dtype=torch.bool)
    for b, s in enumerate(batch):
        n = len(s.token_ids)
        ids[b, :n] = torch.tensor(s.token_ids)
        attn[b, :n] = 1
        mask[b, s.num_prompt_tokens:n] = True
    return ids.to(device), attn.to(device), mask.to(device)


# --------------------------------------------------------------------------- schedule, eval


_PROBE_STEPS = 10  # steps timed (after the first) to plan a run under time_limit
_REPLAN_EVERY = 50  # then the plan is checked again every this many steps
# padded lengths on CUDA are rounded up to this: each new length costs a few slow steps (measured on
# the H200: 250-340 ms against 54 ms steady, docs/BENCHMARKS.md), so few lengths are better than
# little padding
_PAD_MULTIPLE = 64
_SAVE_RESERVE_S = 10.0  # seconds kept for the last evaluation and writing the draft


class _Cosine:
    """Linear warmup, then cosine decay to zero at ``total`` steps. An object (not a closure)
    so LambdaLR's state_dict keeps warmup and total: a run whose schedule was shortened for
    its time limit resumes on the shortened schedule."""

    def __init__(self, warmup: int, total: int) -> None:
        self.warmup, self.total = warmup, total

    def shrink(self, total: int) -> None:
        self.total = max(1, total)
        self.warmup = min(self.warmup, self.total // 20)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _agree(acc, value: int) -> int:
    """The main process's value on every process (each has its own clock; a decision about
    stopping must be the same everywhere, or the gradient all-reduce waits forever)."""
    if acc.num_processes == 1:
        return value
    from accelerate.utils import broadcast

    return int(broadcast(torch.tensor([value], device=acc.device), from_process=0).item())


@torch.no_grad()
def _evaluate(acc, target, method, heads, held: list[DraftSequence], batch_size: int) -> list[float]:
    heads.eval()
    hits = counts = None
    for i in range(0, len(held), batch_size):
        ids, attn, mask = _collate(held[i:i + batch_size], acc.device)
        with acc.autocast():
            h, c = method.accuracy(heads, method.features(acc.unwrap_model(heads), target, ids, attn).float(), ids,
                                   mask)
        hits = h if hits is None else [a + b for a, b in zip(hits, h)]
        counts = c if counts is None else [a + b for a, b in zip(counts, c)]
    heads.train()
    return [a / b if b else 0.0 for a, b in zip(hits, counts)]


def _memory_note(device) -> str:
    """On CUDA, the allocator's state (a step slowed by a nearly full GPU shows as retries:
    cudaFree and cudaMalloc again, each a device-wide synchronisation)."""
    if torch.device(device).type != "cuda":
        return ""
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    gib = 1 << 30
    return (f" (GPU memory: {torch.cuda.memory_allocated(device) / gib:.1f} GiB allocated, "
            f"{torch.cuda.memory_reserved(device) / gib:.1f} GiB reserved, {free / gib:.1f} of {total / gib:.1f} GiB "
            f"free; {stats.get('num_alloc_retries', 0)} allocator retries, {stats.get('num_ooms', 0)} OOMs)")


def _fmt(accuracy: list[float]) -> str:
    return " ".join(f"h{k} {a:.3f}" for k, a in enumerate(accuracy))


# --------------------------------------------------------------------------- checkpoints, output


def _rng_state() -> dict:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng(state: dict) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_checkpoint(path: Path, heads, opt, sched, step: int, position: int, holdout: int,
                     labels: str | None = None) -> None:
    from safetensors.torch import save_file

    tmp = path.parent / f".{path.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}, tmp / "heads.safetensors")
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": _rng_state()},
               tmp / "training_state.pt")
    (tmp / _STATE).write_text(json.dumps({"step": step, "data_position": position, "holdout": holdout,
                                          "labels": labels}))
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)


def _load_checkpoint(path: Path, heads, opt, sched) -> tuple[int, int, dict]:
    from safetensors.torch import load_file

    try:
        heads.load_state_dict(load_file(path / "heads.safetensors"))
        state = torch.load(path / "training_state.pt", weights_only=False)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        meta = json.loads((path / _STATE).read_text())
    except (OSError, RuntimeError, KeyError, ValueError) as e:
        raise UserError(f"--resume {path}: cannot read the checkpoint ({_why(e)})") from None
    return int(meta["step"]), int(meta["data_position"]), state["rng"]


def _checkpoint_state(path: Path) -> dict:
    """A checkpoint's trainer_state.json; one clear error if it cannot be read."""
    try:
        state = json.loads((path / _STATE).read_text())
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
        return state
    except (OSError, ValueError) as e:
        raise UserError(f"--resume {path}: cannot read the checkpoint ({_why(e)})") from None


def _checkpoint_labels(path: Path) -> str | None:
    """The label kind of the EAGLE run a checkpoint belongs to ("hard": a checkpoint from before it
    was kept, when every run trained on hard labels)."""
    return _checkpoint_state(path).get("labels", "hard")


def _checkpoint_holdout(path: Path) -> int:
    """The held-out count of the run a checkpoint belongs to (4: a checkpoint from before it was kept)."""
    try:
        return int(_checkpoint_state(path).get("holdout", 4))
    except (TypeError, ValueError) as e:
        raise UserError(f"--resume {path}: cannot read the checkpoint ({_why(e)})") from None


def _why(e: Exception) -> str:
    """An exception as one line: its type and its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _read_init(path: Path, method: str) -> tuple[dict, dict]:
    """The config and weights of the draft folder `path` (train-draft's OUT) that is to start a run
    of `method`; one clear error if it is not one, or of another method."""
    from safetensors.torch import load_file

    from ..runtime.models.draft import read_draft_json

    where = f"--init-from {path}"
    meta = read_draft_json(path, "--init-from")
    if meta.get("method") != method:
        raise UserError(f"{where}: a {meta.get('method')!r} draft cannot start a --method {method} run; allowed: a "
                        "draft of the same method")
    try:
        weights = load_file(path / "model.safetensors")
    except Exception as e:  # OS and safetensors' own errors alike: the file is not what train-draft wrote
        raise UserError(f"{where}: cannot read the draft ({_why(e)})") from None
    return meta, weights


def _apply_init(path: Path, meta: dict, weights: dict, heads: torch.nn.Module, target_folder: Path,
                log: Callable[[str], None]) -> None:
    """Start heads from the weights _read_init returned: the same sizes, else one clear error; another
    target's draft loads with a warning."""
    where = f"--init-from {path}"
    own = heads.state_dict()
    wrong = sorted(set(own) ^ set(weights)) or [k for k in own if tuple(own[k].shape) != tuple(weights[k].shape)]
    if wrong:
        k = wrong[0]
        have = tuple(weights[k].shape) if k in weights else "absent"
        want = tuple(own[k].shape) if k in own else "absent"
        raise UserError(f"{where}: its weights do not fit this run's draft ({k}: {have} there, {want} here); "
                        f"allowed: a draft of the same sizes (heads, layers, draft vocabulary)")
    heads.load_state_dict(weights)
    target = meta.get("target") if isinstance(meta.get("target"), dict) else {}
    if not same_target(target.get("sha256"), target_folder):
        log(f"warning: {where} was trained for another target ({target.get('model')}); its weights start this run "
            "all the same")
    training = meta.get("training") if isinstance(meta.get("training"), dict) else {}
    steps = training.get("steps")
    log(f"weights from {path} ({steps if steps is not None else '?'} steps trained there)")


def _latest(work: Path) -> Path | None:
    steps = [(int(p.name.split("-")[1]), p) for p in work.glob("checkpoint-*") if p.name.split("-")[1].isdigit()]
    return max(steps)[1] if steps else None


def _save_draft(work: Path, heads: torch.nn.Module, sizes: dict, cfg: DraftConfig, folder: Path, target,
                num_sequences: int, result: TrainResult, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    save_file({k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
               for k, v in heads.state_dict().items()},
              work / "model.safetensors", metadata={"format": "pt"})
    training = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()
                if k not in ("target", "out", "overwrite", "resume", "exclude_prompts")}
    config = {
        "method": cfg.method,
        **sizes,
        "dtype": str(dtype).removeprefix("torch."),
        "target": {
            "model": str(cfg.target),
            "sha256": target_identity(folder),
            "architectures": list(getattr(target.config, "architectures", None) or []),
        },
        "training": {**training, "steps": result.step, "num_sequences": num_sequences,
                     "final_loss": result.losses[-1][1] if result.losses else None,
                     "heldout_top1": result.accuracy},
    }
    (work / "config.json").write_text(json.dumps(config, indent=2) + "\n")
