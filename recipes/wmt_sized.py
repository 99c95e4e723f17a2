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
    """`pairs` pairs at out.de / out.en: Multi30k sentences joined one to three at a time, averaging WMT14's words."""
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
    """Run `command` under /usr/bin/time -v: peak RssAnon of its tree, max RSS, wall and first-step seconds."""
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


def preprocess(prefix: str, store_dir: str, vocab_size: int = 8000) -> dict:
    """Pairs/s of the corpus store's build against `encode_batch` of the same chunks (BPE trained first), in one run."""
    from train import data
    from train.data import corpus_store

    pairs = data.load_parallel(f"de:en:{prefix}").pairs
    tokenizers = data.train_tokenizers(pairs, vocab_size=vocab_size)
    start = time.perf_counter()
    for k in range(0, len(pairs), corpus_store.CHUNK):
        for tok, texts in zip((tokenizers.src, tokenizers.tgt), zip(*pairs[k : k + corpus_store.CHUNK])):
            tok.encode_batch(list(texts))
    library = time.perf_counter() - start
    Path(store_dir).parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    pairs_stream = data.corpora.stream_parallel(f"de:en:{prefix}", digest=False)[1]
    corpus_store.build_store(Path(store_dir), pairs_stream, tokenizers, progress=False)
    built = time.perf_counter() - start
    return {"pairs": len(pairs), "encode_batch_pairs_per_s": round(len(pairs) / library),
            "store_pairs_per_s": round(len(pairs) / built), "store_time_over_library": round(built / library, 2),
            "load_average": os.getloadavg(), "cpus": os.cpu_count()}


def batches(store_dir: str, budget: int = 25_000, count: int = 500) -> dict:
    """Packed batches of `budget` tokens a second from a corpus store, and the first window's plan's seconds."""
    from train.data import Batcher
    from train.data.corpus_store import open_store

    examples = open_store(Path(store_dir))
    start = time.perf_counter()
    batcher = Batcher(examples, budget, max_len=128, pack=True)
    assert batcher.num_batches  # the first window's plan, made now
    planned = time.perf_counter()
    for _ in range(count):
        next(batcher)
    made = time.perf_counter()
    return {"pairs": len(examples), "plan_s": round(planned - start, 2), "batches": count,
            "batches_per_s": round(count / (made - planned), 1), "shape": batcher.shapes}


def gather(store_dir: str, budget: int = 25_000, count: int = 300, seed: int = 0) -> dict:
    """Batches a second gathered from a store's .npy arrays and from a memory-mapped Arrow table of the same ids."""
    import tempfile

    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc

    from train.data.corpus_store import open_store

    stored = open_store(Path(store_dir))
    offsets = {side: np.append(stored.arrays[f"{side}_start"], len(stored.arrays[side])).astype(np.int32)
               for side in ("src", "tgt")}
    columns = {side: pa.ListArray.from_arrays(offsets[side], stored.arrays[side]) for side in ("src", "tgt")}
    rng = np.random.default_rng(seed)
    per_batch = round(budget / (len(stored.src) / len(stored)))  # pairs holding about `budget` source tokens
    picks = [rng.integers(0, len(stored), per_batch) for _ in range(count)]
    with tempfile.TemporaryDirectory() as tmp:
        datasets.Dataset(pa.table(columns)).save_to_disk(tmp)
        table = datasets.load_from_disk(tmp).data.table  # memory-mapped Arrow files
        npy = arrow = 0.0
        for idx in picks:  # the two in turn, batch by batch: the machine's load falls on both alike
            start = time.perf_counter()
            for side in ("src", "tgt"):
                values, lengths = stored.gather(side, idx)
            middle = time.perf_counter()
            rows = table.take(idx)
            for side in ("src", "tgt"):
                column = rows.column(side).combine_chunks()
                values, lengths = column.flatten().to_numpy(), pc.list_value_length(column).to_numpy()
            npy, arrow = npy + middle - start, arrow + time.perf_counter() - middle
    return {"pairs": len(stored), "pairs_a_batch": per_batch, "batches": count,
            "npy_batches_per_s": round(count / npy, 1), "arrow_batches_per_s": round(count / arrow, 1),
            "load_average": os.getloadavg()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    g = sub.add_parser("generate", help="write a WMT-shaped corpus: OUT.de and OUT.en")
    g.add_argument("--pairs", type=int, required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--multi30k", type=Path, default=MULTI30K, help="Multi30k's directory (train.de.gz, train.en.gz)")
    g.set_defaults(run=lambda x: generate(x.pairs, x.out, x.seed, x.multi30k))
    m = sub.add_parser("measure", help="run a command; print its peak memory and times as JSON")
    m.add_argument("command", nargs=argparse.REMAINDER)
    m.set_defaults(run=lambda x: measure(x.command[1:] if x.command[:1] == ["--"] else x.command))
    p = sub.add_parser("preprocess", help="pairs/s of the store's build of PREFIX.de/.en against encode_batch's")
    p.add_argument("prefix")
    p.add_argument("--store", required=True, help="the store directory to write (must not exist)")
    p.set_defaults(run=lambda x: preprocess(x.prefix, x.store))
    b = sub.add_parser("batches", help="packed batches of 25,000 tokens per second (train.data.Batcher)")
    b.add_argument("store", help="a corpus store directory")
    b.add_argument("--count", type=int, default=500, help="batches to make (past a window's: its plan counted)")
    b.set_defaults(run=lambda x: batches(x.store, count=x.count))
    a = sub.add_parser("gather", help="random batches of 25,000 tokens per second: .npy store against Arrow")
    a.add_argument("store", help="a corpus store directory")
    a.set_defaults(run=lambda x: gather(x.store))
    args = parser.parse_args(argv)
    result = args.run(args)
    if result is not None:  # generate writes files, no figures
        print(json.dumps(result))
        sys.exit(result.get("rc", 0))


if __name__ == "__main__":
    main()
