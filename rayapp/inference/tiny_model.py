"""The tiny CPU model the ``hf`` backend serves by default, built offline on first use.

It exists so tests, demos and CPU-only machines have a real model that needs no download and that
GRPO can visibly improve within minutes (docs/training.md, "What it learns, and why it can").
``ensure_tiny_model()`` returns the build shipped with the package (``SHIPPED``), else builds one into
the cache from the caller's ``TrainingData`` (the recipe's is ``rayapp.envs.tiny_model_recipe``, so
nothing here imports an environment). Invariants: the build touches no network, is deterministic,
and is atomic and idempotent (a temporary sibling folder moved into place under an ``flock``; a
folder is used only once its manifest is in place); the shipped build's manifest matches the code.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_NAME = "tiny-llama-v1"
RECIPE_VERSION = 2  # bump when anything below changes what gets built
MANIFEST = "rayapp_tiny_model.json"  # written last: its presence marks a complete build
SHIPPED = Path(__file__).with_name(MODEL_NAME)  # this recipe's build, shipped with the package
WEIGHTS = "model.safetensors"
SEED = 1234
PRETRAIN_STEPS = 1200
BATCH_SIZE = 32

Example = tuple[list[int], list[float]]  # token ids, and the loss weight of each next-token prediction
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
ROLES = ("system", "user", "assistant", "tool")
SPECIAL_TOKENS = [PAD, BOS, EOS, *(f"<|{role}|>" for role in ROLES)]  # ids 0..6: pad 0, bos 1, eos 2

# One line, no whitespace between tags: every character the template renders is meant. Each turn is
# ``<|role|>content<|eos|>``; the assistant's content and eos sit in a generation block so that
# ``return_assistant_tokens_mask=True`` yields the loss mask an agent needs.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

MODEL_CONFIG = dict(
    vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True, rms_norm_eps=1e-5,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """transformers' progress bars off for a block (load/save bars are noise in Ray logs)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


PACKAGE = Path(__file__).resolve().parents[1]  # rayapp's own folder (in a checkout, or site-packages)


def default_cache_dir() -> Path:
    """rayapp's cache (a built tiny model, the tokenizer files engines hand the manager): ``$RAYAPP_CACHE``
    when set, else ``~/.cache/rayapp``, read by each process from its own environment and home (a Ray
    worker, a Serve replica: the environment of the ``ray start`` that made its node, or its runtime_env's
    ``env_vars``). Absolute (``~`` expanded), never inside rayapp's own folder: a relative path would be read
    against each process's working directory, which in a replica can be anywhere, the package included."""
    given = os.environ.get("RAYAPP_CACHE")
    path = Path(given).expanduser() if given else Path.home() / ".cache" / "rayapp"
    if not path.is_absolute():
        raise ValueError(f"RAYAPP_CACHE={given!r} is a relative path: give an absolute one (each Ray process "
                         "would read it against its own working directory)")
    path = path.resolve()
    if path == PACKAGE or PACKAGE in path.parents:
        where = f"RAYAPP_CACHE={given!r}" if given else f"the default cache {path}"
        raise ValueError(f"{where} is inside rayapp's own folder {PACKAGE}: give a folder outside it "
                         "(the default is ~/.cache/rayapp)")
    return path


@dataclass(frozen=True)
class TrainingData:
    """What the tiny model learns from, handed in by the caller: ``corpus()`` the lines its tokenizer
    is trained on; ``batches(tokenizer, steps, batch_size)`` one pretraining batch per step, each
    example token ids with the loss weight of each next-token prediction."""

    corpus: Callable[[], list[str]]
    batches: Callable[[Any, int, int], list[list[Example]]]


def ensure_tiny_model(cache_dir: str | os.PathLike | None = None, training: TrainingData | None = None) -> Path:
    """The tiny model's folder: the shipped build (``SHIPPED``) when it is this recipe's, else
    ``<cache>/models/tiny-llama-v1``, built there first from ``training`` if missing (without it, a
    missing build is a FileNotFoundError saying how to make one)."""
    if is_complete(SHIPPED):
        return SHIPPED
    dest = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / "models" / MODEL_NAME
    if training is None and not is_complete(dest):
        raise FileNotFoundError(f"the tiny model is neither shipped ({SHIPPED}) nor built ({dest}): run "
                                "`make tiny-model`, or pass rayapp.envs.tiny_model_recipe.TRAINING to build it")
    return ensure_built(dest, lambda folder: build_tiny_model(folder, training))


# -- atomic, idempotent build ---------------------------------------------------------------------

_thread_lock = threading.Lock()  # flock is per open file; this keeps threads of one process polite too


def is_complete(folder: Path) -> bool:
    try:
        return json.loads((folder / MANIFEST).read_text()).get("recipe_version") == RECIPE_VERSION
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with _thread_lock, open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, also when the process dies
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_built(dest: Path, build: Callable[[Path], dict]) -> Path:
    """Run ``build(tmp)`` once for ``dest``, whatever the number of concurrent callers.

    ``build`` writes the files into an empty folder and returns the manifest to record; the folder
    becomes ``dest`` in one ``os.replace``. A stale or incomplete ``dest`` (an older recipe) is moved
    aside first and removed, so readers never see half a model."""
    if is_complete(dest):
        return dest
    with _exclusive(dest.parent / f".{dest.name}.lock"):
        if is_complete(dest):  # another process built it while we waited
            return dest
        for stale in dest.parent.glob(f".{dest.name}.tmp-*"):  # left by a builder that died: we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            manifest = build(tmp)
            (tmp / MANIFEST).write_text(json.dumps({**manifest, "recipe_version": RECIPE_VERSION}, indent=1))
            if dest.exists():
                old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
                os.replace(dest, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already on success
    return dest


# -- tokenizer ------------------------------------------------------------------------------------

def build_tokenizer(lines: list[str]):
    """A byte-level BPE ``PreTrainedTokenizerFast`` (any text encodes; nothing maps to unk)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # one token per digit: numbers then read and copy the same way whatever their length
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=MODEL_CONFIG["vocab_size"], special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[3:], chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False, model_max_length=MODEL_CONFIG["max_position_embeddings"],
    )


def load_tokenizer(path: str | os.PathLike):
    """Load a tokenizer from a local folder, never from a hub."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


# -- model ----------------------------------------------------------------------------------------



def pretrain(model, tokenizer, batches: list[list[Example]], lr: float = 1e-2) -> list[float]:
    """A short, seeded run of next-token training on the assistant replies of arithmetic chats, one
    step per batch (``tiny_model_recipe.pretrain_batches``).

    Loss covers the reply and its eos only: the question's numbers are unpredictable, and the reply's
    format is what rollouts need. Returns the loss curve (recorded in the manifest)."""
    import torch

    steps = len(batches)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.05, 1 - s / steps))
    model.train()
    losses = []
    for step in range(steps):
        batch = batches[step]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
        weights = torch.zeros((len(batch), width))
        mask = torch.zeros_like(ids)
        for row, (seq, w) in enumerate(batch):
            ids[row, :len(seq)] = torch.tensor(seq)
            weights[row, :len(seq)] = torch.tensor(w)
            mask[row, :len(seq)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="none").view(len(batch), -1)
        w = weights[:, 1:]  # token j + 1's weight scores the prediction made at j
        loss = (nll * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(round(loss.item(), 4))
    model.eval()
    return losses


def build_tiny_model(folder: Path, training: TrainingData, pretrain_steps: int = PRETRAIN_STEPS) -> dict:
    """Write tokenizer + model, learnt from ``training``, into ``folder``; return the manifest.
    Deterministic for a given recipe."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same float reduction order, hence the same weights
    try:
        tokenizer = build_tokenizer(training.corpus())
        assert tokenizer.convert_tokens_to_ids([PAD, BOS, EOS]) == [0, 1, 2], "special token ids moved"
        torch.manual_seed(SEED)
        config = LlamaConfig(**MODEL_CONFIG)
        model = LlamaForCausalLM(config).to(torch.float32)
        batches = training.batches(tokenizer, pretrain_steps, BATCH_SIZE)
        losses = pretrain(model, tokenizer, batches) if batches else []
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        tokenizer.save_pretrained(folder)
        with quiet_progress():
            model.save_pretrained(folder)  # safetensors
    finally:
        torch.set_num_threads(threads)
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "name": MODEL_NAME, "seed": SEED, "pretrain_steps": pretrain_steps, "params": n_params,
        "config": MODEL_CONFIG, "loss_first": losses[:1], "loss_last": losses[-5:],
        "training_sha256": data_digest(tokenizer, batches), "weights_sha256": file_digest(folder / WEIGHTS),
        "build_seconds": round(time.perf_counter() - t0, 2),
    }


def data_digest(tokenizer, batches: list[list[Example]]) -> str:
    """sha256 of what the build learns from: the tokenizer's vocabulary and merges and every pretraining
    example (token ids and loss weights)."""
    h = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
    for batch in batches:
        for ids, weights in batch:
            h.update(json.dumps([ids, weights]).encode())
    return h.hexdigest()


def file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
