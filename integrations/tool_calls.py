"""Tool calling over structured outputs, for the adapters: ``lazy_rag.structured``'s ``plan_tools``
and ``parse_tool_call`` (the server's tools use the same grammar and call format)."""
from lazy_rag.structured import ToolPlan, parse_tool_call, plan_tools

__all__ = ["ToolPlan", "parse_tool_call", "plan_tools"]
