"""Throughput-first speculative batch generation with MTP draft heads."""
