"""Tool-call and reasoning parsers: pure Python, incremental (feed chunks, then finish)."""
from xinfer.parsers.reasoning import (
    ReasoningParser,
    reasoning_markers,
    starts_in_reasoning,
)
from xinfer.parsers.schema import check_arguments
from xinfer.parsers.tools import (
    TOOL_PARSERS,
    ToolCallDelta,
    ToolParser,
    choose_tool_parser,
    get_tool_parser,
)

__all__ = [
    "TOOL_PARSERS", "ReasoningParser", "ToolCallDelta", "ToolParser", "check_arguments",
    "choose_tool_parser", "get_tool_parser", "reasoning_markers", "starts_in_reasoning",
]
