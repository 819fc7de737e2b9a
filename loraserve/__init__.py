"""loraserve: multi-LoRA LLM serving with one page pool for KV cache and adapters."""

from loraserve.config import EngineConfig
from loraserve.entrypoints.llm import LLM
from loraserve.outputs import CompletionOutput, RequestOutput
from loraserve.sampling_params import SamplingParams
from loraserve.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
