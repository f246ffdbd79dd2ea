#!/usr/bin/env python3
"""The model's own answers to training prompts, generated in large batches with PyTorch on a GPU.

`train_exit_head` answers its prompts with the Rust model, a few sequences at a time: fine on a
CPU, slow on a GPU through burn (a decoding step is ≈ 1,000 small kernel launches for one row).
This script does the same job where PyTorch and CUDA are at hand, hundreds of prompts per step:

1. `train_exit_head --export-prompts ids.jsonl --num-prompts N --prompts prompts.jsonl` writes
   the chat prompts' token ids (the Rust tokenizer and chat template, so nothing is re-implemented
   here);
2. this script reads the GGUF model file (LLaMA, F32/F16/Q8_0/Q4_0/Q4_1 tensors, dequantized to
   f32), answers every prompt greedily (sample 0) and `--samples K` more times by sampling at
   `--temperature` / `--top-p` (samples 1..K), and appends `train_exit_head`'s data lines
   (`{"prompt", "sample", "tokens", "prompt_len"}`, EOS kept, at most `--max-new-tokens`);
3. `train_exit_head --data answers.jsonl --sampled K ...` trains on them (the teacher is always
   the Rust model; these are only the texts).

Answers are whole rounds (all prompts greedy, then all prompts' sample 1, ...); `--time-limit`
stops starting rounds, and the last line printed says how many rounds are complete. Answers
already in `--out` are kept and not asked again (a stopped run goes on where it was). Greedy
answers match the Rust model's token for token except where two logits nearly tie (f32 sums in
another order). No benchmark question is ever answered here: the prompts come from the file.
Each round draws from its own seed (`--seed` × 1000 + round), so rounds can also be split over
processes sharing one GPU (`--first-sample S --samples K` answers rounds S..K), each writing its
own file, and the files joined: the same answers as one process, ≈ 1.5× faster together on
an H200 (one process leaves much of a large GPU idle).

    python3 scripts/torch_answers.py --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --prompts ids.jsonl --out answers.jsonl --samples 3 --batch 256
"""

import argparse
import json
import math
import struct
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

# GGUF metadata value types (gguf.md).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUF:
    """A GGUF file's metadata and tensors (read whole; the files this script serves are small)."""

    def __init__(self, path):
        with open(path, "rb") as f:
            self.buf = f.read()
        self.pos = 0
        if self._take(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        self.meta = {}
        for _ in range(n_kv):
            key = self._string()
            self.meta[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            kind, offset = self._unpack("<I"), self._unpack("<Q")
            infos.append((name, dims, kind, offset))
        align = int(self.meta.get("general.alignment", 32))
        start = (self.pos + align - 1) // align * align
        self.tensors = {name: (dims, kind, start + offset) for name, dims, kind, offset in infos}

    def _take(self, n):
        out = self.buf[self.pos : self.pos + n]
        if len(out) != n:
            raise ValueError("GGUF file ends early")
        self.pos += n
        return out

    def _unpack(self, fmt):
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self):
        return self._take(self._unpack("<Q")).decode("utf-8", errors="replace")

    def _value(self, kind):
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            inner, n = self._unpack("<I"), self._unpack("<Q")
            if inner in _SCALARS:  # numbers: read in one go (vocabularies are long)
                dtype = np.dtype(_SCALARS[inner])
                out = np.frombuffer(self.buf, dtype, n, self.pos)
                self.pos += n * dtype.itemsize
                return out
            return [self._value(inner) for _ in range(n)]
        raise ValueError(f"unknown GGUF metadata type {kind}")

    def tensor(self, name):
        """The tensor `name` as f32, shaped [rows, cols] for matrices (GGUF lists cols first)."""
        dims, kind, offset = self.tensors[name]
        n = math.prod(dims)
        if kind == 0:  # F32
            flat = np.frombuffer(self.buf, np.float32, n, offset)
        elif kind == 1:  # F16
            flat = np.frombuffer(self.buf, np.float16, n, offset).astype(np.float32)
        elif kind in (2, 3, 8):  # Q4_0, Q4_1, Q8_0: blocks of 32 weights
            flat = _dequantize(self.buf, kind, n, offset)
        else:
            raise ValueError(f"{name}: GGUF tensor type {kind} is not supported here")
        return flat.reshape(list(reversed(dims)))


def _dequantize(buf, kind, n, offset):
    blocks = n // 32
    if kind == 8:  # Q8_0: f16 scale, 32 × i8
        raw = np.frombuffer(buf, np.uint8, blocks * 34, offset).reshape(blocks, 34)
        d = raw[:, :2].copy().view(np.float16).astype(np.float32)
        q = raw[:, 2:].copy().view(np.int8).astype(np.float32)
        return (d * q).reshape(-1)
    size = 18 if kind == 2 else 20  # Q4_0: f16 d, 16 B; Q4_1: f16 d, f16 m, 16 B
    raw = np.frombuffer(buf, np.uint8, blocks * size, offset).reshape(blocks, size)
    d = raw[:, :2].copy().view(np.float16).astype(np.float32)
    qs = raw[:, size - 16 :]
    # Low nibbles are weights 0..15 of the block, high nibbles 16..31.
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    if kind == 2:
        return (d * (q - 8.0)).reshape(-1)
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    return (d * q + m).reshape(-1)


class Llama(torch.nn.Module):
    """LLaMA as GGUF stores it (q/k rows permuted for RoPE on adjacent pairs), f32."""

    def __init__(self, gguf, device):
        super().__init__()
        meta = gguf.meta
        arch = meta.get("general.architecture", "llama")
        if arch != "llama":
            raise ValueError(f"architecture {arch!r}: only llama is supported")
        self.layers = int(meta["llama.block_count"])
        self.heads = int(meta["llama.attention.head_count"])
        self.kv_heads = int(meta.get("llama.attention.head_count_kv", self.heads))
        self.eps = float(meta["llama.attention.layer_norm_rms_epsilon"])
        hidden = int(meta["llama.embedding_length"])
        self.head_dim = hidden // self.heads
        base = float(meta.get("llama.rope.freq_base", 10000.0))
        self.inv_freq = base ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)

        def t(name):
            return torch.from_numpy(np.array(gguf.tensor(name), dtype=np.float32)).to(device)

        self.embed = t("token_embd.weight")
        self.lm_head = t("output.weight") if "output.weight" in gguf.tensors else self.embed
        self.final_norm = t("output_norm.weight")
        names = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
        self.w = [{k: t(f"blk.{i}.{k}.weight") for k in names} for i in range(self.layers)]
        self.device = device

    def norm(self, x, gain):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * gain

    def rope(self, x, positions):
        """x [B, H, T, D]; positions [B, T] (a row's padding gets any position: it is masked)."""
        angles = positions.to(torch.float64)[:, None, :, None] * self.inv_freq.to(x.device)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)

    def forward(self, tokens, positions, cache, start, key_mask):
        """tokens [B, T] at cache slots start..start+T; key_mask [B, start+T] marks real keys.

        Returns the last position's logits [B, vocab]."""
        b, t = tokens.shape
        end = start + t
        x = self.embed[tokens]
        causal = torch.ones(t, end, dtype=torch.bool, device=self.device).tril(start)
        # A padding query sees itself alone (no row without keys: softmax would give NaN,
        # and NaN values in padding slots would poison real rows through 0 × NaN).
        itself = torch.zeros(t, end, dtype=torch.bool, device=self.device)
        itself[torch.arange(t), torch.arange(start, end)] = True
        mask = ((causal[None] & key_mask[:, None, :]) | itself[None])[:, None]  # [B, 1, T, end]
        for i, w in enumerate(self.w):
            h = self.norm(x, w["attn_norm"])
            q = (h @ w["attn_q"].T).view(b, t, self.heads, self.head_dim).transpose(1, 2)
            k = (h @ w["attn_k"].T).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            v = (h @ w["attn_v"].T).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = self.rope(q, positions), self.rope(k, positions)
            keys, values = cache[i]
            keys[:, :, start:end], values[:, :, start:end] = k, v
            a = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], attn_mask=mask, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(b, t, -1) @ w["attn_output"].T
            h = self.norm(x, w["ffn_norm"])
            x = x + (F.silu(h @ w["ffn_gate"].T) * (h @ w["ffn_up"].T)) @ w["ffn_down"].T
        return self.norm(x[:, -1], self.final_norm) @ self.lm_head.T

    def new_cache(self, b, length):
        shape = (b, self.kv_heads, length, self.head_dim)
        return [(torch.zeros(shape, device=self.device), torch.zeros(shape, device=self.device)) for _ in range(self.layers)]


def pick(logits, temperature, top_p, generator):
    """Greedy (temperature 0) or nucleus sampling, one token per row."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    choice = torch.multinomial(sorted_probs, 1, generator=generator)
    return order.gather(-1, choice).squeeze(-1)


@torch.inference_mode()
def answer(model, prompts, args, temperature, generator, eos):
    """Answers `prompts` [(index, ids)] in one batch: a list of (index, answer ids)."""
    b = len(prompts)
    longest = max(len(ids) for _, ids in prompts)
    pad = [longest - len(ids) for _, ids in prompts]
    dev = model.device
    tokens = torch.zeros(b, longest, dtype=torch.long, device=dev)
    for row, (_, ids) in enumerate(prompts):
        tokens[row, pad[row] :] = torch.tensor(ids, device=dev)
    pad_t = torch.tensor(pad, device=dev)
    total = longest + args.max_new_tokens
    key_mask = torch.arange(total, device=dev)[None] >= pad_t[:, None]
    positions = (torch.arange(longest, device=dev)[None] - pad_t[:, None]).clamp(min=0)
    cache = model.new_cache(b, total)
    logits = model.forward(tokens, positions, cache, 0, key_mask[:, :longest])
    out = torch.zeros(b, args.max_new_tokens, dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    lengths = torch.full((b,), args.max_new_tokens, device=dev)
    for step in range(args.max_new_tokens):
        token = pick(logits, temperature, args.top_p, generator)
        out[:, step] = token
        ended = (token == eos) & ~done
        lengths[ended] = step + 1
        done |= ended
        if step + 1 == args.max_new_tokens or bool(done.all()):
            break
        position = (longest + step - pad_t)[:, None]
        logits = model.forward(token[:, None], position, cache, longest + step, key_mask[:, : longest + step + 1])
    out, lengths = out.tolist(), lengths.tolist()
    return [(index, out[row][: lengths[row]]) for row, (index, _) in enumerate(prompts)]


def answered(path):
    """The (prompt, sample) pairs already in the data file, whose torn last line (a run killed
    while writing) is cut off so that appending goes on from a whole line."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return set()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    done = set()
    for line in data[:keep].splitlines():
        if line.strip():
            r = json.loads(line)
            done.add((int(r["prompt"]), int(r.get("sample", 0))))
    return done


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="GGUF model file")
    p.add_argument("--prompts", required=True, help="prompt ids from train_exit_head --export-prompts")
    p.add_argument("--out", required=True, help="data file to append to (train_exit_head --data)")
    p.add_argument("--samples", type=int, default=0, help="sampled answers per prompt besides the greedy one")
    p.add_argument("--first-sample", type=int, default=0,
                   help="first round to answer (0 = greedy): processes given disjoint rounds run side by side")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=256, help="most prompts per batch")
    p.add_argument("--batch-tokens", type=int, default=400_000, help="most cache slots (rows × length) per batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=0, help="first N prompts only (0 = all)")
    p.add_argument("--time-limit", type=float, default=0, help="start no round after this many seconds (0 = none)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    if not (args.temperature > 0 and 0 < args.top_p <= 1) or args.samples < 0 or args.batch < 1 or not 0 <= args.first_sample <= args.samples:
        sys.exit("--temperature must be > 0, --top-p in (0, 1], --samples ≥ 0, --batch ≥ 1 and 0 ≤ --first-sample ≤ --samples")
    torch.backends.cuda.matmul.allow_tf32 = False  # f32 sums, as close to the Rust model as it gets

    started = time.time()
    gguf = GGUF(args.model)
    eos = int(gguf.meta["tokenizer.ggml.eos_token_id"])
    context = int(gguf.meta.get("llama.context_length", 2048))
    model = Llama(gguf, args.device)
    del gguf
    prompts = []
    with open(args.prompts) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                prompts.append((int(r["prompt"]), [int(t) for t in r["tokens"]]))
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    for index, ids in prompts:
        if not ids or len(ids) + args.max_new_tokens > context:
            sys.exit(f"prompt {index}: {len(ids)} tokens + {args.max_new_tokens} new do not fit the context {context}")
    # Similar lengths share a batch (less padding).
    prompts.sort(key=lambda p: len(p[1]))
    print(f"loaded the model and {len(prompts)} prompts in {time.time() - started:.1f} s", file=sys.stderr)

    done = answered(args.out)
    rounds, answer_tokens, t0 = 0, 0, time.time()
    with open(args.out, "a") as out:
        for sample in range(args.first_sample, args.samples + 1):
            todo = [p for p in prompts if (p[0], sample) not in done]
            if todo and args.time_limit and time.time() - started > args.time_limit:
                break
            temperature = 0.0 if sample == 0 else args.temperature
            generator = torch.Generator(device=args.device).manual_seed(args.seed * 1000 + sample)
            i = 0
            while i < len(todo):
                j = i
                while j < len(todo) and j - i < args.batch and (j - i + 1) * (len(todo[j][1]) + args.max_new_tokens) <= args.batch_tokens:
                    j += 1
                j = max(j, i + 1)
                batch = todo[i:j]
                for (index, prompt), (_, ids) in zip(batch, answer(model, batch, args, temperature, generator, eos)):
                    answer_tokens += len(ids)
                    line = {"prompt": index, "sample": sample, "tokens": prompt + ids, "prompt_len": len(prompt)}
                    out.write(json.dumps(line, separators=(",", ":")) + "\n")
                i = j
            out.flush()
            rounds += 1
            elapsed = time.time() - t0
            print(f"round {sample} done: {answer_tokens} answer tokens in {elapsed:.1f} s ({answer_tokens / elapsed:.0f} tokens/s)", file=sys.stderr)
    print(json.dumps({"complete_rounds": rounds, "first_sample": args.first_sample, "answer_tokens": answer_tokens, "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
