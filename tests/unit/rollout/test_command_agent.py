"""The command agent's pure parts: the command line and the prompt a black-box agent is given."""

from __future__ import annotations

from services.rollout.command_agent import command_line, prompt_text


def test_placeholders_are_replaced_and_other_braces_kept() -> None:
    assert command_line(["a", "{prompt}", '{"k": "{api_key}"}', "{base_url}/x"], "p q", "http://h/v1", "KEY") == [
        "a", "p q", '{"k": "KEY"}', "http://h/v1/x"]


def test_the_prompt_is_the_first_messages_text_in_order() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": ""}, {"role": "user", "content": "U"}]
    assert prompt_text(messages) == "S\n\nU"
