"""Tokenizers built by the project (the tiny test checkpoints', the demo's) are the same in every
process: `ByteLevel.alphabet()` comes back in a new order in each process, and a tokenizer
trained from it in that order gave the same text different ids from one build to the next."""
import json
import subprocess
import sys

BUILD = """
import json, sys
from pipeline.model.tiny import make_tiny_tokenizer
from pipeline.demo.tokenizer import train_tokenizer
tiny = make_tiny_tokenizer(128)
demo = train_tokenizer(["def add(a, b):\\n    return a + b\\n", "Summarize: the cat sat."] * 20, vocab_size=300)
text = "def add(a, b): return {'cat': a}"
print(json.dumps([tiny.get_vocab(), demo.get_vocab(), tiny(text)["input_ids"], demo(text)["input_ids"]]))
"""


def _build() -> list:
    proc = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tokenizers_are_the_same_in_every_process():
    first, second = _build(), _build()
    assert first == second
