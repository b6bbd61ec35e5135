"""Test-wide setup: never reach the Hugging Face hub (checkpoints are written by the tests)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
