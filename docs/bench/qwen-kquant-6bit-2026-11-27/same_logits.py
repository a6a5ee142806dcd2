"""Qwen2.5-Coder-0.5B at this session's code (Q6_K in 6 bits, Q5_0 in 5 bits: 397 MB a step) against c39b9ac's (500 MB,
imported as dartspec_old as for ab_q6k.py): the logits of a prefill and of a verification, compared bit for bit."""

import sys

import torch

sys.path.insert(0, "/tmp/ab/oldpkg")
import dartspec_old.targets as ot

import dartspec.targets as nt
from dartspec.tree import Tree

torch.set_num_threads(2)
old, new = ot.load_target("qwen2.5-coder-0.5b"), nt.load_target("qwen2.5-coder-0.5b")
print(old.weight_bytes / 1e6, new.weight_bytes / 1e6)
ids = new.tokenizer('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')["input_ids"]
a, b = old.prefill(ids), new.prefill(ids)
print("prefill logits equal:", torch.equal(a.logits, b.logits))
chain = Tree.chain(5, [6, 7])
print("verify equal:", torch.equal(old.verify(chain).logits, new.verify(chain).logits))
