"""Tool-call and reasoning parsers: pure Python, incremental (feed chunks, then finish).
One file per tool-call family; importing this package registers them all in TOOL_PARSERS."""
from xinfer.parsers.base import TOOL_PARSERS, ToolParser, choose_tool_parser, get_tool_parser
# The import order is TOOL_PARSERS' order (the CLI lists the names in it).
from xinfer.parsers.json_calls import JsonToolParser
from xinfer.parsers.qwen import QwenToolParser
from xinfer.parsers.qwen_coder import QwenCoderToolParser
from xinfer.parsers.llama import LlamaToolParser
from xinfer.parsers.mistral import MistralToolParser
from xinfer.parsers.pythonic import PythonicToolParser
from xinfer.parsers.deepseek import DeepSeekToolParser
from xinfer.parsers.glm import Glm45ToolParser, Glm47ToolParser
from xinfer.parsers.step3 import Step3ToolParser
from xinfer.parsers.kimi import KimiK2ToolParser
from xinfer.parsers.minimax import MiniMaxM2ToolParser
from xinfer.parsers.passthrough import PassthroughToolParser
from xinfer.parsers.reasoning import (
    ReasoningParser,
    reasoning_markers,
    starts_in_reasoning,
)
from xinfer.parsers.schema import check_arguments

__all__ = [
    "TOOL_PARSERS", "ReasoningParser", "ToolParser", "check_arguments",
    "choose_tool_parser", "get_tool_parser", "reasoning_markers", "starts_in_reasoning",
    "DeepSeekToolParser", "Glm45ToolParser", "Glm47ToolParser", "JsonToolParser", "KimiK2ToolParser",
    "LlamaToolParser", "MiniMaxM2ToolParser", "MistralToolParser", "PassthroughToolParser",
    "PythonicToolParser", "QwenCoderToolParser", "QwenToolParser", "Step3ToolParser",
]
