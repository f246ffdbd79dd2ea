#!/usr/bin/env python3
"""Training prompts where `train_prompts.jsonl` is thin: translation, summarisation, math.

Writes the shared prompts plus new ones, shuffled together (seeded), as one jsonl file with the
same fields (`id`, `source`, `prompt`) for `train_exit_head --prompts`:

- translation: German sentences from Debian's `fortunes-de` (GPL-2+; downloaded from the Debian
  mirror and checked against a pinned SHA-256, never stored in this repository), asked
  "Translate German to English: ..." and a few other phrasings;
- summarisation: the long passages already inside the shared prompts (Wikipedia, news, reviews,
  science backgrounds), asked for a summary;
- math: arithmetic word problems from templates with random names and numbers.

Every new prompt is checked against all of Spec-Bench: one shared run of 8 words with any
benchmark turn (case and punctuation ignored) drops it. Standard library only.

    python3 scripts/extra_prompts.py --out heads/train_prompts_plus.jsonl
"""

import argparse
import hashlib
import io
import json
import lzma
import random
import re
import sys
import tarfile
import urllib.request
from pathlib import Path

FORTUNES_URL = "http://deb.debian.org/debian/pool/main/f/fortunes-de/fortunes-de_0.35-1_all.deb"
FORTUNES_SHA256 = "03fe7a7912935bd3d4e02e38d79ef32a289097f8718d4488c409595abce067a0"
# Collections that are not prose (pictures, quiz answers, word lists, bilingual jokes).
FORTUNES_SKIP = {"asciiart", "quiz", "translations", "woerterbuch", "vornamen", "namen"}
NGRAM = 8


def words(text):
    return re.findall(r"\w+", text.lower())


def ngrams(text):
    w = words(text)
    return {tuple(w[i : i + NGRAM]) for i in range(len(w) - NGRAM + 1)}


def deb_members(data):
    """Files of a .deb's data archive (an `ar` archive holding data.tar.xz)."""
    if not data.startswith(b"!<arch>\n"):
        raise SystemExit("not a Debian package")
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        body = data[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size % 2)
        if name.startswith("data.tar"):
            raw = lzma.decompress(body) if name.endswith(".xz") else body
            with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
                for m in tar.getmembers():
                    if m.isfile():
                        yield m.name, tar.extractfile(m).read()
            return
    raise SystemExit("no data archive in the Debian package")


def german_sentences(deb):
    if deb:
        data = Path(deb).read_bytes()
    else:
        print(f"downloading {FORTUNES_URL}", file=sys.stderr)
        data = urllib.request.urlopen(FORTUNES_URL, timeout=60).read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != FORTUNES_SHA256:
        raise SystemExit(f"fortunes-de: SHA-256 {digest}, expected {FORTUNES_SHA256}")
    texts = []
    for name, body in deb_members(data):
        parts = name.split("/")
        if "fortunes" not in parts or parts[-1] in FORTUNES_SKIP or "." in parts[-1]:
            continue
        for cookie in body.decode("utf-8", "replace").split("\n%\n"):
            # Drop attributions ("-- Author") and join the wrapped lines.
            lines = [l.strip() for l in cookie.splitlines() if not l.strip().startswith("--")]
            text = " ".join(l for l in lines if l)
            # Prose only: no drawings, IRC logs or code.
            if 40 <= len(text) <= 400 and not re.search(r"[|_\\/]{3}|[<>#{}]", text):
                texts.append(text)
    return sorted(set(texts))


def passages(shared_prompts):
    """Long paragraphs of the shared prompts, with a leading label ('Context:') removed."""
    out = set()
    for p in shared_prompts:
        for para in re.split(r"\n+", p["prompt"]):
            para = para.strip()
            label = re.match(r"^[^.?!:]{1,40}:\s+", para)
            if label:
                para = para[label.end() :]
            if 500 <= len(para) <= 3000:
                out.add(para)
    return sorted(out)


NAMES = ["Ana", "Ben", "Chloe", "Dev", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jamal",
         "Kenji", "Lena", "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq"]
ITEMS = [("apples", "bag"), ("pencils", "box"), ("cookies", "tray"), ("stickers", "sheet"),
         ("eggs", "carton"), ("marbles", "jar"), ("cupcakes", "box"), ("bottles", "crate")]


def math_problem(rng):
    n, m = rng.choice(NAMES), rng.choice(NAMES)
    item, pack = rng.choice(ITEMS)
    a, b, c = rng.randint(2, 12), rng.randint(3, 30), rng.randint(2, 9)
    price, pct = rng.choice([0.5, 1.25, 2, 3.5, 4, 7.5, 12]), rng.choice([10, 15, 20, 25, 30, 40, 50])
    templates = [
        f"{n} buys {a} {pack}es of {item}. Each {pack} holds {b} {item}. {n} gives {c} {item} to each of {a} friends. How many {item} are left?",
        f"A {pack} of {item} costs ${price}. {n} buys {a} {pack}es and pays with a $100 bill. How much change does {n} get?",
        f"{n} has {a * b} {item}. {m} has {c} times as many. How many {item} do they have together?",
        f"A shirt costs ${b * 4}. It is on sale for {pct}% off. {n} buys {c} shirts. How much does {n} pay?",
        f"{n} reads {b} pages a day. The book has {b * a + c} pages. How many days does {n} need to finish it?",
        f"A train travels {b * 10} km in {c} hours. At the same speed, how far does it travel in {a} hours?",
        f"{n} saves ${b} every week. How many weeks does {n} need to save ${b * a * 3}?",
        f"{n} is {a + 20} years old. {m} is {c} years younger than twice {n}'s age. How old is {m}?",
        f"A rectangle is {a} m wide and {b} m long. What are its area and its perimeter?",
        f"{n} sold {b} {item} on Monday, {c} more on Tuesday than on Monday, and half as many on Wednesday as on Tuesday. How many {item} did {n} sell in the three days?",
        f"A recipe needs {c} cups of flour for {a} people. How many cups are needed for {a * 3} people?",
        f"{n} earns ${b} an hour and works {c} hours a day, {a % 5 + 2} days a week. After paying {pct}% tax, how much does {n} keep each week?",
        f"There are {b + 10} students in a class. {pct}% of them walk to school and the rest take the bus. How many take the bus?",
        f"Solve for x: {a}x + {b} = {a * c + b}.",
        f"What is {a * b} divided by {a}, plus {c} squared?",
        f"{n} and {m} share ${(a + c) * 10} in the ratio {a}:{c}. How much does each get?",
    ]
    return rng.choice(templates)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", default="../shared/data", help="folder of train_prompts.jsonl and spec_bench.jsonl")
    ap.add_argument("--out", required=True, help="jsonl file to write")
    ap.add_argument("--fortunes-deb", help="a downloaded fortunes-de_0.35-1_all.deb (else fetched)")
    ap.add_argument("--translation", type=int, default=1500, help="translation prompts to add")
    ap.add_argument("--summarization", type=int, default=800, help="summarisation prompts to add")
    ap.add_argument("--math", type=int, default=800, help="math prompts to add")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    shared = Path(args.shared)
    base = [json.loads(l) for l in (shared / "train_prompts.jsonl").read_text().splitlines() if l.strip()]
    bench = [json.loads(l) for l in (shared / "spec_bench.jsonl").read_text().splitlines() if l.strip()]
    banned = set().union(*(ngrams(t) for q in bench for t in q["turns"]))

    german = german_sentences(args.fortunes_deb)
    rng.shuffle(german)
    to_english = ["Translate German to English: {}", "Translate the following German text into English:\n{}",
                  "What does this German sentence mean in English? {}", "Translate into English: {}"]
    long_texts = passages(base)
    rng.shuffle(long_texts)
    summarize = ["Summarize: {}", "Summarize the following text in a few sentences.\n\n{}",
                 "Write a short summary of this passage:\n{}", "{}\n\nTL;DR:", "Give a one-paragraph summary: {}"]
    new = []
    new += [("debian-fortunes-de/translate", rng.choice(to_english).format(s)) for s in german[: args.translation]]
    new += [("train-passages/summarize", rng.choice(summarize).format(p)) for p in long_texts[: args.summarization]]
    new += [("templates/math-word-problem", math_problem(rng)) for _ in range(args.math)]

    seen = {p["prompt"] for p in base}
    kept, dropped = [], 0
    for source, prompt in new:
        if prompt in seen or ngrams(prompt) & banned:
            dropped += 1
            continue
        seen.add(prompt)
        kept.append({"id": f"extra-{len(kept)}", "source": source, "prompt": prompt})
    merged = base + kept
    rng.shuffle(merged)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in merged))
    counts = {}
    for p in kept:
        counts[p["source"]] = counts.get(p["source"], 0) + 1
    print(json.dumps({"out": str(out), "shared": len(base), "added": counts,
                      "dropped_as_duplicates_or_benchmark_overlap": dropped, "total": len(merged)}))


if __name__ == "__main__":
    main()
