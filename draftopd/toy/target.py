"""Build the toy target: a byte-level BPE tokenizer and a small Llama trained on the toy corpus.

The committed checkpoint in `draftopd/assets/toy-target` was made by
`draftopd make-toy-target`; running it again with the same arguments rebuilds an
equivalent model (same data, same seed; CPU float maths may differ in the last bits).
The checkpoint is a plain Hugging Face directory, so `AutoModelForCausalLM`,
`AutoTokenizer` and vLLM load it as they would any Llama.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draftopd.toy.corpus import Sample, build_corpus

# Special tokens; `<|mask|>` is reserved for parallel and diffusion drafters.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


@dataclass
class ToyTargetSpec:
    """Shape and training budget of the toy target."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    seq_len: int = 256
    batch_size: int = 32
    lr: float = 3e-3
    minutes: float = 30.0
    num_arithmetic: int = 60000
    seed: int = 0


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with single-digit numbers (so arithmetic is learnable) and our specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def render(tokenizer, sample: Sample) -> str:
    return tokenizer.apply_chat_template(sample.messages, tokenize=False)


def _pack(token_lists: list[list[int]], seq_len: int, sep: int) -> torch.Tensor:
    """Concatenate documents (separated by `sep`) and cut into rows of seq_len + 1."""
    flat: list[int] = []
    for ids in token_lists:
        flat.extend(ids)
        flat.append(sep)
    n = (len(flat) - 1) // seq_len
    data = torch.tensor(flat[: n * seq_len + 1])
    return torch.stack([data[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)])


def llama_config(spec: ToyTargetSpec, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


@torch.no_grad()
def held_out_loss(model, rows: torch.Tensor, batch_size: int = 32) -> float:
    """Mean next-token cross-entropy in nats per token over packed held-out rows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        batch = rows[i : i + batch_size]
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += batch[:, 1:].numel()
    model.train()
    return total / count


def train_for(model, rows: torch.Tensor, batch_size: int, peak_lr: float, minutes: float, seed: int, desc: str) -> int:
    """Next-token training on random packed rows for `minutes` of wall time; returns the number of steps."""
    from tqdm import tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget = minutes * 60
    start, step, warmup = time.monotonic(), 0, 100
    bar = tqdm(total=int(budget), desc=desc, unit="s")
    gen = torch.Generator().manual_seed(seed)
    while (elapsed := time.monotonic() - start) < budget:
        # Cosine schedule on wall time, so a fixed budget always ends at a low learning rate.
        frac = elapsed / budget
        lr = peak_lr * min(1.0, (step + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = rows[torch.randint(len(rows), (batch_size,), generator=gen)]
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        bar.n = int(min(elapsed, budget))
        bar.set_postfix(step=step, loss=f"{loss.item():.3f}", lr=f"{lr:.1e}")
    bar.close()
    return step


def make_toy_target(out_dir: str | Path, spec: ToyTargetSpec | None = None) -> dict:
    """Build corpus and tokenizer, train the toy Llama for `spec.minutes`, save it; returns the report."""
    from transformers import LlamaForCausalLM

    spec = spec or ToyTargetSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    train, held = build_corpus(spec.num_arithmetic, spec.seed)
    tokenizer = train_tokenizer([m["content"] for s in train for m in s.messages], spec.vocab_size)
    encode = lambda samples: [tokenizer(render(tokenizer, s), add_special_tokens=False).input_ids for s in samples]  # noqa: E731
    random.Random(spec.seed).shuffle(train)
    train_rows = _pack(encode(train), spec.seq_len, tokenizer.pad_token_id)
    held_rows = _pack(encode(held), spec.seq_len, tokenizer.pad_token_id)
    model = LlamaForCausalLM(llama_config(spec, tokenizer))
    step = train_for(model, train_rows, spec.batch_size, spec.lr, spec.minutes, spec.seed, "toy target")
    report = {
        "held_out_loss_nats_per_token": held_out_loss(model, held_rows),
        "uniform_loss_nats_per_token": math.log(spec.vocab_size),
        "train_steps": step,
        "train_tokens": step * spec.batch_size * spec.seq_len,
        "minutes": spec.minutes,
        "num_train_samples": len(train),
        "num_held_out_samples": len(held),
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # The generic class name keeps the tokenizer loadable by older transformers and by serving engines.
    tok_cfg = out / "tokenizer_config.json"
    tok_cfg.write_text(
        json.dumps({**json.loads(tok_cfg.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n"
    )
    (out / "toy_target_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
