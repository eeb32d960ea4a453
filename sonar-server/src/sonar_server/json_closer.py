"""Closing a JSON text cut off mid-value: the shortest suffix that makes a prefix of a JSON
value whole (strings closed, a key given ``null``, a number or literal finished, open arrays
and objects closed). ``response_format: json_object`` uses it when ``max_tokens`` cuts the
object, so the content still parses."""

from __future__ import annotations

_LITERALS = ("true", "false", "null")


def closing_suffix(prefix: str) -> str | None:
    """The suffix that completes ``prefix`` (which must begin a JSON value) into valid JSON, or
    None when ``prefix`` is not the beginning of one. One pass, linear in ``prefix``."""
    stack: list[str] = []  # "{" or "["
    expect = "value"  # value | value_or_close | key | key_or_close | colon | comma (after a value)
    in_string = escape = False
    string_is_key = False
    token = ""  # a number or literal being read
    for char in prefix:
        if in_string:
            if escape:
                escape = False
            elif char == "\\":
                escape = True
            elif char == '"':
                in_string = False
                expect = "colon" if string_is_key else "comma"
            continue
        if token:
            if char.isalnum() or char in "+-.":
                token += char
                continue
            if not _token_done(token):
                return None
            token, expect = "", "comma"
        if char in " \t\r\n":
            continue
        if expect in ("value", "key_or_close", "value_or_close"):
            if (char == "]" and expect == "value_or_close") or (char == "}" and expect == "key_or_close"):
                stack.pop()
                expect = "comma"
            elif expect == "key_or_close" and char == '"':
                in_string, string_is_key = True, True
            elif expect == "key_or_close":
                return None
            elif char == '"':
                in_string, string_is_key = True, False
            elif char in "{[":
                stack.append(char)
                expect = "key_or_close" if char == "{" else "value_or_close"
            elif char in "-0123456789tfn":
                token = char
            else:
                return None
        elif expect == "key":
            if char != '"':
                return None
            in_string, string_is_key = True, True
        elif expect == "colon":
            if char != ":":
                return None
            expect = "value"
        elif expect == "comma":
            if not stack:
                return None
            if char == ",":
                expect = "key" if stack[-1] == "{" else "value"
            elif char == ("}" if stack[-1] == "{" else "]"):
                stack.pop()
                expect = "comma"
            else:
                return None
    if in_string:
        suffix = ("\\" if escape else "") + '"' + (": null" if string_is_key else "")
    elif token:
        finished = _finish_token(token)
        if finished is None:
            return None
        suffix = finished
    else:
        suffix = {"colon": ": null", "value": "null", "key": '"": null'}.get(expect, "")
    if not stack and expect in ("comma", "end") and not in_string and not token:
        return ""
    return suffix + "".join("}" if opener == "{" else "]" for opener in reversed(stack))


def _token_done(token: str) -> bool:
    if token[0] in "tfn":
        return token in _LITERALS
    return _finish_token(token) == ""


def _finish_token(token: str) -> str | None:
    if token[0] in "tfn":
        literal = next((word for word in _LITERALS if word.startswith(token)), None)
        return None if literal is None else literal[len(token):]
    if token[-1] in "-+eE.":
        return "0"
    return ""
