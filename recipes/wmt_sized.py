"""WMT-shaped corpora from Multi30k, and the measurements of docs/scale.md (which shows each command)."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"  # beside the repository
# WMT14 en-de's training text: 4.5M pairs, 116M English words (Luong et al. 2015, §4.1): 25.8 words a sentence.
WMT14_EN_WORDS = 116e6 / 4.5e6
CHUNK = 100_000  # pairs drawn and written at a time: memory bounded whatever --pairs


def generate(pairs: int, out: str, seed: int = 0, multi30k: Path = MULTI30K) -> None:
    """`pairs` pairs at out.de / out.en: Multi30k training sentences joined one to three at a time (1 + a
    binomial(2, p) count, p chosen so that English sentences average WMT14's words), aligned line for line."""
    sides = {lang: gzip.open(multi30k / f"train.{lang}.gz", "rt", encoding="utf-8").read().splitlines()
             for lang in ("de", "en")}
    mean = np.mean([len(s.split()) for s in sides["en"]])
    p = float(np.clip((WMT14_EN_WORDS / mean - 1) / 2, 0, 1))
    rng = np.random.default_rng(seed)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    files = {lang: open(f"{out}.{lang}", "w", encoding="utf-8") for lang in sides}
    for start in range(0, pairs, CHUNK):
        n = min(CHUNK, pairs - start)
        counts, rows = 1 + rng.binomial(2, p, n), rng.integers(0, len(sides["en"]), (n, 3))
        for lang, lines in sides.items():
            files[lang].write("".join(" ".join(lines[i] for i in row[:k]) + "\n" for k, row in zip(counts, rows)))
    for file in files.values():
        file.close()


def tree_rss_anon(pid: int) -> int:
    """RssAnon in kB of `pid` and all its descendants (0 for a process that is gone)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += int(re.search(r"RssAnon:\s+(\d+)", Path(f"/proc/{p}/status").read_text())[1])
            for task in os.listdir(f"/proc/{p}/task"):
                todo += map(int, Path(f"/proc/{p}/task/{task}/children").read_text().split())
        except (OSError, TypeError):
            pass
    return total


def measure(command: list[str], first: str = r"^step 1/", every: float = 0.1) -> dict:
    """Run `command` under /usr/bin/time -v, echoing its output: peak RssAnon of its process tree (sampled
    every `every` s), time's maximum RSS, wall seconds, seconds until a line matches `first`."""
    start = time.perf_counter()
    proc = subprocess.Popen(["/usr/bin/time", "-v", *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # lines as they come
    found: dict = {"first_step_s": None, "max_rss_kb": None}

    def read():
        for line in proc.stdout:
            sys.stdout.write(line)
            if found["first_step_s"] is None and re.search(first, line):
                found["first_step_s"] = time.perf_counter() - start
            if m := re.search(r"Maximum resident set size \(kbytes\): (\d+)", line):
                found["max_rss_kb"] = int(m[1])

    reader = threading.Thread(target=read)
    reader.start()
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss_anon(proc.pid))
        time.sleep(every)
    reader.join()
    return {"command": " ".join(command), "rc": proc.returncode, "wall_s": round(time.perf_counter() - start, 1),
            "first_step_s": found["first_step_s"] and round(found["first_step_s"], 1),
            "peak_rss_anon_mb": round(peak / 1024),
            "max_rss_mb": found["max_rss_kb"] and round(found["max_rss_kb"] / 1024)}


def encode(prefix: str, tokenizer: str, batch: int = 10_000) -> dict:
    """Pairs/s of `tokenizers`' own encode_batch (all cores) over both sides of prefix.de / prefix.en."""
    from tokenizers import Tokenizer

    tok, pairs, start = Tokenizer.from_file(tokenizer), 0, time.perf_counter()
    with open(f"{prefix}.de", encoding="utf-8") as de, open(f"{prefix}.en", encoding="utf-8") as en:
        while lines := [line for _, line in zip(range(batch), de)]:
            tok.encode_batch(lines)
            tok.encode_batch([line for _, line in zip(range(len(lines)), en)])
            pairs += len(lines)
    seconds = time.perf_counter() - start
    return {"pairs": pairs, "seconds": round(seconds, 1), "pairs_per_s": round(pairs / seconds)}


def batches(prefix: str, tokenizer: str, pairs: int, budget: int = 25_000, count: int = 500) -> dict:
    """Packed training batches of `budget` tokens made per second by train.data.Batcher, from the first
    `pairs` pairs of prefix.de / prefix.en (or from a corpus store directory, where the store is there)."""
    from tokenizers import Tokenizer

    from train.data import Batcher

    if (Path(prefix) / "store.json").is_file():
        from train.data.store import open_store
        examples = open_store(Path(prefix))
    else:
        tok = Tokenizer.from_file(tokenizer)
        sides = []
        for lang in ("de", "en"):
            with open(f"{prefix}.{lang}", encoding="utf-8") as f:
                sides.append([e.ids for e in tok.encode_batch([line for _, line in zip(range(pairs), f)])])
        examples = list(zip(*sides))
    start = time.perf_counter()
    batcher = Batcher(examples, budget, max_len=128, pack=True)
    planned = time.perf_counter()
    for _ in range(count):
        next(batcher)
    made = time.perf_counter()
    return {"pairs": len(examples), "plan_s": round(planned - start, 2), "batches": count,
            "batches_per_s": round(count / (made - planned), 1), "shape": batcher.shapes}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    g = sub.add_parser("generate", help="write a WMT-shaped corpus: OUT.de and OUT.en")
    g.add_argument("--pairs", type=int, required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--multi30k", type=Path, default=MULTI30K, help="Multi30k's directory (train.de.gz, train.en.gz)")
    m = sub.add_parser("measure", help="run a command; print its peak memory and times as JSON")
    m.add_argument("command", nargs=argparse.REMAINDER)
    e = sub.add_parser("encode", help="pairs/s of tokenizers' encode_batch over PREFIX.de and PREFIX.en")
    e.add_argument("prefix")
    e.add_argument("--tokenizer", required=True)
    b = sub.add_parser("batches", help="packed batches of 25,000 tokens per second (train.data.Batcher)")
    b.add_argument("prefix", help="PREFIX of PREFIX.de and PREFIX.en, or a corpus store directory")
    b.add_argument("--tokenizer")
    b.add_argument("--pairs", type=int, default=200_000)
    args = parser.parse_args(argv)
    if args.what == "generate":
        return generate(args.pairs, args.out, args.seed, args.multi30k)
    if args.what == "measure":
        result = measure(args.command[1:] if args.command[:1] == ["--"] else args.command)
    elif args.what == "encode":
        result = encode(args.prefix, args.tokenizer)
    else:
        result = batches(args.prefix, args.tokenizer, args.pairs)
    print(json.dumps(result))
    sys.exit(result.get("rc", 0))


if __name__ == "__main__":
    main()
