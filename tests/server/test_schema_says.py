"""The OpenAPI schema says what validation enforces (issue 41, item 8; docs/design.md#admission-and-limits):
`background: 0` is refused as the schema's `false` says, and the cross-item 400s are in the fields' descriptions."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from unmask.server.messages import ToolMessage
from unmask.server.responses_protocol import FunctionCallOutputItem, ResponsesRequest


@pytest.mark.parametrize("value", [0, 0.0, True, "false"])
def test_background_takes_only_false_or_null(value):
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate({"model": "m", "input": "hi", "background": value})
    for ok in (False, None):
        ResponsesRequest.model_validate({"model": "m", "input": "hi", "background": ok})


def test_the_call_id_rules_are_in_the_schema():
    assert "input.N.call_id" in FunctionCallOutputItem.model_json_schema()["properties"]["call_id"]["description"]
    assert "messages.N.tool_call_id" in ToolMessage.model_json_schema()["properties"]["tool_call_id"]["description"]
