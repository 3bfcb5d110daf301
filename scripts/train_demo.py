"""Train the embedded ``demo`` model (engine/model/demo) from scratch on this machine's CPU.

    .venv/bin/python scripts/train_demo.py [--out engine/model/demo] [--steps N] [--quick]

What it does, all from fixed seeds:
1. generates a corpus (cpserve/demo_text.py: stories, chat turns, pass-key and key–value
   retrieval tasks) and trains a byte-level BPE tokenizer on it with the ``tokenizers`` library;
2. builds transformers' ``DeepseekV3ForCausalLM`` (MLA, dense MLP) from :data:`MODEL` and
   trains it with AdamW, bf16 autocast over fp32 weights, in phases of growing sequence length
   (:data:`PHASES`; random tokens repeated and random name–code pairs asked again first, where
   copying and binding a value to its key are learnt, and kept in the mix throughout), the loss
   the mean over text tokens plus the mean over answer tokens (none on a retrieval task's
   prompt: the model reads a haystack, it is not taught to write one);
3. writes the Hugging Face release folder (config.json with yarn rotary scaling past the
   training length, model.safetensors in fp32, generation_config.json, tokenizer.json and
   tokenizer_config.json with a chat template), a loss curve (docs/demo-training.png) and
   train_log.json, and prints the sha256 of model.safetensors.

The same script on the same CPU type writes the same bytes (the steps are fixed, not timed; the
data comes from one seeded ``random.Random``; torch runs on a fixed thread count). On another CPU
type oneDNN may choose other bf16 kernels, so the bits — not the behaviour — can differ: compare
the printed checksum with train_log.json's, and the accuracy with bench/needle.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cpserve import demo_text  # noqa: E402

SEED = 1234
VOCAB = 1024
SPECIALS = ["<bos>", "<eos>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
# Assistant turns end with EOS, so a generated answer stops there.
# (No newline right after a block tag: transformers renders with trim_blocks, which drops it.)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
                 "{{ eos_token if m['role'] == 'assistant' else '' }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MODEL = dict(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32,
    v_head_dim=48, n_routed_experts=0, n_shared_experts=0, first_k_dense_replace=4, rope_interleave=True,
    tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=2, initializer_range=0.02,
)
# Short rows first (cheap text and first retrieval), then long ones.
# (steps, sequence length, rows per step, data): first only random tokens repeated (the repeated
# half can only be predicted by copying, so the copying circuit forms before retrieval needs it)
# and random name–code pairs asked again (only the name says which code follows: the binding
# key–value lookup needs), then everything, RANDOM_SHARE of it still those two.
# Many small steps: the copying circuit forms after a number of updates, not of tokens.
# Then 400 steps at each of 1,024 / 2,048 / 4,096 tokens, where retrieval learns to pick one
# needle out of thousands of tokens (the fused attention kernel, below, makes a 4,096-token step
# ~1.2 s here instead of ~3.8 s). The longest phase's length is the training length; from its
# first step on the model trains with yarn (below). The last, short phase at 512 tokens brings
# the chat turns back after the long rows.
PHASES = [(500, 128, 16, "copy"), (2200, 256, 8, "all"), (400, 512, 4, "all"), (400, 1024, 2, "all"),
          (400, 2048, 1, "all"), (400, 4096, 1, "all"), (200, 512, 4, "all")]
LR, WARMUP, WEIGHT_DECAY = 1.5e-3, 100, 0.1
# Yarn: the phases before the training length train with default rotary; from the first phase at
# the training length on, the model trains with yarn scaling by YARN_FACTOR over it, which the
# release config keeps, so positions up to 8 × the training length reuse rotation angles the model
# has seen (the slow dimensions are interpolated); those phases adapt it to the changed frequencies.
YARN_FACTOR = 8.0
TASK_SHARE = 0.5  # rows that start with a retrieval task (the rest: stories and chat)
RANDOM_SHARE = 0.3  # "all" rows of random tokens repeated or name–code pairs (copying and binding stay trained)
BF16 = True  # bf16 autocast: 2x faster than fp32 on this CPU, and copying forms as fast (pilot)


# ---- tokenizer ---------------------------------------------------------------------------------
def train_tokenizer(rng: random.Random):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[AddedToken(s, special=True, normalized=False)
                                                                    for s in SPECIALS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    count = len  # characters stand in for tokens while the tokenizer does not exist yet
    texts = [demo_text.story(rng) for _ in range(4000)]
    texts += [" ".join(demo_text.chat_pair(rng)) for _ in range(4000)]
    texts += [demo_text.passkey_task(rng, 400, rng.random(), count).prompt for _ in range(100)]
    texts += [demo_text.kv_task(rng, 400, rng.random(), count).prompt for _ in range(100)]
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", 0)])
    assert [tok.token_to_id(s) for s in SPECIALS] == list(range(len(SPECIALS)))
    return tok


def tokenizer_files(tok) -> dict[str, str]:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False,
              "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
              "additional_special_tokens": SPECIALS[3:], "model_max_length": 32768,
              "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    return {"tokenizer.json": tok.to_str(pretty=True), "tokenizer_config.json": json.dumps(config, indent=2)}


# ---- data --------------------------------------------------------------------------------------
TEXT, ANSWER, SKIP = 0, 1, 2  # what a token's loss counts as


class Rows:
    """Training rows of ``length + 1`` token ids with a mask per token: :data:`TEXT` (the text
    loss), :data:`ANSWER` (copied or retrieved: the answer loss) or :data:`SKIP` (no loss)."""

    def __init__(self, tok, rng: random.Random):
        self.tok, self.rng = tok, rng
        self.bos, self.eos = tok.token_to_id("<bos>"), tok.token_to_id("<eos>")

        @lru_cache(maxsize=1 << 16)
        def count(text: str) -> int:
            return len(tok.encode(text, add_special_tokens=False).ids)

        self.count = count

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def turn(self, user: str, answer: str) -> tuple[list[int], list[int]]:
        """One chat turn as the template renders it (the mask all 0)."""
        prompt = [self.bos] + self.encode(f"<|user|>\n{user}\n<|assistant|>\n")
        reply = self.encode(answer) + [self.eos]
        return prompt + reply, [0] * (len(prompt) + len(reply))

    def task(self, n_tokens: int):
        """A pass-key or key–value task of about ``n_tokens`` tokens, the needle at any depth."""
        if self.rng.random() < 0.5:
            t = demo_text.passkey_task(self.rng, n_tokens, self.rng.random(), self.count)
        else:
            t = demo_text.kv_task(self.rng, n_tokens, self.rng.random(), self.count, pairs=self.rng.randint(1, 4))
        ids, mask = self.turn(t.prompt, t.answer)
        # No loss on the task's prompt: its haystack is story sentences with a needle sentence
        # ("The pass key is 71432.") among them, and a model taught to write that text writes
        # pass keys into the stories it is asked for. The model reads the prompt; it is not
        # taught to write it.
        prompt_len = len(ids) - 1 - len(self.encode(t.answer))
        mask[1:prompt_len] = [SKIP] * (prompt_len - 1)
        # The answer loss is on what must be retrieved: the needle's digits (and the asked name,
        # copied from the question); the rest of the answer is a fixed phrase, learnt as text.
        answer = self.encode(t.answer)
        start = len(ids) - 1 - len(answer)
        for i, token in enumerate(answer):
            mask[start + i] = self.tok.id_to_token(token).lstrip("Ġ") in self.retrieved(t)
        return ids, mask

    @staticmethod
    def retrieved(t) -> set[str]:
        words = set(t.value)  # digits are single tokens
        if t.kind == "kv":
            words.add(t.answer.split()[3])  # "The code for NAME is ..."
        return words

    def repeat(self) -> tuple[list[int], list[int]]:
        """Words to repeat; the mask marks the answer's repeated words."""
        user, answer = demo_text.repeat_pair(self.rng)
        ids, mask = self.turn(user, answer)
        words = set(user.split(": ")[1].split())
        n = len(self.encode(answer)) + 1
        return ids, mask[: len(mask) - n] + [self.tok.id_to_token(t).lstrip("Ġ") in words for t in ids[len(ids) - n:]]

    def random_repeat(self, length: int, rng: random.Random | None = None) -> tuple[list[int], list[int]]:
        """Segments of different random tokens (from the whole vocabulary, or digits), each
        followed by itself: the repeated half can only be predicted by copying (the token
        before names the one to copy), so this is where the copying circuit forms. The mask
        marks the repeated half (less its first token, which nothing predicts)."""
        rng, ids, mask = rng or self.rng, [], []
        digits = [self.tok.token_to_id(d) for d in "0123456789"]
        names = digits + [self.tok.token_to_id("Ġ" + n) for n in demo_text.NAMES]
        while len(ids) < length + 1:
            pick = rng.random()
            pool = digits if pick < 0.5 else names if pick < 0.75 else range(len(SPECIALS), VOCAB)
            s = rng.sample(pool, rng.randint(4, min(len(pool), max(8, length // 8))))
            ids += [self.bos] + s + s
            mask += [0] * (len(s) + 2) + [1] * (len(s) - 1)
        return ids[: length + 1], mask[: length + 1]

    def random_kv(self, length: int, rng: random.Random | None = None) -> tuple[list[int], list[int]]:
        """Segments of name–code pairs (``NAME is DDDDD``, a few random tokens between them), then
        the same names asked again in another order, each followed by its code: the first digit
        of an asked code follows ``is`` as in every pair, so only the name before ``is`` says
        which code comes (the binding key–value retrieval needs; copying the digits alone picks
        any code). The mask marks the asked codes' digits."""
        rng, ids, mask = rng or self.rng, [], []
        names = [self.tok.token_to_id("Ġ" + n) for n in demo_text.NAMES]
        # " is 54390" is the tokens "Ġis", "Ġ", then the digits, as in the tasks' text
        is_ = [self.tok.token_to_id("Ġis"), self.tok.token_to_id("Ġ")]
        digits = {d: self.tok.token_to_id(d) for d in "0123456789"}
        filler = range(len(SPECIALS), VOCAB)
        while len(ids) < length + 1:
            pairs = [(n, [digits[d] for d in demo_text.number(rng)]) for n in rng.sample(names, rng.randint(2, 8))]
            seg, m = [self.bos], [0]
            for n, code in pairs:
                gap = rng.sample(filler, rng.randint(0, 6))
                seg += gap + [n, *is_] + code
                m += [0] * (len(gap) + 8)
            asked = rng.sample(pairs, rng.randint(1, len(pairs)))
            for n, code in asked:
                seg += [n, *is_] + code
                m += [0, 0, 0] + [1] * 5
            ids, mask = ids + seg, mask + m
        return ids[: length + 1], mask[: length + 1]

    def row(self, length: int) -> tuple[list[int], list[int]]:
        """Random tokens repeated or random name–code pairs (:data:`RANDOM_SHARE` of the rows,
        half each), or else: a retrieval task
        filling most of the row (half the rows), then shorter tasks, words
        to repeat, chat turns and stories up to ``length + 1`` tokens. The mask marks what is
        copied from earlier in the row: a task answer's needle digits and name, a repeated
        number's digits; a chat answer is text."""
        rng = self.rng
        if rng.random() < RANDOM_SHARE:
            return (self.random_repeat if rng.random() < 0.5 else self.random_kv)(length)
        ids, mask = self.task(int(length * (0.1 + 0.85 * rng.random() ** 0.5))) if rng.random() < TASK_SHARE \
            else ([], [])
        while len(ids) < length + 1:
            room = length + 1 - len(ids)
            pick = rng.random()
            if pick < 0.25 and room > 96:
                more, m = self.task(rng.randint(64, room - 32))
            elif pick < 0.37:
                more, m = self.repeat()
            elif pick < 0.72:
                more = self.turn(*demo_text.chat_pair(rng))[0]
                m = [0] * len(more)
            else:
                more = [self.bos] + self.encode(demo_text.story(rng)) + [self.eos]
                m = [0] * len(more)
            ids, mask = ids + more, mask + m
        return ids[: length + 1], mask[: length + 1]

    def batch(self, length: int, rows: int, data: str = "all"):
        import torch

        rng = self.rng
        pairs = [((self.random_repeat if rng.random() < 0.5 else self.random_kv) if data == "copy" else self.row)(length)
                 for _ in range(rows)]
        ids = torch.tensor([p[0] for p in pairs])
        mask = torch.tensor([p[1] for p in pairs], dtype=torch.int8)
        return ids[:, :-1], ids[:, 1:], mask[:, 1:]


# ---- model -------------------------------------------------------------------------------------
def hf_config(train_len: int, yarn: bool):
    """The model's config: default rotary (``yarn=False``), or yarn ×:data:`YARN_FACTOR` over
    ``train_len`` positions (DeepSeek-V3's mscale convention: the softmax scale grows by
    mscale², cos/sin stay unscaled)."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope.update(rope_type="yarn", factor=YARN_FACTOR, original_max_position_embeddings=train_len,
                    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    return transformers.DeepseekV3Config(**MODEL, max_position_embeddings=int(train_len * YARN_FACTOR),
                                         rope_parameters=rope)


TRAIN_ATTENTION = "sdpa_padded_v"


def register_training_attention() -> None:
    """Attention for training: torch's fused causal kernel wants one head size for q, k and v,
    and this model's values (48) are narrower than its queries and keys (64), which sends
    ``scaled_dot_product_attention`` to its unfused path (3x slower at 4,096 tokens here). The
    values are padded with zeros to 64 and the output cut back to 48: the same numbers (the
    padded columns only ever multiply zeros), the fused kernel. Only training uses it; the
    saved model is an ordinary checkpoint."""
    import torch.nn.functional as F
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attention(module, query, key, value, attention_mask, **kwargs):
        width = value.shape[-1]
        if width < query.shape[-1]:
            value = F.pad(value, (0, query.shape[-1] - width))
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return out[..., :width], weights

    AttentionInterface.register(TRAIN_ATTENTION, attention)
    AttentionMaskInterface.register(TRAIN_ATTENTION, sdpa_mask)


def use_rope(model, config) -> None:
    """Switch a model to ``config``'s rotary (frequencies and each attention layer's softmax
    scale); the parameters stay."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    model.config.rope_parameters = config.rope_parameters
    model.model.rotary_emb = hf.DeepseekV3RotaryEmbedding(config)
    for layer in model.model.layers:
        layer.self_attn.scaling = hf.yarn_apply_mscale(config.rope_parameters, layer.self_attn.qk_head_dim ** -0.5)


def loss_of(model, inp, tgt, mask):
    import torch.nn.functional as F

    logits = model(input_ids=inp).logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none").view(tgt.shape)
    text, answer = ce[mask == TEXT].mean(), ce[mask == ANSWER].mean() if (mask == ANSWER).any() else ce.new_zeros(())
    return text + answer, text.detach(), answer.detach()


def lr_at(step: int, total: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / max(total - WARMUP, 1))))


def probe(model, rows: Rows, length: int, n: int, rng: random.Random) -> float:
    """Greedy pass-key / key–value accuracy on ``n`` fresh tasks of about ``length`` tokens."""
    import torch

    right = {"passkey": 0, "kv": 0}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=BF16):
        pairs = [rows.random_repeat(256, rng) for _ in range(8)]
        ids = torch.tensor([p[0] for p in pairs])
        m = torch.tensor([p[1] for p in pairs], dtype=torch.bool)[:, 1:]
        copied = float((model(input_ids=ids[:, :-1]).logits.argmax(-1) == ids[:, 1:])[m].float().mean())
        for i in range(n):
            make = demo_text.passkey_task if i % 2 == 0 else demo_text.kv_task
            t = make(rng, length, rng.random(), rows.count)
            ids = rows.turn(t.prompt, "")[0][:-1]
            for _ in range(12):
                nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
                if nxt == rows.eos:
                    break
                ids.append(nxt)
            answer = rows.tok.decode(ids[-12:]).split("\n")[-1]
            right[t.kind] += demo_text.is_right(t, answer)
    print(f"\nprobe: copy accuracy {copied:.3f}; at {length} tokens: pass key {right['passkey']}/{(n + 1) // 2}, "
          f"key-value {right['kv']}/{n // 2} right; last: {answer!r} for {t.answer!r}", flush=True)
    return sum(right.values()) / n


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def plot(log: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    steps = [r["step"] for r in log]
    window = 50  # rows differ a lot (random tokens, stories, tasks): a mean over the last 50 steps

    def smooth(values: list[float]) -> list[float]:
        return [sum(values[max(0, i - window + 1): i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]

    ax.plot(steps, smooth([r["text_loss"] for r in log]), label=f"text tokens (mean of {window} steps)")
    ax.plot(steps, smooth([r["answer_loss"] for r in log]), label=f"answer tokens (mean of {window} steps)")
    start = 0
    for n, length, *_ in PHASES:
        ax.axvline(start, color="grey", lw=0.5)
        ax.text(start, ax.get_ylim()[1] * 0.9, f" {length}", fontsize=8)
        start += n
    ax.set_yscale("log")
    ax.set_xlabel("step (phase: sequence length)")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title("demo model training")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "engine" / "model" / "demo"), help="checkpoint folder to write")
    p.add_argument("--plot", default=str(ROOT / "docs" / "demo-training.png"))
    p.add_argument("--threads", type=int, default=2, help="torch threads (part of what makes runs repeat)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every phase's steps (short trial runs)")
    p.add_argument("--probe-every", type=int, default=300, help="steps between retrieval probes (0: none)")
    args = p.parse_args(argv)

    # Idle OpenMP threads sleep instead of spinning: on a shared machine spinning threads stall
    # each other at every barrier (4x slower here under load); the arithmetic is the same.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    import transformers
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    t_start = time.time()
    tok = train_tokenizer(random.Random(SEED))
    rows = Rows(tok, rng)
    phases = [(max(1, round(n * args.scale)), length, b, data) for n, length, b, data in PHASES]
    total = sum(n for n, *_ in phases)
    train_len = max(length for _, length, *_ in phases)
    yarn_from = next(i for i, (_, length, *_) in enumerate(phases) if length == train_len)
    register_training_attention()
    config = hf_config(train_len, yarn=False)
    config._attn_implementation = TRAIN_ATTENTION
    model = transformers.DeepseekV3ForCausalLM(config)
    model.train()
    decay = [p_ for n, p_ in model.named_parameters() if p_.dim() >= 2]
    no_decay = [p_ for n, p_ in model.named_parameters() if p_.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    print(f"model: {sum(p_.numel() for p_ in model.parameters()) / 1e6:.2f} M parameters; "
          f"{total} steps in phases {phases}", flush=True)
    log: list[dict] = []
    step, t_train = 0, time.time()
    bar = tqdm(total=total, unit="step", dynamic_ncols=True, mininterval=2)
    probe_rng = random.Random(SEED + 1)
    for i, (n, length, batch, data) in enumerate(phases):
        if i == yarn_from:
            use_rope(model, hf_config(train_len, yarn=True))
        for _ in range(n):
            inp, tgt, mask = rows.batch(length, batch, data)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=BF16):
                loss, text, answer = loss_of(model, inp, tgt, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            entry = {"step": step, "length": length, "data": data, "text_loss": round(float(text), 4),
                     "answer_loss": round(float(answer), 4)}
            if args.probe_every and (step % args.probe_every == 0 or step == total):
                model.eval()
                entry["probe_accuracy"] = probe(model, rows, min(length, 1024), 8, probe_rng)
                model.train()
            log.append(entry)
            bar.set_postfix(len=length, text=f"{float(text):.3f}", answer=f"{float(answer):.3f}",
                            **({"probe": entry["probe_accuracy"]} if "probe_accuracy" in entry else {}))
            bar.update(1)
    bar.close()
    train_s = time.time() - t_train

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.config._attn_implementation = "sdpa"  # the checkpoint names no training-only kernel
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)
    for name, text in tokenizer_files(tok).items():
        (out / name).write_text(text)
    checksum = sha256(out / "model.safetensors")
    record = {"seed": SEED, "phases": phases, "threads": args.threads, "parameters": sum(p_.numel() for p_ in model.parameters()),
              "wall_s": round(time.time() - t_start, 1), "train_s": round(train_s, 1),
              "steps_per_s": round(total / train_s, 3), "tokens_per_s": round(sum(n * l * b for n, l, b, _ in phases) / train_s, 1),
              "model_safetensors_sha256": checksum, "torch": torch.__version__, "transformers": transformers.__version__,
              "final": log[-1], "log": log}
    (out / "train_log.json").write_text(json.dumps(record, indent=1))
    plot(log, Path(args.plot))
    print(f"wrote {out} in {record['wall_s']} s ({record['steps_per_s']} steps/s, {record['tokens_per_s']} tokens/s); "
          f"loss curve {args.plot}")
    print(f"sha256(model.safetensors) = {checksum}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
