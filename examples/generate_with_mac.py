"""ModelRunner.generate with MAC on the packaged trained checkpoint (CPU, ~1 min on 2 cores).

    python3 examples/generate_with_mac.py [--context 2048] [--tokens 16]

Three needle prompts of different lengths go in one call (in-flight batching, paged KV, one MAC
ring slot each); the script prints each request's answer with MAC on and off.
"""
import argparse
import random

import torch

from macattn import MacConfig
from macattn.models.checkpoint import BUILTIN_CHECKPOINT_DIR, heldout_text, load_tokenizer
from macattn.evaluation.tasks import haystack_from, make_sample
from macattn.runtime import ModelRunner

p = argparse.ArgumentParser()
p.add_argument("--context", type=int, default=2048)
p.add_argument("--tokens", type=int, default=16)
a = p.parse_args()

tok = load_tokenizer()
hay = haystack_from(tok.encode(heldout_text()))
rng = random.Random(0)
samples = [make_sample("niah_single", n, rng, tok.encode, hay, bos=[tok.bos_token_id])
           for n in (a.context // 2, a.context * 3 // 4, a.context)]
prompts = [torch.tensor(s.ids) for s in samples]

for mac in (None, MacConfig(window=1024, band=256, tau=0.45)):
    runner = ModelRunner.from_hf(BUILTIN_CHECKPOINT_DIR, mac, torch_dtype=torch.float32)
    out = runner.generate(prompts, max_new_tokens=a.tokens, end_id=tok.eos_token_id, return_dict=True,
                          output_sequence_lengths=True)
    print("MAC" if mac else "full attention")
    for s, p_ids, ids, n in zip(samples, prompts, out["output_ids"], out["sequence_lengths"]):
        answer = tok.decode(ids[0, len(p_ids):int(n[0])])
        print(f"  {len(p_ids):>6} tokens  expected {tok.decode(s.answer)!r:>8}  got {answer!r}")
