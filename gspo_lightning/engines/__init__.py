"""Sampling engines behind one seam: Hugging Face ``generate`` (``hf``, the default), vLLM colocated with the
trainer (``vllm``), vLLM in a process (and on devices) of its own (``vllm_process``), or vLLM servers on cores, GPUs
or machines of their own (``vllm_server``)."""

from __future__ import annotations

from typing import Literal

from gspo_lightning.engines.base import EngineSamples, SamplingEngine
from gspo_lightning.engines.hf import HFEngine
from gspo_lightning.engines.vllm_engine import VLLMEngine
from gspo_lightning.engines.vllm_process import VLLMProcessEngine
from gspo_lightning.engines.vllm_server import VLLMServerEngine

EngineName = Literal["hf", "vllm", "vllm_process", "vllm_server"]
ENGINES = {"hf": HFEngine, "vllm": VLLMEngine, "vllm_process": VLLMProcessEngine,
           "vllm_server": VLLMServerEngine}


def resolve_engine(engine: SamplingEngine | str, setting: str = "sampler.engine") -> SamplingEngine:
    """An engine instance: ``engine`` itself, or the named one with its default options."""
    if isinstance(engine, SamplingEngine):
        return engine
    if engine not in ENGINES:
        raise ValueError(
            f"{setting} must be one of {sorted(ENGINES)} or a SamplingEngine class_path, got {engine!r}"
        )
    return ENGINES[engine]()


__all__ = [
    "ENGINES", "EngineName", "EngineSamples", "HFEngine", "SamplingEngine", "VLLMEngine", "VLLMProcessEngine",
    "VLLMServerEngine",
    "resolve_engine",
]
