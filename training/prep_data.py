"""Build the training data for the built-in tiny LLaMA (run on a machine with apt + ``tokenizers``).

    apt-get update && apt-get install -y bible-kjv bible-kjv-text fortunes fortunes-min dict-gcide dict-devil
    python3 training/prep_data.py --out .data/tiny_llama

Writes to ``--out``: ``tokenizer.json`` (byte-level BPE), ``train.npy`` / ``val.npy`` (uint16
token shards, documents separated by ``<|eos|>``), ``lexicon.json`` (ids of every synthetic-task
fragment, see ``macattn/evaluation/tasks.py``), ``heldout.txt`` (the first 200K characters of the
validation documents, shipped with the checkpoint) and ``manifest.json`` (sources, sizes, sha256).
Sources and licenses: training/DATA.md.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import re
import hashlib
import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]
HELDOUT_CHARS = 200_000


def load_tasks():
    spec = importlib.util.spec_from_file_location("_tasks", ROOT / "python/macattn/evaluation/tasks.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_tasks"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def kjv_documents() -> list[str]:
    """The King James Bible (public domain), one document per chapter."""
    text = subprocess.run(["bible", "-l0", "Gen1:1-Rev22:21"], check=True, capture_output=True,
                          text=True).stdout
    docs, cur = [], []
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        parts = s.split(" ", 1)
        if parts[0].isdigit() and len(parts) == 2:
            cur.append(parts[1])
        else:  # a chapter heading such as "Genesis 1"
            if cur:
                docs.append(" ".join(cur))
            cur = [s + "."]
    if cur:
        docs.append(" ".join(cur))
    return docs


def fortune_documents() -> list[str]:
    """Every fortune of the installed (non-offensive) fortune files, one document each."""
    docs = []
    for path in sorted(glob.glob("/usr/share/games/fortunes/*")):
        if os.path.splitext(path)[1] in (".dat", ".u8") or os.path.isdir(path) or os.path.islink(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            docs += [d.strip() for d in f.read().split("\n%\n") if d.strip()]
    return docs


def dictd_documents(name: str, chars_per_doc: int = 4000) -> list[str]:
    """A dictd database (``/usr/share/dictd/NAME.dict.dz``, gzip-readable) as plain-text documents of
    ~``chars_per_doc`` characters: whitespace collapsed, GCIDE's ``[1913 Webster]`` source tags dropped,
    consecutive entries grouped so a document is running dictionary prose rather than one headword."""
    with gzip.open(f"/usr/share/dictd/{name}.dict.dz", "rt", encoding="utf-8", errors="replace") as f:
        text = f.read()
    text = re.sub(r"\[[^\]]*Webster\]", "", text)
    docs, cur, size = [], [], 0
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        if not para or para.startswith(("00-database", "00database")):
            continue
        cur.append(para)
        size += len(para)
        if size >= chars_per_doc:
            docs.append("\n".join(cur))
            cur, size = [], 0
    if cur:
        docs.append("\n".join(cur))
    return docs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / ".data/tiny_llama"))
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--val-fraction", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sources = {"kjv": kjv_documents(), "fortunes": fortune_documents(), "gcide": dictd_documents("gcide"),
               "devil": dictd_documents("devil")}
    docs = [d for v in sources.values() for d in v]
    random.Random(a.seed).shuffle(docs)
    n_val = max(1, int(len(docs) * a.val_fraction))
    val_docs, train_docs = docs[:n_val], docs[n_val:]

    tasks = load_tasks()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=a.vocab_size, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # the task fragments join the tokenizer corpus once so numbers/keys get sensible merges
    tok.train_from_iterator(train_docs + ["".join(tasks.all_fragments())], trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    eos = tok.token_to_id("<|eos|>")

    def shard(ds):
        ids = []
        for enc in tok.encode_batch(ds):
            ids += enc.ids + [eos]
        return np.asarray(ids, dtype=np.uint16)

    train, val = shard(train_docs), shard(val_docs)
    # a slice of held-out text ships with the checkpoint: haystack of `macattn generate` / `macattn eval`
    (out / "heldout.txt").write_text("\n\n".join(val_docs)[:HELDOUT_CHARS], encoding="utf-8")
    np.save(out / "train.npy", train)
    np.save(out / "val.npy", val)
    lexicon = {f: tok.encode(f).ids for f in tasks.all_fragments()}
    (out / "lexicon.json").write_text(json.dumps(lexicon))
    sha = {n: hashlib.sha256((out / n).read_bytes()).hexdigest()
           for n in ("tokenizer.json", "train.npy", "val.npy", "lexicon.json")}
    manifest = dict(sources={k: len(v) for k, v in sources.items()}, n_train_docs=len(train_docs),
                    n_val_docs=len(val_docs), train_tokens=int(train.size), val_tokens=int(val.size),
                    vocab_size=tok.get_vocab_size(), specials=SPECIALS, seed=a.seed, sha256=sha)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main()
