"""kvmesh: share LLM KV caches between Apple-silicon Macs on one network."""

__version__ = "0.1.0"
